import CSodium
import Foundation

/// Opening a keybag with a passcode, changing it, and the throttle of failed attempts.
extension Keybag {
    /// Unwraps a device-only key (`D` or `volume`); a wrong device key gives `badDeviceKey`.
    public func unwrapDeviceKeySlot(_ slot: String, deviceKey: SecureKey) throws -> SecureKey {
        let dwk = try KeybagMACs.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        do {
            return try KeyWrap.unwrap(
                try file.blob(slot), with: dwk, ad: KeybagMACs.ad(file.storeID, slot, format: file.format))
        } catch KeybagError.corrupt {
            // A format-4 keybag edited to claim an older format: the slot opens under the v4 tag.
            if file.format < Keybag.settingsFormat,
                let k = try? KeyWrap.unwrap(
                    try file.blob(slot), with: dwk, ad: KeybagMACs.ad(file.storeID, slot, format: Keybag.settingsFormat)
                )
            {
                k.wipe()
                throw KeybagError.corrupt(
                    "keybag field format was edited offline (it says \(file.format); the keybag was written as format "
                        + "\(Keybag.settingsFormat)); nothing was changed")
            }
            throw KeybagError.badDeviceKey
        }
    }

    /// Unwraps A, B and C of key set 0 with a passcode; `badPasscode` when it is wrong. Does
    /// not count attempts.
    public func unlock(passcode: SecureKey, deviceKey: SecureKey) throws -> UnlockedClassKeys {
        let sets = try unlockAll(passcode: passcode, deviceKey: deviceKey)
        for s in sets.dropFirst() { s.wipe() }
        return sets[0]
    }

    /// Unwraps A, B and C of every key set with a passcode, oldest first; `badPasscode` when
    /// it is wrong. Does not count attempts.
    public func unlockAll(passcode: SecureKey, deviceKey: SecureKey) throws -> [UnlockedClassKeys] {
        let kek = try PasscodeKey.derive(passcode: passcode, file: file, deviceKey: deviceKey, sealer: sealer)
        defer { kek.wipe() }
        var sets: [UnlockedClassKeys] = []
        do {
            for n in 0...currentKeySet {
                func take(_ base: String) throws -> SecureKey {
                    let slot = Keybag.slot(base, n)
                    return try KeyWrap.unwrap(try file.blob(slot), with: kek, ad: KeybagMACs.ad(file.storeID, slot))
                }
                let a = try take("A")
                let b: SecureKey, c: SecureKey
                do { b = try take("B") } catch { a.wipe(); throw error }
                do { c = try take("C") } catch { a.wipe(); b.wipe(); throw error }
                let pk: [UInt8]
                do { pk = try ClassBAgreement.publicKey(of: b) } catch { a.wipe(); b.wipe(); c.wipe(); throw error }
                sets.append(
                    UnlockedClassKeys(classA: a, classBSecret: b, classBPublic: pk, classC: c, keySet: UInt8(n)))
            }
            return sets
        } catch KeybagError.corrupt {
            for s in sets { s.wipe() }
            throw KeybagError.badPasscode
        }
    }

    /// The class D key of every key set (the device key alone opens them).
    public func classDKeys(deviceKey: SecureKey) throws -> [UInt8: SecureKey] {
        var keys: [UInt8: SecureKey] = [:]
        do {
            for n in 0...currentKeySet {
                keys[UInt8(n)] = try unwrapDeviceKeySlot(Keybag.slot("D", n), deviceKey: deviceKey)
            }
        } catch {
            for k in keys.values { k.wipe() }
            throw error
        }
        return keys
    }

    /// `unlockAll` for the offline commands: the keybag authenticated, the throttle honoured,
    /// a wrong passcode counted in the keybag (and, with a TPM, in the TPM's lockout), a right
    /// one clearing the count, as the daemon's unlock does.
    public mutating func unlockCounting(
        passcode: SecureKey, deviceKey: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> [UnlockedClassKeys] {
        if counterKey == nil { _ = try authenticate(deviceKey: deviceKey, now: now) }
        let wait = retryAfter(now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        do {
            let sets = try unlockAll(passcode: passcode, deviceKey: deviceKey)
            do { try recordSuccess() } catch { for k in sets { k.wipe() }; throw error }
            return sets
        } catch KeybagError.badPasscode {
            try recordFailure(now: now)
            throw KeybagError.badPasscode
        }
    }

    /// Rewraps A, B and C of every key set under a new passcode (new salt); no file data changes.
    public mutating func changePasscode(old: SecureKey, new: SecureKey, deviceKey: SecureKey) throws {
        let sets = try unlockAll(passcode: old, deviceKey: deviceKey)
        defer { for s in sets { s.wipe() } }
        try rewrapUnderNewSalt(sets, passcode: new, deviceKey: deviceKey, sealer: sealer)
    }

    /// Rewraps A, B and C of `sets` under `passcode` with a new salt, through `next` (a TPM)
    /// when given, clears the counter and saves; `next` then keeps only the new salt's secret.
    mutating func rewrapUnderNewSalt(
        _ sets: [UnlockedClassKeys], passcode: SecureKey, deviceKey: SecureKey, sealer next: (any PasscodeSealer)?
    ) throws {
        var f = file
        f.kdfSalt = Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString()
        if (next != nil) != (f.tpm2 == true) {
            f.tpm2 = next != nil ? true : nil
            f.generation = nil
        }
        let kek = try PasscodeKey.derive(passcode: passcode, file: f, deviceKey: deviceKey, sealer: next, making: true)
        defer { kek.wipe() }
        try KeySets.wrapPasscodeSlots(sets, into: &f, passcodeKey: kek)
        f.failedAttempts = 0
        f.lockoutUntil = 0
        file = f
        sealer = next
        try save()
        try next?.keepOnly(salt: f.kdfSalt)
    }

    /// Seconds until the next attempt is allowed (0 when allowed now).
    /// Never longer than the longest delay: a lockout further ahead (a clock set back since)
    /// is cut here, not in the stored value, whose counter MAC must still verify.
    public func retryAfter(now: Double) -> Double {
        max(0, min(file.lockoutUntil - now, UnlockThrottle.delay(afterFailures: Int.max)))
    }

    /// Records a failed attempt and persists the counter and the resulting lockout.
    public mutating func recordFailure(now: Double) throws {
        file.failedAttempts += 1
        let d = UnlockThrottle.delay(afterFailures: file.failedAttempts)
        file.lockoutUntil = d > 0 ? now + d : 0
        try save()
    }

    /// Clears the counter after a success (persisted only when it changes).
    public mutating func recordSuccess() throws {
        guard file.failedAttempts != 0 || file.lockoutUntil != 0 else { return }
        file.failedAttempts = 0
        file.lockoutUntil = 0
        try save()
    }
}
