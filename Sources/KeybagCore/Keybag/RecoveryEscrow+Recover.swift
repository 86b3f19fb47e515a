import CSodium
import Foundation

/// What the recovery key does with the escrow: recover a device (a new passcode, a new device
/// key), and rotate the recovery key itself.
extension RecoveryEscrow {
    /// Every key of the store from the recovery key's escrow in this keybag; a wrong key is
    /// counted and throttled as `recover` does.
    public static func keysCounted(
        _ kb: inout Keybag, recovery: RecoveryKey, now: Double = Date().timeIntervalSince1970
    ) throws -> StoreKeys {
        guard kb.hasRecoveryKey else {
            throw KeybagError.invalid(
                "this store has no recovery key (it was made before recovery keys, or with --no-recovery-key)")
        }
        let wait = PasscodeAttempts.recoveryRetryAfter(kb, now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        return try keysForRecovery(&kb, recovery, escrowFrom: nil, now: now)
    }

    /// The store keys escrowed under `recovery`, from this keybag or from `escrowFrom` when
    /// that one holds a newer key set; a wrong recovery key is counted (and saved) here.
    static func keysForRecovery(_ kb: inout Keybag, _ recovery: RecoveryKey, escrowFrom: Keybag?, now: Double) throws
        -> StoreKeys
    {
        let source = escrowFrom.flatMap { $0.currentKeySet > kb.currentKeySet ? $0 : nil } ?? kb
        // The sets both hold must be the same sets (a removal raced by another, or a rolled-back
        // keybag, can make two different set N): taking the source's would lose this device's.
        for n in 1...max(1, kb.currentKeySet) where n <= min(kb.currentKeySet, source.currentKeySet) {
            guard kb.file.classBPublics?[String(n)] == source.file.classBPublics?[String(n)] else {
                throw KeybagError.corrupt(
                    "key set \(n) of this device differs from the one in \(source.relativePath): two devices made "
                        + "different sets of one number; nothing was changed")
            }
        }
        do { return try RecoveryEscrow.keys(in: source.file, recovery: recovery) } catch KeybagError.badRecoveryKey {
            var failed = kb.file
            failed.recoveryFailedAttempts = (failed.recoveryFailedAttempts ?? 0) + 1
            let d = UnlockThrottle.delay(afterFailures: failed.recoveryFailedAttempts!)
            failed.recoveryLockoutUntil = d > 0 ? now + d : 0
            kb.file = failed
            if kb.counterKey != nil { try kb.save() } else { try kb.saveWithoutCounter() }
            throw KeybagError.badRecoveryKey
        }
    }

    /// With the current device key the escrowed D and volume keys must be the ones it opens.
    private static func checkMatchesDeviceSlots(_ kb: Keybag, _ keys: StoreKeys, deviceKey: SecureKey) throws {
        for (slot, escrowed) in [("D", keys.classD[0]), ("volume", keys.volume)] {
            guard let current = try? kb.unwrapDeviceKeySlot(slot, deviceKey: deviceKey) else { continue }
            defer { current.wipe() }
            let same = try current.withBytes { a in
                try escrowed.withBytes { b in sodium_memcmp(a.baseAddress!, b.baseAddress!, 32) == 0 }
            }
            guard same else {
                throw KeybagError.corrupt(
                    "the recovery slots do not match this keybag (damaged or replaced); nothing was changed")
            }
        }
    }

    /// Sets a new passcode and binds the store to `deviceKey` (the old one, or a new one
    /// when it was lost), from the recovery key. The class keys stay, so no file changes.
    /// A wrong key is counted and throttled like a passcode. The escrow slots are read from
    /// `escrowFrom` when given (the keybag with the newest key set: a device that missed a
    /// removal takes up the new set this way).
    public static func recover(
        _ kb: inout Keybag, with recovery: RecoveryKey, newPasscode: SecureKey, deviceKey: SecureKey,
        escrowFrom: Keybag? = nil, now: Double = Date().timeIntervalSince1970,
        withKeys: (StoreKeys) throws -> Void = { _ in }
    ) throws {
        guard kb.hasRecoveryKey else {
            throw KeybagError.invalid(
                "this store has no recovery key (it was made before recovery keys, or with --no-recovery-key)")
        }
        let wait = PasscodeAttempts.recoveryRetryAfter(kb, now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        let keys = try keysForRecovery(&kb, recovery, escrowFrom: escrowFrom, now: now)
        defer { keys.wipe() }
        try checkMatchesDeviceSlots(kb, keys, deviceKey: deviceKey)
        var next = kb.file
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: kb.file.storeID)
        guard kb.relativePath == Keybag.fileName || id == kb.file.deviceID else {
            throw KeybagError.invalid(
                "a device added with `keybagfs device add` cannot take a new device key: add it again instead")
        }
        let previousID = kb.file.deviceID
        next.deviceID = id
        next.kdfSalt = Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString()
        // Never weaker than `interactive`, whatever the keybag says.
        next.kdfOpsLimit = max(next.kdfOpsLimit, KDFStrength.interactive.opsLimit)
        next.kdfMemLimit = max(next.kdfMemLimit, KDFStrength.interactive.memLimit)
        next.format = max(next.format, Keybag.currentFormat)
        next.tpm2 = kb.sealer != nil ? true : nil  // re-enrolled on this machine's TPM, or off it
        next.generation = nil
        try KeySets.wrapAll(keys, into: &next, passcode: newPasscode, deviceKey: deviceKey, sealer: kb.sealer)
        // Every set escrowed under the recovery key itself from now on (sealed slots too).
        try RecoveryEscrow.write(&next, keys: keys.escrowEntries(), recovery: recovery)
        // New identity keys, certified by the store's key (made here for a store without one).
        let certify = try DeviceIdentityKeys.certifySeed(
            storePath: kb.storePath, recovery: recovery, preferring: escrowFrom ?? kb)
        defer { certify.wipe() }
        let certificate = try DeviceIdentityKeys.make(
            &next, keys: keys, storePath: kb.storePath, deviceKey: deviceKey, certifySeed: certify, recovery: recovery,
            now: now)
        next.failedAttempts = 0
        next.lockoutUntil = 0
        next.recoveryFailedAttempts = nil
        next.recoveryLockoutUntil = nil
        kb.counterKey = try KeybagMACs.counterKey(deviceKey)
        kb.file = next
        try kb.save()
        try kb.sealer?.keepOnly(salt: next.kdfSalt)
        try certificate.write(storePath: kb.storePath)
        if let old = previousID, old != id {  // the old device key's identity goes with it
            unlink(kb.storePath + "/" + StoreDevices.dirName + "/" + DeviceCertificate.fileName(old))
        }
        try KeySetFloor.record(kb, deviceID: id)
        try withKeys(keys)
    }

    /// Replaces the recovery key (a first one for a store made without); the old one stops
    /// working. Needs the passcode and the device key; a wrong passcode counts as a failure.
    /// `deliver` hands the new key to the user (a file, the terminal) before anything is
    /// saved: if it throws, the keybag and the old key stay as they were. Every key set is
    /// escrowed for the new key.
    public static func rotate(
        _ kb: inout Keybag, passcode: SecureKey, deviceKey: SecureKey, current: RecoveryKey? = nil,
        now: Double = Date().timeIntervalSince1970, deliver: (RecoveryKey) throws -> Void = { _ in }
    ) throws -> RecoveryKey {
        // A wrong device key must fail here, not read as an edited counter below.
        try kb.unwrapDeviceKeySlot("D", deviceKey: deviceKey).wipe()
        let keys = try PasscodeAttempts.openAllCounted(&kb, passcode: passcode, deviceKey: deviceKey, now: now)
        defer { keys.wipe() }
        if let trust = try DeviceTrust.rememberCertified(&kb, deviceKey: deviceKey) {
            return try KeySets.rotateForAll(
                &kb,
                keys, trust: trust, current: current, passcode: passcode, deviceKey: deviceKey, now: now,
                deliver: deliver)
        }
        let recovery = RecoveryKey.generate()
        var next = kb.file
        try RecoveryEscrow.write(&next, keys: keys.escrowEntries(), recovery: recovery)
        next.failedAttempts = 0
        next.lockoutUntil = 0
        next.recoveryFailedAttempts = nil
        next.recoveryLockoutUntil = nil
        do { try deliver(recovery) } catch { recovery.wipe(); throw error }
        kb.file = next
        try kb.save()
        return recovery
    }
}
