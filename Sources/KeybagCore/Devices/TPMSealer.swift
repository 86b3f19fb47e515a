import Dispatch
import Foundation
import Glibc

/// The hardware's part of a device's passcode key: a secret per keybag salt that the
/// hardware releases only for the right authorization (counting wrong ones in its own
/// lockout), and a monotonic counter of the keybag's generations (rollback). A TPM 2.0 is
/// the one kind (`TPMSealer`).
public protocol PasscodeSealer: Sendable {
    /// The secret sealed for keybag salt `salt`, released for `auth`; with `making`, a new
    /// random one is sealed when none is (wrapping under a new passcode).
    func secret(salt: String, auth: SecureKey, making: Bool) throws -> SecureKey
    /// Forgets the secrets of every salt but `salt` (once the keybag with it is saved).
    func keepOnly(salt: String) throws
    /// The keybag generation the hardware last counted (nil: it keeps none).
    func generation() throws -> UInt64?
    /// Counts one more keybag generation.
    func advanceGeneration() throws
    /// The hardware's lockout counter and limits.
    func lockoutState() throws -> TPMLockoutState
    /// Finishes a change a crash may have cut short: the secret of `salt` (the keybag's) is
    /// made the only one the hardware releases. Nothing is dropped from the enrollment.
    func settle(salt: String) throws
}

/// This device's TPM enrollment, kept outside the store beside its key-set floor
/// (`STATE/DEVICEID.tpm2`, STATE being `$STATE_DIRECTORY` or /var/lib/keybagfs; JSON, mode
/// 0600), so a sync engine never carries it to another device and the daemon and every
/// command find it whatever path the device key comes from (a file, a systemd credential):
/// the TCTI, the TPM's identity, one sealed object per keybag salt (two only while a passcode
/// changes), the keybag-generation and epoch counters.
public struct TPMEnrollment: Codable, Sendable, Equatable {
    /// One sealed object: TPM2B_PUBLIC and TPM2B_PRIVATE as tpm2-tss marshals them, base64,
    /// and the epoch it is bound to (it unseals only while the epoch counter is at most that).
    public struct SealedObject: Codable, Sendable, Equatable {
        public var publicBlob: String
        public var privateBlob: String
        public var bound: UInt64
    }

    /// Format of this file (1).
    public var format = 1
    /// How the TPM is reached (`device:/dev/tpmrm0`, `swtpm:host=…,port=…`).
    public var tcti: String
    /// Sealed objects by the keybag salt (`kdfSalt`) their authorization belongs to.
    public var objects: [String: SealedObject] = [:]
    /// The NV index of this device's keybag-generation counter.
    public var nvIndex: UInt32?
    /// The NV index of this device's epoch counter: it steps at each new sealed secret, and
    /// every older object is then refused by the TPM itself.
    public var epochIndex: UInt32?
    /// The TPM's storage primary name (hex), checked before any authorization is sent.
    public var primaryName: String?
    /// The PCRs (SHA-256 bank) every sealed object is bound to; nil or empty: none.
    public var pcrs: [Int]?
    /// Who holds the TPM's lockout authorization (nil: enrolled before keybagfs asked).
    public var lockout: TPMLockoutAuthority?
    /// The key set every file is still to be rewrapped for (an enrollment or `rewrap` cut short).
    public var pendingRewrap: Int?

    /// `pcrs` as a mask (bit i: PCR i).
    var pcrMask: UInt32 { (pcrs ?? []).reduce(0) { $0 | (($1 >= 0 && $1 < 24) ? UInt32(1) << UInt32($1) : 0) } }

    /// `primaryName` as bytes (nil: not pinned yet).
    var pin: [UInt8]? { primaryName.flatMap(Hex.bytes) }

    /// Where the enrollment of device `deviceID` lives.
    public static func path(deviceID: String) -> String { KeySetFloor.stateFolder + "/\(deviceID).tpm2" }

