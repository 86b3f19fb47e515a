import CSodium
import Foundation

/// A device's passcode bound to its TPM (`KeybagFile.tpm2`): enrolling, attaching the
/// sealer at start, moving on or off a TPM, and refusing a keybag older than the TPM's counter.
public enum TPMBinding {
    /// Binds this device's passcode to `sealer` (a TPM) and starts a new key set at once, in
    /// one save: a keybag copied before (guessable off the TPM with the device key) holds none
    /// of the keys that wrap files written, or rewrapped (`StoreRewrap`), from now on. Every
    /// older set is rewrapped too, so older files still open. A store with a recovery key
    /// needs it (the new set is escrowed under it); a wrong passcode is counted. `withKeys`
    /// gets every key, the new set last, before they are wiped. Returns the new set's number.
    public static func enroll(
        _ kb: inout Keybag, _ sealer: any PasscodeSealer, passcode: SecureKey, deviceKey: SecureKey,
        recovery: RecoveryKey?,
        now: Double = Date().timeIntervalSince1970, withKeys: (StoreKeys) throws -> Void = { _ in }
    ) throws -> Int {
        let recovery = kb.hasRecoveryKey ? recovery : nil
        let keys = try KeySets.keysWithFreshSet(
            &kb, passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
        defer { keys.wipe() }
        var next = kb.file
        next.kdfSalt = Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString()
        next.tpm2 = true
        next.generation = nil
        try KeySets.save(
            &kb, keys, into: next, passcode: passcode, deviceKey: deviceKey, recovery: recovery, sealer: sealer)
        try withKeys(keys)
        return keys.current
    }

    /// Gives a keybag bound to a TPM (`file.tpm2`) its sealer, from this device's enrollment
    /// (`tcti` overrides the TCTI it names), and refuses a keybag older than the TPM's
    /// counter. Call before anything saves the keybag. Nothing to do without a TPM.
    /// With `helper` (the daemon), seal and unseal run in that helper process.
    public static func attach(_ kb: inout Keybag, tcti: String?, deviceKey: SecureKey, helper: TPMHelperProcess? = nil)
        throws
    {
        guard kb.file.tpm2 == true else { return }
        let path = TPMEnrollment.path(deviceID: try DeviceIdentity.id(deviceKey: deviceKey, storeID: kb.file.storeID))
        guard
            let sealer = try TPMSealer.load(tcti: tcti, deviceKey: deviceKey, storeID: kb.file.storeID, helper: helper)
        else {
            throw KeybagError.invalid(
                "this device's passcode is bound to a TPM, but its enrollment \(path) is missing: run `keybagfs "
                    + "recover \(kb.storePath)` with the recovery key, which enrolls this machine's TPM")
        }
        kb.sealer = sealer
        try checkGeneration(kb)
        do { try sealer.settle(salt: kb.file.kdfSalt) } catch let e as TPMError {
            throw KeybagError.invalid(PasscodeKey.tpmTrouble(e))
        }
    }

    /// Moves this device's passcode key onto `sealer` (a TPM), or off its TPM (`nil`): the
    /// passcode is checked (a wrong one counts), A, B and C of every key set are rewrapped
    /// under a new salt with the new sealer, and the keybag saved; the old sealer's objects
    /// are the caller's to release. No file data changes.
    public static func moveToSealer(
        _ kb: inout Keybag, _ next: (any PasscodeSealer)?, passcode: SecureKey, deviceKey: SecureKey,
        now: Double = Date().timeIntervalSince1970
    ) throws {
        if kb.counterKey == nil { _ = try kb.authenticate(deviceKey: deviceKey, now: now) }
        let wait = PasscodeAttempts.retryAfter(kb, now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        let sets: [UnlockedClassKeys]
        do { sets = try kb.unlockAll(passcode: passcode, deviceKey: deviceKey) } catch KeybagError.badPasscode {
            try PasscodeAttempts.recordFailure(&kb, now: now)
            throw KeybagError.badPasscode
        }
        defer { for s in sets { s.wipe() } }
        try PasscodeKey.rewrapUnderNewSalt(&kb, sets, passcode: passcode, deviceKey: deviceKey, sealer: next)
    }

    /// Refuses a keybag older than the one this device last wrote: with a TPM, its
    /// generation must be at least the TPM's NV counter (a crash between the keybag's save
    /// and the counter's step leaves it one ahead, which is fine).
    public static func checkGeneration(_ kb: Keybag) throws {
        guard kb.file.tpm2 == true, let sealer = kb.sealer else { return }
        let counted: UInt64?
        do { counted = try sealer.generation() } catch let e as TPMError {
            throw KeybagError.invalid(PasscodeKey.tpmTrouble(e))
        }
        guard let counted else {
            // Every completed enrollment has its counter: one without names no counter to check
            // (an edited enrollment), so nothing would stop an older keybag.
            throw KeybagError.corrupt(
                "this device's TPM enrollment names no keybag counter (it was edited); nothing was changed. Run "
                    + "`keybagfs recover` with the recovery key")
        }
        let mine = kb.file.generation ?? 0
        guard mine >= counted else {
            throw KeybagError.corrupt(
                "keybag \(kb.relativePath) is older than the one this device last wrote (generation \(mine), the TPM's "
                    + "counter is at \(counted)): it was put back from an older copy; nothing was changed. Put back the "
                    + "newest keybag, or run `keybagfs recover` with the recovery key")
        }
    }
}
