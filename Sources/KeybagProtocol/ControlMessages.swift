/// The device states, by their contract names.
public enum LockState: String, Codable, Sendable, CaseIterable {
    case beforeFirstUnlock, unlocked, locking, locked
}

/// The notifications programs subscribe to.
public enum ProtectionEvent: String, Codable, Sendable {
    case willBecomeUnavailable = "protectedDataWillBecomeUnavailable"
    case didBecomeUnavailable = "protectedDataDidBecomeUnavailable"
    case didBecomeAvailable = "protectedDataDidBecomeAvailable"
    /// The device stayed locked past the inactivity limit: class C keys are gone too
    /// (the contract's name: SPEC.md §2).
    case didReturnToBeforeFirstUnlock = "deviceDidReturnToBeforeFirstUnlock"
}

/// The operations a request names in its `"op"` field.
public enum ControlOp: String, Codable, Sendable, CaseIterable {
    case status, subscribe, policy, unlock, lock, passwd

    /// The refusal for a peer that is neither root nor the mounting user; nil: anyone may ask.
    public var refusalForOthers: ControlRefusal? {
        switch self {
        case .status, .subscribe: return nil
        case .policy: return ControlRefusal(.forbidden, "only root and the mounting user may read the policy")
        case .unlock, .lock, .passwd:
            return ControlRefusal(.forbidden, "only root and the mounting user may \(rawValue)")
        }
    }
}

/// A request as a client sends it. Passcodes travel as JSON text; the daemon decodes them
/// from the line's bytes straight into guarded memory (`ControlRequest` in KeybagCore).
public enum ControlCall: Sendable, Equatable {
    case status, subscribe, policy
    case unlock(passcode: String)
    /// Lock after `grace` seconds (nil: the mount's default).
    case lock(grace: Double?)
    case passwd(old: String, new: String)

    /// The fields of a request line, absent ones left out.
    private struct Fields: Encodable {
        let op: ControlOp
        var grace: Double?, passcode: String?, old: String?, new: String?
    }

    /// The request as one JSON line (no newline).
    public var line: String {
        switch self {
        case .status: return ControlProtocol.encode(Fields(op: .status))
        case .subscribe: return ControlProtocol.encode(Fields(op: .subscribe))
        case .policy: return ControlProtocol.encode(Fields(op: .policy))
        case .unlock(let p): return ControlProtocol.encode(Fields(op: .unlock, passcode: p))
        case .lock(let g): return ControlProtocol.encode(Fields(op: .lock, grace: g))
        case .passwd(let o, let n): return ControlProtocol.encode(Fields(op: .passwd, old: o, new: n))
        }
    }
}

/// The reply of unlock, lock and subscribe: the state after the request.
public struct StateReply: Codable, Sendable, Equatable {
    public var ok = true
    public var state: LockState
    public init(_ state: LockState) { self.state = state }
}

/// The reply of a request that only succeeded (passwd).
public struct DoneReply: Codable, Sendable, Equatable {
    public var ok = true
    public init() {}
}

/// The code of a refusal (`"error"`); codes this build does not know still decode.
public struct RefusalCode: RawRepresentable, Codable, Sendable, Hashable, CustomStringConvertible {
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public init(from decoder: any Decoder) throws { rawValue = try decoder.singleValueContainer().decode(String.self) }
    public func encode(to encoder: any Encoder) throws {
        var c = encoder.singleValueContainer()
        try c.encode(rawValue)
    }
    public var description: String { rawValue }

    /// The line is not a request this daemon understands.
    public static let badRequest = RefusalCode(rawValue: "badRequest")
    /// The peer may not ask this.
    public static let forbidden = RefusalCode(rawValue: "forbidden")
    /// Wrong passcode (the failure was counted).
    public static let badPasscode = RefusalCode(rawValue: "badPasscode")
    /// Too many failures: wait `retryAfter` seconds.
    public static let throttled = RefusalCode(rawValue: "throttled")
    /// Too many connections of this uid.
    public static let busy = RefusalCode(rawValue: "busy")
    /// The daemon failed; the message says how.
    public static let `internal` = RefusalCode(rawValue: "internal")
}

