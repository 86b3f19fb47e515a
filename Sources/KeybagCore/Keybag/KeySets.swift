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

extension Keybag {
    /// Most key sets a store may have (the set number is one header byte).
    public static let maxKeySet = 255

    /// Wraps class A, B and C of every set under the passcode key into `f`, with each set's
    /// class B public key; `f.keySet` becomes the newest set.
    static func wrapPasscodeSlots(
        _ sets: [UnlockedClassKeys], into f: inout KeybagFile, passcodeKey: SecureKey
    ) throws {
        for (n, s) in sets.enumerated() {
            for (base, key) in [("A", s.classA), ("B", s.classBSecret), ("C", s.classC)] {
                let slot = slot(base, n)
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
        if sets.count > 1 { f.format = max(f.format, keySetsFormat) }
    }

    /// Wraps class D of every set and the volume key under the device wrap key into `f`
    /// (format 2's associated data or later).
    static func wrapDeviceSlots(_ keys: StoreKeys, into f: inout KeybagFile, deviceWrapKey: SecureKey) throws {
        var entries = keys.classD.enumerated().map { (slot("D", $0.offset), $0.element) }
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

    /// Every key this keybag holds, from the passcode and the device key; `badPasscode`
    /// when the passcode is wrong (not counted here).
    public func openAll(passcode: SecureKey, deviceKey: SecureKey) throws -> StoreKeys {
        let d = try classDKeys(deviceKey: deviceKey)
        let volume: SecureKey
        do { volume = try unwrapDeviceKeySlot("volume", deviceKey: deviceKey) } catch {
            d.values.forEach { $0.wipe() }
            throw error
        }
        let sets: [UnlockedClassKeys]
        do { sets = try unlockAll(passcode: passcode, deviceKey: deviceKey) } catch {
            d.values.forEach { $0.wipe() }; volume.wipe(); throw error
        }
        return StoreKeys(sets: sets, classD: (0...currentKeySet).map { d[UInt8($0)]! }, volume: volume)
    }

    /// Starts a new key set (a device removal): fresh class keys A, B, C, D wrapped beside the
    /// older sets, which stay to open older files. New files are wrapped for the new set, which
    /// removed devices never get. A store with a recovery key needs it (every set is escrowed
    /// under it, so only its holders can write escrow slots); a wrong passcode is counted.
    /// Returns the new set's number.
    /// `withKeys` gets every key, the new set last, before they are wiped.
    public mutating func startKeySet(
        passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?,
        now: Double = Date().timeIntervalSince1970, withKeys: (StoreKeys) throws -> Void = { _ in }
    ) throws -> Int {
        let keys = try keysWithFreshSet(passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
        defer { keys.wipe() }
        try saveKeySets(keys, into: file, passcode: passcode, deviceKey: deviceKey, recovery: recovery, sealer: sealer)
        try withKeys(keys)
        return keys.current
    }

    /// Every key of this keybag (from the passcode; a wrong one counted, the throttle applied) with
    /// a set of fresh keys appended, for a new key set; the caller wipes them. A store with a
    /// recovery key needs it, and its escrow must hold these very keys.
    mutating func keysWithFreshSet(
        passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?, now: Double
    ) throws -> StoreKeys {
        if counterKey == nil { _ = try authenticate(deviceKey: deviceKey, now: now) }
        let wait = retryAfter(now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        guard currentKeySet < Keybag.maxKeySet else {
            throw KeybagError.invalid("this store has \(Keybag.maxKeySet + 1) key sets, the most it can have")
        }
        guard hasRecoveryKey == (recovery != nil) else {
            throw KeybagError.invalid(
                hasRecoveryKey
                    ? "this store has a recovery key: give it (--recovery-key-file, --stdin) to cover the new keys"
                    : "this store has no recovery key")
        }
        var keys: StoreKeys
        do { keys = try openAll(passcode: passcode, deviceKey: deviceKey) } catch KeybagError.badPasscode {
            try recordFailure(now: now)
            throw KeybagError.badPasscode
        }
        do {
            if let recovery {
                let escrowed = try RecoveryEscrow.keys(in: file, recovery: recovery)
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
    mutating func saveKeySets(
        _ keys: StoreKeys, into next: KeybagFile, passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?,
        sealer newSealer: (any PasscodeSealer)?
    ) throws {
        var next = next
        try Keybag.wrapAll(keys, into: &next, passcode: passcode, deviceKey: deviceKey, sealer: newSealer)
        if let recovery { try RecoveryEscrow.write(&next, keys: keys.escrowEntries(), recovery: recovery) }
        next.failedAttempts = 0
        next.lockoutUntil = 0
        file = next
        sealer = newSealer
        try save()
        try newSealer?.keepOnly(salt: next.kdfSalt)
        try KeySetFloor.record(self, deviceID: try DeviceIdentity.id(deviceKey: deviceKey, storeID: file.storeID))
    }
}
