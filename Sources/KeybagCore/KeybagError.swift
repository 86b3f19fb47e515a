import Glibc

/// Errors of the core, mapped to errno by the daemon and to messages by the tools.
public enum KeybagError: Error, Equatable, CustomStringConvertible {
    /// The key needed for this operation has been evicted (device locked / before first unlock).
    case keyUnavailable
    /// Authentication of stored data failed: tampered, truncated, moved or corrupt.
    case corrupt(String)
    /// The passcode did not unlock the keybag.
    case badPasscode
    /// The device key does not belong to this store.
    case badDeviceKey
    /// Input was not understood.
    case invalid(String)
    /// An operating-system call failed.
    case system(String, Int32)
    /// The recovery key does not open this store.
    case badRecoveryKey
    /// Too many wrong attempts in a row: try again after this many seconds.
    case throttled(retryAfter: Double)

    public var description: String {
        switch self {
        case .keyUnavailable: return "protected data is not available (key evicted)"
        case .corrupt(let what): return "corrupt or tampered data: \(what)"
        case .badPasscode: return "wrong passcode"
        case .badDeviceKey: return "the device key does not open this store"
        case .badRecoveryKey: return "wrong recovery key"
        case .throttled(let s): return "too many wrong attempts: try again in \(Int(s.rounded(.up))) s"
        case .invalid(let what): return what
        case .system(let what, let err): return "\(what): \(String(cString: strerror(err)))"
        }
    }
}
