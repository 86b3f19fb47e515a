import CTPM
import Foundation
import Glibc

/// What a TPM 2.0 answered, as the keybag and the daemon need it. Messages carry no secret.
public enum TPMError: Error, Equatable, CustomStringConvertible {
    /// The authorization (the passcode) was wrong: one more failure in the TPM's lockout counter.
    case badAuth
    /// The TPM is in dictionary-attack lockout: one try is forgiven every `retryAfter` seconds.
    case lockout(retryAfter: Double)
    /// The sealed object does not load: another TPM, or this one was cleared.
    case notThisTPM(String)
    /// The TPM cannot be reached (no device, no simulator, a connection that broke).
    case unreachable(String)
    /// The NV counter of this device is not defined on the TPM (cleared, or another TPM).
    case nvMissing
    /// The sealed object's epoch has passed: it belongs to a passcode since replaced.
    case stale
    /// The PCRs the sealed object is bound to changed (the machine's boot state differs).
    case pcrChanged
    /// Anything else the TPM or tpm2-tss refused.
    case failed(String)

    public var description: String {
        switch self {
        case .badAuth: return "wrong passcode (the TPM refused the authorization)"
        case .lockout(let s): return "the TPM is in dictionary-attack lockout; retry in \(Int(s.rounded(.up))) s"
        case .notThisTPM(let m): return "the TPM does not hold this device's sealed secret (cleared or replaced?): \(m)"
        case .unreachable(let m): return "cannot reach the TPM: \(m)"
        case .nvMissing: return "the TPM has no keybag counter for this device (cleared or replaced?)"
        case .stale:
            return
                "the TPM no longer releases this keybag's secret: it belongs to a passcode since replaced (the keybag "
                + "was put back from an older copy)"
        case .pcrChanged:
            return "the machine's boot state (the TPM PCRs this device's secret is bound to) changed since enrollment"
        case .failed(let m): return "TPM: \(m)"
        }
    }

    /// The CTPM return code of this error.
    var code: Int32 {
        switch self {
        case .badAuth: return Int32(KBFS_TPM_BAD_AUTH)
        case .lockout: return Int32(KBFS_TPM_LOCKOUT)
        case .notThisTPM: return Int32(KBFS_TPM_NOT_THIS_TPM)
        case .unreachable: return Int32(KBFS_TPM_UNREACHABLE)
        case .nvMissing: return Int32(KBFS_TPM_NV_MISSING)
        case .stale: return Int32(KBFS_TPM_STALE)
        case .pcrChanged: return Int32(KBFS_TPM_PCR_CHANGED)
        case .failed: return Int32(KBFS_TPM_ERROR)
        }
    }

    /// The error for a CTPM return code and its message.
    init(code: Int32, message: String, retryAfter: Double = 0) {
        switch code {
        case Int32(KBFS_TPM_BAD_AUTH): self = .badAuth
        case Int32(KBFS_TPM_LOCKOUT): self = .lockout(retryAfter: retryAfter)
        case Int32(KBFS_TPM_NOT_THIS_TPM): self = .notThisTPM(message)
        case Int32(KBFS_TPM_UNREACHABLE): self = .unreachable(message)
        case Int32(KBFS_TPM_NV_MISSING): self = .nvMissing
        case Int32(KBFS_TPM_STALE): self = .stale
        case Int32(KBFS_TPM_PCR_CHANGED): self = .pcrChanged
        default: self = .failed(message)
        }
    }
}

/// The TPM's dictionary-attack state (TPM2_GetCapability): its own counter and limits.
public struct TPMLockoutState: Sendable, Equatable {
    /// Failed authorizations counted now.
    public let counter: Int
    /// Failures allowed before lockout.
    public let maxTries: Int
    /// Seconds after which one failure is forgiven (the retry time in lockout).
    public let recoveryTime: Int
    /// Seconds before the lockout authorization may be tried again after it failed.
    public let lockoutRecovery: Int
    /// Whether the TPM is locked out now.
    public let inLockout: Bool
    /// Whether the TPM's lockout authorization is set (if not, any root user can clear the
    /// lockout, and the TPM's throttle binds only those who are not root).
    public let lockoutAuthSet: Bool
}