/// A refused request: `{"ok":false,"error":CODE,"message":TEXT}` and, for passcode
/// failures, the failure count and the seconds to wait.
public struct ControlRefusal: Codable, Error, Sendable, Equatable {
    public var ok = false
    public var error: RefusalCode
    public var message: String
    public var retryAfter: Int?
    public var failedAttempts: Int?

    public init(_ error: RefusalCode, _ message: String, retryAfter: Int? = nil, failedAttempts: Int? = nil) {
        self.error = error
        self.message = message
        self.retryAfter = retryAfter
        self.failedAttempts = failedAttempts
    }

    enum CodingKeys: String, CodingKey { case ok, error, message, retryAfter, failedAttempts }

    /// Decodes any `{"ok":false,...}` line as a refusal: a missing code reads as `error`, a
    /// missing message as the code, and delays given in fractional seconds are rounded up.
    public init(from decoder: any Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        ok = try c.decodeIfPresent(Bool.self, forKey: .ok) ?? false
        error = (try? c.decodeIfPresent(RefusalCode.self, forKey: .error)) ?? RefusalCode(rawValue: "error")
        message = (try? c.decodeIfPresent(String.self, forKey: .message)) ?? error.rawValue
        func seconds(_ key: CodingKeys) -> Int? {
            guard let d = try? c.decodeIfPresent(Double.self, forKey: key), d.isFinite else { return nil }
            return Int(min(max(d.rounded(.up), 0), 1e9))
        }
        retryAfter = seconds(.retryAfter)
        failedAttempts = seconds(.failedAttempts)
    }
}

/// The `policy` reply: the mount's directory rules in order (the last match wins).
public struct PolicyReply: Codable, Sendable, Equatable {
    /// One rule: a directory pattern and the class its new files get.
    public struct Rule: Codable, Sendable, Equatable {
        public var pattern: String
        public var protectionClass: String
        enum CodingKeys: String, CodingKey { case pattern, protectionClass = "class" }
        public init(pattern: String, protectionClass: String) {
            self.pattern = pattern
            self.protectionClass = protectionClass
        }
    }
    public var ok = true
    public var rules: [Rule]
    public init(rules: [Rule]) { self.rules = rules }
}

/// One event line of a subscription.
public struct EventLine: Codable, Sendable, Equatable {
    public var event: ProtectionEvent
    public var state: LockState
    /// ISO 8601 with milliseconds, UTC.
    public var time: String
    public init(event: ProtectionEvent, state: LockState, time: String) {
        self.event = event
        self.state = state
        self.time = time
    }
}

/// An optional field written as `null` when absent (plain optionals are left out).
@propertyWrapper
public struct NullWhenAbsent<Value: Codable & Sendable & Equatable>: Codable, Sendable, Equatable {
    public var wrappedValue: Value?
    public init(wrappedValue: Value?) { self.wrappedValue = wrappedValue }
    public init(from decoder: any Decoder) throws {
        let c = try decoder.singleValueContainer()
        wrappedValue = c.decodeNil() ? nil : try c.decode(Value.self)
    }
    public func encode(to encoder: any Encoder) throws {
        var c = encoder.singleValueContainer()
        if let wrappedValue { try c.encode(wrappedValue) } else { try c.encodeNil() }
    }
}

extension KeyedDecodingContainer {
    /// A `NullWhenAbsent` field that is missing decodes as nil.
    public func decode<V>(_ type: NullWhenAbsent<V>.Type, forKey key: Key) throws -> NullWhenAbsent<V> {
        try decodeIfPresent(type, forKey: key) ?? NullWhenAbsent(wrappedValue: nil)
    }
}