    /// The enrollment at `path`; nil when there is none. A primary's name that is not a TPM
    /// name (not hex, empty, too short or long) is refused: read as "not pinned yet" (as the
    /// helper process reads an empty one) it would leave the storage primary unchecked.
    public static func load(from path: String) throws -> TPMEnrollment? {
        guard let data = try StoreFileOpen.contents(path) else { return nil }
        let e: TPMEnrollment
        do { e = try JSONDecoder().decode(TPMEnrollment.self, from: data) } catch {
            throw KeybagError.corrupt("the TPM enrollment \(path) is not valid")
        }
        // A TPM object's name: a 2-byte hash algorithm and its digest (SHA-1 to SHA-512).
        if let name = e.primaryName, !(22...66).contains(Hex.bytes(name)?.count ?? 0) {
            throw KeybagError.corrupt(
                "the TPM enrollment \(path) pins a storage primary by a name that is not a TPM name")
        }
        return e
    }

    /// Writes the enrollment atomically (temp file, fsync, rename), mode 0600.
    func save(to path: String) throws {
        try? FileManager.default.createDirectory(
            atPath: PathText.parent(path), withIntermediateDirectories: true,
            attributes: [.posixPermissions: 0o700])
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        try AtomicFile.write(try enc.encode(self), to: path)
    }
}

/// A device's TPM 2.0 as its `PasscodeSealer`: each operation opens its own connection
/// (tpm2-tss contexts are not thread-safe), calls are serialised, the enrollment file is
/// rewritten atomically after each change.
public final class TPMSealer: PasscodeSealer {
    /// The enrollment file.
    public let path: String
    /// The enrollment as last written.
    let enrollment: Locked<TPMEnrollment>
    /// The NV counter's authorization (from the device key; not a passcode secret).
    private let nvAuth: SecureKey
    /// The enrollment a new one replaces: its NV counter goes once the keybag no longer needs it.
    let replaced = Locked<TPMEnrollment?>(nil)
    /// The lockout state last read (CLOCK_MONOTONIC ns) for `status`, which may be asked
    /// often: each read re-creates the storage primary, slow on some TPMs. Dropped at each
    /// unseal, so a status after an unlock attempt is fresh.
    private let lastState = Locked<(at: UInt64, state: TPMLockoutState)?>(nil)
    /// How long a read lockout state is reused.
    static let stateReuse: UInt64 = 2_000_000_000

    /// Where seal and unseal run: a helper process (the daemon), or this process (nil: the
    /// short-lived commands, whose memory ends with them).
    private let helper: TPMHelperProcess?

    private init(path: String, enrollment: TPMEnrollment, nvAuth: SecureKey, helper: TPMHelperProcess? = nil) {
        self.path = path
        self.enrollment = Locked(enrollment)
        self.nvAuth = nvAuth
        self.helper = helper
    }

    deinit { nvAuth.wipe() }

    /// The NV counter's authorization: BLAKE2b keyed by the device key.
    static func nvAuth(deviceKey: SecureKey, storeID: String) throws -> SecureKey {
        try deviceKey.withBytes {
            KeyWrap.keyedHash(key: $0, parts: [Array("keybagfs-tpm-nv-v1".utf8), Array(storeID.utf8)])
        }
    }

    /// The TCTI in use.
    public var tcti: String { enrollment.withLock { $0.tcti } }

