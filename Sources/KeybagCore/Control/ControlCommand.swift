/// A request the daemon acts on, its arguments checked and its passcodes in guarded
/// memory (owned by the `ControlRequest` it came from, which wipes them).
public enum ControlCommand: Sendable {
    case status, subscribe, policy
    case unlock(passcode: SecureKey)
    /// Lock after `grace` seconds (nil: the mount's default).
    case lock(grace: Double?)
    case passwd(old: SecureKey, new: SecureKey)
}

extension ControlRequest {
    /// Parses a line into a request, or the refusal to send for it.
    public static func parsed(_ line: UnsafeRawBufferPointer) -> Result<ControlRequest, ControlRefusal> {
        do { return .success(try parse(line)) } catch {
            return .failure(ControlRefusal(.badRequest, "not a flat JSON object: \(error)"))
        }
    }

    /// The operation the request names.
    public func operation() -> Result<ControlOp, ControlRefusal> {
        guard let name = op else { return .failure(ControlRefusal(.badRequest, "missing \"op\"")) }
        guard let known = ControlOp(rawValue: name) else {
            // Quote at most 40 characters: the reply must not echo a 64 KiB line back.
            let shown = name.count > 40 ? String(name.prefix(40)) + "…" : name
            return .failure(ControlRefusal(.badRequest, "unknown op \"\(shown)\""))
        }
        return .success(known)
    }

    /// The command for `op` with its arguments, or why they are not acceptable.
    public func command(_ op: ControlOp) -> Result<ControlCommand, ControlRefusal> {
        switch op {
        case .status: return .success(.status)
        case .subscribe: return .success(.subscribe)
        case .policy: return .success(.policy)
        case .unlock:
            guard let p = secrets["passcode"] else {
                return .failure(ControlRefusal(.badRequest, "unlock needs a non-empty \"passcode\" string"))
            }
            return .success(.unlock(passcode: p))
        case .passwd:
            guard let o = secrets["old"], let n = secrets["new"] else {
                return .failure(ControlRefusal(.badRequest, "passwd needs non-empty \"old\" and \"new\" strings"))
            }
            return .success(.passwd(old: o, new: n))
        case .lock:
            guard let g = fields["grace"] else { return .success(.lock(grace: nil)) }
            guard case .number(let d) = g, d >= 0, d < 86_400 else {
                return .failure(ControlRefusal(.badRequest, "\"grace\" must be a number of seconds from 0 to 86400"))
            }
            return .success(.lock(grace: d))
        }
    }
}
