import CSodium
import Foundation

/// Every key of a store as one device holds it: the class keys of each key set (set n at
/// index n) and the volume key. What a device keybag is made from, and what escrow restores.
public struct StoreKeys: Sendable {
    /// Class A, B and C of each key set, oldest first.
    public var sets: [UnlockedClassKeys]
    /// Class D of each key set, oldest first.
    public var classD: [SecureKey]
    /// The volume key (names); one for the store's life.
    public let volume: SecureKey

    /// The newest key set: the one new files are wrapped for.
    public var current: Int { sets.count - 1 }

    /// Zeroes every key.
    public func wipe() {
        for s in sets { s.wipe() }
        for d in classD { d.wipe() }
        volume.wipe()
    }

    /// Appends a key set of fresh random keys (a device removal).
    mutating func addFreshSet() throws {
        let a = SecureKey(random: 32), b = SecureKey(random: 32), c = SecureKey(random: 32)
        let pk = try ClassBAgreement.publicKey(of: b)
        sets.append(
            UnlockedClassKeys(classA: a, classBSecret: b, classBPublic: pk, classC: c, keySet: UInt8(sets.count)))
        classD.append(SecureKey(random: 32))
    }

    /// Whether `other` holds the very same keys, set by set.
    func sameKeys(as other: StoreKeys) throws -> Bool {
        guard sets.count == other.sets.count else { return false }
        func eq(_ a: SecureKey, _ b: SecureKey) throws -> Bool {
            try a.withBytes { x in
                try b.withBytes { y in
                    x.count == y.count && sodium_memcmp(x.baseAddress!, y.baseAddress!, x.count) == 0
                }
            }
        }
        for (x, y) in zip(sets, other.sets) {
            guard try eq(x.classA, y.classA), try eq(x.classBSecret, y.classBSecret), try eq(x.classC, y.classC) else {
                return false
            }
        }
        for (x, y) in zip(classD, other.classD) where try !eq(x, y) { return false }
        return try eq(volume, other.volume)
    }

    /// Slot name and key of every escrowed key (`A`, `B`, `C`, `D` per set, and `volume`).
    func escrowEntries() -> [(String, SecureKey)] {
        var out: [(String, SecureKey)] = []
        for n in 0...current {
            let s = sets[n]
            out += [("A", s.classA), ("B", s.classBSecret), ("C", s.classC), ("D", classD[n])].map {
                (Keybag.slot($0.0, n), $0.1)
            }
        }
        out.append(("volume", volume))
        return out
    }
}

/// The key sets of a keybag (set n's slots `A.n`, `B.n`, `C.n`, `D.n`): wrapping them,
/// starting a new one (a device removal, a TPM enrollment) and saving them.
public enum KeySets {
    /// Devices of this store other than this keybag's whose keybags lack key set `n`: they
    /// could open no file rewrapped for it (until they take it up with `keybagfs recover`).
    public static func devicesWithout(_ kb: Keybag, keySet n: Int) -> [String] {
        StoreDevices.list(storePath: kb.storePath).compactMap { d in
            guard let rel = d.keybag, rel != kb.relativePath,
                let kb = try? Keybag.load(storePath: kb.storePath, relativePath: rel), kb.currentKeySet < n
            else { return nil }
            return d.name ?? d.id ?? rel
        }
    }

    /// Wraps class A, B and C of every set under the passcode key into `f`, with each set's
    /// class B public key; `f.keySet` becomes the newest set.
    static func wrapPasscodeSlots(
        _ sets: [UnlockedClassKeys], into f: inout KeybagFile, passcodeKey: SecureKey
    ) throws {
        for (n, s) in sets.enumerated() {
            for (base, key) in [("A", s.classA), ("B", s.classBSecret), ("C", s.classC)] {
                let slot = Keybag.slot(base, n)
                f.wrapped[slot] = Data(try KeyWrap.wrap(key, with: passcodeKey, ad: KeybagMACs.ad(f.storeID, slot)))
                    .base64EncodedString()
            }
            let pk = Data(s.classBPublic).base64EncodedString()
            if n == 0 {
                f.classBPublic = pk
            } else {
                f.classBPublics = (f.classBPublics ?? [:]).merging([String(n): pk]) { $1 }
            }
        }
        f.keySet = sets.count > 1 ? sets.count - 1 : nil
        if sets.count > 1 { f.format = max(f.format, Keybag.keySetsFormat) }
    }

    /// Wraps class D of every set and the volume key under the device wrap key into `f`
    /// (format 2's associated data or later).
    static func wrapDeviceSlots(_ keys: StoreKeys, into f: inout KeybagFile, deviceWrapKey: SecureKey) throws {
        var entries = keys.classD.enumerated().map { (Keybag.slot("D", $0.offset), $0.element) }
        entries.append(("volume", keys.volume))
        for (slot, key) in entries {
            let ad = KeybagMACs.ad(f.storeID, slot, format: f.format)
            f.wrapped[slot] = Data(try KeyWrap.wrap(key, with: deviceWrapKey, ad: ad)).base64EncodedString()
        }
    }