    /// This device's enrollment (nil when there is none), reached through `tcti` when given
    /// (the TPM moved: another TCTI string for the same TPM).
    /// With `helper`, seal and unseal run in that helper process.
    public static func load(
        tcti: String?, deviceKey: SecureKey, storeID: String, helper: TPMHelperProcess? = nil
    ) throws -> TPMSealer? {
        let path = TPMEnrollment.path(deviceID: try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID))
        guard var e = try TPMEnrollment.load(from: path) else { return nil }
        if let tcti { e.tcti = tcti }
        return TPMSealer(
            path: path, enrollment: e, nvAuth: try nvAuth(deviceKey: deviceKey, storeID: storeID), helper: helper)
    }

    /// A new enrollment on the TPM at `tcti` (reached now, to fail early), its objects bound
    /// to `pcrs` (SHA-256 bank) at their values at each seal. Nothing is
    /// written on the TPM or to `path` until the first seal (after a recovery key or
    /// passcode was checked), which also defines the NV counter; the NV counter of an
    /// enrollment it replaces is released once the keybag is saved with the new one (`keepOnly`).
    /// With `previousDeviceID` (a new device key replaces the one of that id), the lockout record
    /// of that device's enrollment on the same TPM is carried over.
    public static func enroll(
        tcti: String, deviceKey: SecureKey, storeID: String, pcrs: [Int] = [], previousDeviceID: String? = nil
    ) throws -> TPMSealer {
        let name = try TPMConnection(tcti: tcti).primaryName().map { String(format: "%02x", $0) }.joined()
        guard pcrs.allSatisfy({ (0..<24).contains($0) }) else {
            throw KeybagError.invalid("--tpm2-pcrs: PCRs are numbered 0 to 23")
        }
        let path = TPMEnrollment.path(deviceID: try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID))
        var fresh = TPMEnrollment(tcti: tcti)
        fresh.pcrs = pcrs.isEmpty ? nil : Array(Set(pcrs)).sorted()
        let sealer = TPMSealer(
            path: path, enrollment: fresh, nvAuth: try nvAuth(deviceKey: deviceKey, storeID: storeID))
        let previous = (try? TPMEnrollment.load(from: path)).flatMap { $0 }
        sealer.replaced.withLock { $0 = previous }
        // The lockout record of the same TPM stays with the device (the keys that open it stay too).
        let earlier =
            previous
            ?? previousDeviceID.flatMap { id in
                (try? TPMEnrollment.load(from: TPMEnrollment.path(deviceID: id))).flatMap { $0 }.map {
                    var e = $0
                    let bound = e.lockout?.deviceID ?? id
                    e.lockout?.deviceID = bound
                    return e
                }
            }
        if let earlier, earlier.primaryName == name {
            sealer.enrollment.withLock { $0.lockout = earlier.lockout }
        }
        return sealer
    }

    /// The helper's view of where the TPM is, for an object bound to `bound`.
    private func target(_ e: TPMEnrollment, bound: UInt64) throws -> TPMHelperProcess.Target {
        guard let epoch = e.epochIndex else {
            throw KeybagError.invalid("this device's TPM enrollment \(path) names no epoch counter (it was edited)")
        }
        return .init(tcti: e.tcti, pin: e.pin ?? [], epoch: epoch, bound: bound, nvAuth: nvAuth, pcrs: e.pcrMask)
    }

    public func secret(salt: String, auth: SecureKey, making: Bool) throws -> SecureKey {
        defer { lastState.withLock { $0 = nil } }
        return try enrollment.withLock { e in
            if let o = e.objects[salt], let pub = Data(base64Encoded: o.publicBlob),
                let priv = Data(base64Encoded: o.privateBlob)
            {
                let t = try target(e, bound: o.bound)
                guard let helper else {
                    return try TPMConnection(tcti: e.tcti, pinned: e.pin).unseal(
                        public: [UInt8](pub), private: [UInt8](priv), auth: auth, epoch: t.epoch, nvAuth: nvAuth,
                        bound: o.bound, pcrs: t.pcrs)
                }
                do {
                    return try helper.unseal(t, public: [UInt8](pub), private: [UInt8](priv), auth: auth)
                } catch TPMError.lockout {
                    let wait = (try? TPMConnection(tcti: e.tcti).lockoutState().recoveryTime) ?? 1
                    throw TPMError.lockout(retryAfter: Double(max(1, wait)))
                }
            }
            guard making else {
                throw KeybagError.invalid(
                    "this device's TPM enrollment \(path) holds no secret for its keybag (one of the two was replaced); "
                        + "run `keybagfs recover` with the recovery key")
            }
            // A new secret for a new salt: bound to the epoch after the current one, which
            // `keepOnly` steps to once the keybag is saved (the older objects then die).
            let secret = SecureKey(random: 32)
            do {
                let tpm = try TPMConnection(tcti: e.tcti, pinned: e.pin)
                var next = e
                if next.primaryName == nil {
                    next.primaryName = try tpm.primaryName().map { String(format: "%02x", $0) }.joined()
                }
                if next.nvIndex == nil { next.nvIndex = try tpm.defineCounter(auth: nvAuth) }
                if next.epochIndex == nil { next.epochIndex = try tpm.defineCounter(auth: nvAuth) }
                let bound = try Self.counterCall { try tpm.readCounter(next.epochIndex!, auth: nvAuth) } + 1
                let (pub, priv) =
                    try helper.map { try $0.seal(try target(next, bound: bound), secret: secret, auth: auth) }
                    ?? tpm.seal(
                        secret, auth: auth, epoch: next.epochIndex!, nvAuth: nvAuth, bound: bound, pcrs: next.pcrMask)
                next.objects[salt] = .init(
                    publicBlob: Data(pub).base64EncodedString(), privateBlob: Data(priv).base64EncodedString(),
                    bound: bound)
                try next.save(to: path)
                e = next
            } catch { secret.wipe(); throw error }
            return secret
        }
    }

    public func keepOnly(salt: String) throws {
        try enrollment.withLock { e in
            if e.objects.keys.contains(where: { $0 != salt }) {
                var next = e
                next.objects = next.objects.filter { $0.key == salt }
                try next.save(to: path)
                e = next
            }
            try step(e, to: e.objects[salt]?.bound)
            // A replaced enrollment's counters on this TPM (they answer to this device's NV
            // authorization, so they are ours, not another store's at the same index): released.
            if let old = replaced.withLock({ r -> TPMEnrollment? in
                defer { r = nil }; return r
            }),
                let tpm = try? TPMConnection(tcti: e.tcti)
            {
                for index in [old.nvIndex, old.epochIndex].compactMap({ $0 })
                where index != e.nvIndex && index != e.epochIndex && (try? tpm.readCounter(index, auth: nvAuth)) != nil
                {
                    try? tpm.undefineCounter(index)
                }
            }
        }
    }

    public func settle(salt: String) throws {
        try enrollment.withLock { e in try step(e, to: e.objects[salt]?.bound) }
    }

    /// Steps the epoch counter up to `bound`: every object bound below it is then refused
    /// by the TPM (counters only go up, one at a time).
    private func step(_ e: TPMEnrollment, to bound: UInt64?) throws {
        guard let bound, let index = e.epochIndex else { return }
        let tpm = try TPMConnection(tcti: e.tcti, pinned: e.pin)
        var v = try Self.counterCall { try tpm.readCounter(index, auth: nvAuth) }
        while v < bound {
            try Self.counterCall { try tpm.incrementCounter(index, auth: nvAuth) }
            v += 1
        }
    }

    public func generation() throws -> UInt64? {
        try enrollment.withLock { e in
            guard let index = e.nvIndex else { return nil }
            return try Self.counterCall { try TPMConnection(tcti: e.tcti).readCounter(index, auth: nvAuth) }
        }
    }

    public func advanceGeneration() throws {
        try enrollment.withLock { e in
            guard let index = e.nvIndex else { return }
            try Self.counterCall { try TPMConnection(tcti: e.tcti).incrementCounter(index, auth: nvAuth) }
        }
    }

    /// A call on the NV counter: a refused authorization there is not a wrong passcode (the
    /// counter answers to the device key), but an index that is not this device's.
    private static func counterCall<R>(_ body: () throws -> R) throws -> R {
        do { return try body() } catch TPMError.badAuth {
            throw TPMError.failed(
                "the TPM refused this device's authorization for its keybag counter: the enrollment names an index "
                    + "that is not this device's (edited?)")
        }
    }

    public func lockoutState() throws -> TPMLockoutState {
        let now = DispatchTime.now().uptimeNanoseconds
        if let last = lastState.withLock({ $0 }), now &- last.at < Self.stateReuse { return last.state }
        let state = try enrollment.withLock { try TPMConnection(tcti: $0.tcti).lockoutState() }
        lastState.withLock { $0 = (now, state) }
        return state
    }

    /// Takes the device off its TPM: releases the NV counter (best effort: a cleared TPM
    /// has none) and deletes the enrollment file.
    public func remove() throws {
        try enrollment.withLock { e in
            for index in [e.nvIndex, e.epochIndex].compactMap({ $0 }) {
                do { try TPMConnection(tcti: e.tcti).undefineCounter(index) } catch TPMError.nvMissing {}
            }
            guard unlink(path) == 0 || errno == ENOENT else { throw KeybagError.system("cannot remove \(path)", errno) }
            DeviceKeyFile.syncFolder(of: path)
        }
    }
}
