import Foundation

/// Delay policy after failed unlocks: none for the first four, then 1, 5, 15, 15 minutes,
/// then 60 minutes for each further failure (as iOS).
public enum UnlockThrottle {
    /// Seconds of lockout after the `failures`-th failure in a row.
    public static func delay(afterFailures failures: Int) -> Double {
        switch failures {
        case ..<5: return 0
        case 5: return 60
        case 6: return 300
        case 7, 8: return 900
        default: return 3600
        }
    }
}
