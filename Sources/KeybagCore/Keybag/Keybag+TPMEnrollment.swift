import CSodium
import Foundation

extension Keybag {
    /// Binds this device's passcode to `sealer` (a TPM) and starts a new key set at once, in
    /// one save: a keybag copied before (guessable off the TPM with the device key) holds none
    /// of the keys that wrap files written, or rewrapped (`StoreRewrap`), from now on. Every
    /// older set is rewrapped too, so older files still open. A store with a recovery key
    /// needs it (the new set is escrowed under it); a wrong passcode is counted. `withKeys`
    /// gets every key, the new set last, before they are wiped. Returns the new set's number.
    public mutating func enrollTPM(
        _ sealer: any PasscodeSealer, passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?,
        now: Double = Date().timeIntervalSince1970, withKeys: (StoreKeys) throws -> Void = { _ in }
    ) throws -> Int {
        let recovery = hasRecoveryKey ? recovery : nil
        let keys = try keysWithFreshSet(passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
        defer { keys.wipe() }
        var next = file
        next.kdfSalt = Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString()
        next.tpm2 = true
        next.generation = nil
        try saveKeySets(keys, into: next, passcode: passcode, deviceKey: deviceKey, recovery: recovery, sealer: sealer)
        try withKeys(keys)
        return keys.current
    }

    /// Every key of this keybag from the passcode (a wrong one counted, the throttle applied),
    /// for a command that rewraps files or reads the TPM's lockout record.
    public mutating func openAllCounted(
        passcode: SecureKey, deviceKey: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> StoreKeys {
        if counterKey == nil { _ = try authenticate(deviceKey: deviceKey, now: now) }
        let wait = retryAfter(now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        do { return try openAll(passcode: passcode, deviceKey: deviceKey) } catch KeybagError.badPasscode {
            try recordFailure(now: now)
            throw KeybagError.badPasscode
        }
    }

    /// Every key of the store from the recovery key's escrow in this keybag; a wrong key is
    /// counted and throttled as `recover` does.
    public mutating func escrowedKeysCounted(
        recovery: RecoveryKey, now: Double = Date().timeIntervalSince1970
    ) throws -> StoreKeys {
        guard hasRecoveryKey else {
            throw KeybagError.invalid(
                "this store has no recovery key (it was made before recovery keys, or with --no-recovery-key)")
        }
        let wait = recoveryRetryAfter(now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        return try escrowedKeysForRecovery(recovery, escrowFrom: nil, now: now)
    }

    /// Devices of this store other than this keybag's whose keybags lack key set `n`: they
    /// could open no file rewrapped for it (until they take it up with `keybagfs recover`).
    public func devicesWithout(keySet n: Int) -> [String] {
        StoreDevices.list(storePath: storePath).compactMap { d in
            guard let rel = d.keybag, rel != relativePath,
                let kb = try? Keybag.load(storePath: storePath, relativePath: rel), kb.currentKeySet < n
            else { return nil }
            return d.name ?? d.id ?? rel
        }
    }
}
