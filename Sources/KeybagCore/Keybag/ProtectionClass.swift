/// The four iOS Data Protection classes, by their `user.protection` names.
public enum ProtectionClass: UInt8, CaseIterable, Sendable, CustomStringConvertible {
    /// Class D: keys protected by the device key only; always available.
    case none = 4
    /// Class C (the default): available from the first unlock until the daemon restarts.
    case completeUntilFirstUserAuthentication = 3
    /// Class B: X25519; new files creatable while locked, open handles survive a lock.
    case completeUnlessOpen = 2
    /// Class A: unavailable while locked, even through handles opened earlier.
    case complete = 1

    /// The name used in `user.protection` and on the command line.
    public var name: String {
        switch self {
        case .none: return "none"
        case .completeUntilFirstUserAuthentication: return "completeUntilFirstUserAuthentication"
        case .completeUnlessOpen: return "completeUnlessOpen"
        case .complete: return "complete"
        }
    }

    /// Apple's constant name, accepted as an alias.
    public var appleName: String {
        switch self {
        case .none: return "NSFileProtectionNone"
        case .completeUntilFirstUserAuthentication: return "NSFileProtectionCompleteUntilFirstUserAuthentication"
        case .completeUnlessOpen: return "NSFileProtectionCompleteUnlessOpen"
        case .complete: return "NSFileProtectionComplete"
        }
    }

    /// The one-letter iOS class (A, B, C, D), used as the keybag slot name.
    public var letter: String {
        switch self {
        case .complete: return "A"
        case .completeUnlessOpen: return "B"
        case .completeUntilFirstUserAuthentication: return "C"
        case .none: return "D"
        }
    }

    public var description: String { name }

    /// Parses a class name or Apple alias; surrounding whitespace and one trailing NUL are tolerated.
    public init?(name raw: String) {
        var s = raw
        while s.hasSuffix("\0") { s.removeLast() }
        s = s.trimmingCharacters(in: .whitespacesAndNewlines)
        guard let c = ProtectionClass.allCases.first(where: { $0.name == s || $0.appleName == s }) else { return nil }
        self = c
    }
}

extension String {
    /// Trims characters of `set` at both ends (small helper to avoid Foundation in hot paths).
    func trimmingCharacters(in set: Set<Character>) -> String {
        var chars = Substring(self)
        while let f = chars.first, set.contains(f) { chars.removeFirst() }
        while let l = chars.last, set.contains(l) { chars.removeLast() }
        return String(chars)
    }
}

extension Set where Element == Character {
    /// Spaces, tabs and line ends.
    static let whitespacesAndNewlines: Set<Character> = [" ", "\t", "\n", "\r", "\r\n"]
}