    /// Wraps every key of `keys` into `f`: classes A, B, C under the passcode key of
    /// `passcode` and `deviceKey` (with `f`'s salt and cost), D and the volume key under the
    /// device wrap key.
    /// With a TPM (`f.tpm2`), `sealer` gives (or, for a new salt, seals) the secret.
    static func wrapAll(
        _ keys: StoreKeys, into f: inout KeybagFile, passcode: SecureKey, deviceKey: SecureKey,
        sealer: (any PasscodeSealer)? = nil
    ) throws {
        let kek = try PasscodeKey.derive(
            passcode: passcode, file: f, deviceKey: deviceKey, sealer: sealer, making: true)
        defer { kek.wipe() }
        let dwk = try KeybagMACs.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        try wrapPasscodeSlots(keys.sets, into: &f, passcodeKey: kek)
        try wrapDeviceSlots(keys, into: &f, deviceWrapKey: dwk)
    }

    /// Starts a new key set (a device removal): fresh class keys A, B, C, D wrapped beside the
    /// older sets, which stay to open older files. New files are wrapped for the new set, which
    /// removed devices never get. A store with a recovery key needs it (every set is escrowed
    /// under it, so only its holders can write escrow slots); a wrong passcode is counted.
    /// Returns the new set's number.
    /// `withKeys` gets every key, the new set last, before they are wiped.
    public static func start(
        _ kb: inout Keybag, passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?,
        now: Double = Date().timeIntervalSince1970, withKeys: (StoreKeys) throws -> Void = { _ in }
    ) throws -> Int {
        let keys = try keysWithFreshSet(
            &kb, passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
        defer { keys.wipe() }
        try save(
            &kb, keys, into: kb.file, passcode: passcode, deviceKey: deviceKey, recovery: recovery, sealer: kb.sealer)
        try withKeys(keys)
        return keys.current
    }

    /// Every key of this keybag (from the passcode; a wrong one counted, the throttle applied) with
    /// a set of fresh keys appended, for a new key set; the caller wipes them. A store with a
    /// recovery key needs it, and its escrow must hold these very keys.
    static func keysWithFreshSet(
        _ kb: inout Keybag, passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?, now: Double
    ) throws -> StoreKeys {
        if kb.counterKey == nil { _ = try kb.authenticate(deviceKey: deviceKey, now: now) }
        let wait = PasscodeAttempts.retryAfter(kb, now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        guard kb.currentKeySet < Keybag.maxKeySet else {
            throw KeybagError.invalid("this store has \(Keybag.maxKeySet + 1) key sets, the most it can have")
        }
        guard kb.hasRecoveryKey == (recovery != nil) else {
            throw KeybagError.invalid(
                kb.hasRecoveryKey
                    ? "this store has a recovery key: give it (--recovery-key-file, --stdin) to cover the new keys"
                    : "this store has no recovery key")
        }
        var keys: StoreKeys
        do { keys = try kb.openAll(passcode: passcode, deviceKey: deviceKey) } catch KeybagError.badPasscode {
            try PasscodeAttempts.recordFailure(&kb, now: now)
            throw KeybagError.badPasscode
        }
        do {
            if let recovery {
                let escrowed = try RecoveryEscrow.keys(in: kb.file, recovery: recovery)
                defer { escrowed.wipe() }
                guard try escrowed.sameKeys(as: keys) else {
                    throw KeybagError.corrupt("the recovery slots do not match this keybag (damaged or replaced)")
                }
            }
            try keys.addFreshSet()
        } catch { keys.wipe(); throw error }
        return keys
    }

    /// Saves `next` with every key of `keys` in it (A, B, C under the passcode key through
    /// `sealer`, D and the volume key under the device wrap key), escrowed for `recovery`, its
    /// counter cleared; then the sealer keeps only `next`'s salt and the device's newest set is recorded.
    static func save(
        _ kb: inout Keybag, _ keys: StoreKeys, into next: KeybagFile, passcode: SecureKey, deviceKey: SecureKey,
        recovery: RecoveryKey?,
        sealer newSealer: (any PasscodeSealer)?
    ) throws {
        var next = next
        try wrapAll(keys, into: &next, passcode: passcode, deviceKey: deviceKey, sealer: newSealer)
        if let recovery { try RecoveryEscrow.write(&next, keys: keys.escrowEntries(), recovery: recovery) }
        try PasscodeKey.install(&kb, next, sealer: newSealer)
        try KeySetFloor.record(kb, deviceID: try DeviceIdentity.id(deviceKey: deviceKey, storeID: kb.file.storeID))
    }
}