/// One short-lived connection to a TPM 2.0 through tpm2-tss (the CTPM shim): opened for
/// one operation, closed after it (a context is not thread-safe and dies with its transport).
final class TPMConnection {
    /// The shim's context.
    private let handle: OpaquePointer

    /// Connects through `tcti` (`device:/dev/tpmrm0`, `swtpm:host=…,port=…`) and re-creates
    /// the storage primary from its fixed template. With `pinned` (the primary's name at
    /// enrollment), another TPM is refused before any authorization is sent to it.
    init(tcti: String, pinned: [UInt8]? = nil) throws {
        kbfs_tpm_quiet_logs()
        var h: OpaquePointer?
        try Self.call { kbfs_tpm_open(tcti, &h, $0, $1) }
        guard let h else { throw TPMError.failed("no context") }
        handle = h
        if let pinned, try primaryName() != pinned {
            throw TPMError.notThisTPM(
                "the TPM at \(tcti) is not the one this device enrolled (its storage key differs)")
        }
    }

    /// The storage primary's TPM name: this TPM's identity until it is cleared.
    func primaryName() throws -> [UInt8] {
        var out = [UInt8](repeating: 0, count: Int(KBFS_TPM_NAME_MAX))
        var n = out.count
        try Self.call { kbfs_tpm_primary_name(handle, &out, &n, $0, $1) }
        return Array(out[..<n])
    }

    /// Seals `secret` under `auth`, usable only while the epoch counter at `epoch` is at
    /// most `bound` and the PCRs of `pcrs` (bit i: PCR i) hold their values now (policy:
    /// PolicyAuthValue, PolicyNV, PolicyPCR).
    func seal(_ secret: SecureKey, auth: SecureKey, epoch: UInt32, nvAuth: SecureKey, bound: UInt64, pcrs: UInt32)
        throws
        -> (public: [UInt8], private: [UInt8])
    {
        var pub = [UInt8](repeating: 0, count: Int(KBFS_TPM_PUB_MAX)),
            priv = [UInt8](repeating: 0, count: Int(KBFS_TPM_PRIV_MAX))
        var pubLen = pub.count, privLen = priv.count
        try secret.withBytes { s in
            try auth.withBytes { a in
                try nvAuth.withBytes { v in
                    try Self.call {
                        kbfs_tpm_seal_epoch(
                            handle, s.baseAddress!.assumingMemoryBound(to: UInt8.self), s.count,
                            a.baseAddress!.assumingMemoryBound(to: UInt8.self), a.count, epoch,
                            v.baseAddress!.assumingMemoryBound(to: UInt8.self), v.count, bound, pcrs, &pub, &pubLen,
                            &priv,
                            &privLen, $0, $1)
                    }
                }
            }
        }
        return (Array(pub[..<pubLen]), Array(priv[..<privLen]))
    }

    /// Unseals an epoch-bound object into guarded memory; `stale` once its epoch has passed,
    /// `pcrChanged` when the PCRs of `pcrs` it was sealed with changed.
    func unseal(
        public pub: [UInt8], private priv: [UInt8], auth: SecureKey, epoch: UInt32, nvAuth: SecureKey, bound: UInt64,
        pcrs: UInt32
    ) throws -> SecureKey {
        do {
            return try SecureKey(count: 32) { out in
                var n = out.count
                try auth.withBytes { a in
                    try nvAuth.withBytes { v in
                        try Self.call {
                            kbfs_tpm_unseal_epoch(
                                handle, pub, pub.count, priv, priv.count,
                                a.baseAddress!.assumingMemoryBound(to: UInt8.self),
                                a.count, epoch, v.baseAddress!.assumingMemoryBound(to: UInt8.self), v.count, bound,
                                pcrs,
                                out.baseAddress!.assumingMemoryBound(to: UInt8.self), &n, $0, $1)
                        }
                    }
                }
                guard n == out.count else { throw TPMError.failed("the sealed secret has \(n) bytes, not 32") }
            }
        } catch TPMError.lockout {
            throw TPMError.lockout(retryAfter: Double(max(1, (try? lockoutState().recoveryTime) ?? 1)))
        }
    }

    deinit { kbfs_tpm_close(handle) }

    /// Runs a shim call with an error buffer; throws its code as a `TPMError`.
    private static func call(_ body: (UnsafeMutablePointer<CChar>, Int) -> Int32) throws {
        var err = [CChar](repeating: 0, count: 256)
        let rc = err.withUnsafeMutableBufferPointer { body($0.baseAddress!, $0.count) }
        guard rc == Int32(KBFS_TPM_OK) else {
            throw TPMError(
                code: rc, message: String(decoding: err.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
            )
        }
    }

    /// The TPM's dictionary-attack counter and limits.
    func lockoutState() throws -> TPMLockoutState {
        var da = kbfs_tpm_da()
        try Self.call { kbfs_tpm_da_info(handle, &da, $0, $1) }
        return TPMLockoutState(
            counter: Int(da.counter), maxTries: Int(da.max_tries), recoveryTime: Int(da.interval),
            lockoutRecovery: Int(da.recovery), inLockout: da.in_lockout != 0, lockoutAuthSet: da.lockout_auth_set != 0)
    }

    /// Defines a monotonic NV counter under `auth`; its index.
    func defineCounter(auth: SecureKey) throws -> UInt32 {
        var index: UInt32 = 0
        try auth.withBytes { a in
            try Self.call {
                kbfs_tpm_nv_define_counter(
                    handle, a.baseAddress!.assumingMemoryBound(to: UInt8.self), a.count, &index, $0, $1)
            }
        }
        return index
    }

    /// The NV counter's value.
    func readCounter(_ index: UInt32, auth: SecureKey) throws -> UInt64 {
        var v: UInt64 = 0
        try auth.withBytes { a in
            try Self.call {
                kbfs_tpm_nv_read_counter(
                    handle, index, a.baseAddress!.assumingMemoryBound(to: UInt8.self), a.count, &v, $0, $1)
            }
        }
        return v
    }

    /// Raises the NV counter by one.
    func incrementCounter(_ index: UInt32, auth: SecureKey) throws {
        try auth.withBytes { a in
            try Self.call {
                kbfs_tpm_nv_increment(
                    handle, index, a.baseAddress!.assumingMemoryBound(to: UInt8.self), a.count, $0, $1)
            }
        }
    }

    /// Sets the TPM's lockout authorization to `new` (nil: empty), authorized by `old` (nil: empty).
    func changeLockoutAuth(from old: SecureKey?, to new: SecureKey?) throws {
        try Self.withOptional(old) { o, ol in
            try Self.withOptional(new) { n, nl in
                try Self.call { kbfs_tpm_lockout_change_auth(handle, o, ol, n, nl, $0, $1) }
            }
        }
    }

    /// Ends the TPM's dictionary-attack lockout (its counter back to 0), with the lockout authorization.
    func resetLockout(auth: SecureKey?) throws {
        try Self.withOptional(auth) { a, al in try Self.call { kbfs_tpm_lockout_reset(handle, a, al, $0, $1) } }
    }

    /// Runs `body` with a key's bytes, or with (nil, 0) for none.
    private static func withOptional(
        _ key: SecureKey?, _ body: (UnsafePointer<UInt8>?, Int) throws -> Void
    ) throws {
        guard let key else { return try body(nil, 0) }
        try key.withBytes { try body($0.baseAddress!.assumingMemoryBound(to: UInt8.self), $0.count) }
    }

    /// Releases the NV counter's space.
    func undefineCounter(_ index: UInt32) throws {
        try Self.call { kbfs_tpm_nv_undefine(handle, index, $0, $1) }
    }
}

/// Which TPM a command uses: `--tpm2 auto|on|off` with `--tpm2-device TCTI`.
public enum TPMChoice: String, Sendable, CaseIterable {
    case auto, on, off

    /// The kernel's TPM resource manager, the TCTI of a machine's own TPM.
    public static let defaultDevice = "/dev/tpmrm0"

    /// The TCTI to use, or nil for none: `on` needs a TPM (the one named, or the machine's),
    /// `auto` takes the one named or the machine's when present, `off` none.
    public func tcti(device: String?) throws -> String? {
        switch self {
        case .off: return nil
        case .auto, .on:
            if let device { return device }
            if access(Self.defaultDevice, R_OK | W_OK) == 0 { return "device:" + Self.defaultDevice }
            guard self == .auto else {
                throw KeybagError.invalid(
                    "--tpm2 on: this machine has no TPM at \(Self.defaultDevice); name one with --tpm2-device TCTI")
            }
            return nil
        }
    }
}
