import CSodium
import Foundation

/// The key a passcode (and the device key, and the TPM where there is one) derives: the key
/// that wraps class A, B and C of every key set.
public enum PasscodeKey {
    /// Passcode key: Argon2id(passcode, salt), then BLAKE2b keyed by the device key, so that
    /// neither the passcode nor the device key alone derives it. With a TPM (`file.tpm2`) the
    /// Argon2id output also derives the TPM authorization that releases the device's sealed
    /// secret, which goes into the BLAKE2b too: no passcode can be tried off that TPM, and
    /// each wrong one counts in the TPM's lockout. `making`: seal a new secret when the TPM
    /// holds none for this salt (wrapping under a new passcode).
    public static func derive(
        passcode: SecureKey, file: KeybagFile, deviceKey: SecureKey, sealer: (any PasscodeSealer)? = nil,
        making: Bool = false
    ) throws -> SecureKey {
        guard let salt = Data(base64Encoded: file.kdfSalt), salt.count == Int(crypto_pwhash_SALTBYTES) else {
            throw KeybagError.corrupt("keybag salt")
        }
        let stretched = SecureKey(zeroed: 32)
        defer { stretched.wipe() }
        let rc: Int32 = try passcode.withBytes { p in
            try stretched.withBytes { out in
                [UInt8](salt).withUnsafeBufferPointer { s in
                    crypto_pwhash(
                        UnsafeMutablePointer(mutating: out.baseAddress!.assumingMemoryBound(to: UInt8.self)), 32,
                        p.baseAddress!.assumingMemoryBound(to: CChar.self), UInt64(p.count),
                        s.baseAddress!, file.kdfOpsLimit, Int(file.kdfMemLimit), crypto_pwhash_ALG_ARGON2ID13)
                }
            }
        }
        guard rc == 0 else { throw KeybagError.system("crypto_pwhash (out of memory?)", ENOMEM) }
        guard file.tpm2 == true else {
            return try deviceKey.withBytes { dk in
                try stretched.withBytes { st in
                    KeyWrap.keyedHash(
                        key: dk, parts: [Array("keybagfs-passcode-kek-v1".utf8), Array(file.storeID.utf8), Array(st)])
                }
            }
        }
        guard let sealer else {
            throw KeybagError.invalid(
                "this device's passcode is bound to its TPM, and its TPM enrollment (STATE/DEVICEID.tpm2) was not given "
                    + "to this command; run `keybagfs recover` with the recovery key")
        }
        let auth = try stretched.withBytes { st in
            KeyWrap.keyedHash(key: st, parts: [Array("keybagfs-tpm-auth-v1".utf8), Array(file.storeID.utf8)])
        }
        defer { auth.wipe() }
        let secret: SecureKey
        do { secret = try sealer.secret(salt: file.kdfSalt, auth: auth, making: making) } catch TPMError.badAuth {
            throw KeybagError.badPasscode
        } catch TPMError.lockout(let retry) {
            throw KeybagError.throttled(retryAfter: retry)
        } catch let e as TPMError {
            throw KeybagError.invalid(Self.tpmTrouble(e))
        }
        defer { secret.wipe() }
        return try deviceKey.withBytes { dk in
            try stretched.withBytes { st in
                try secret.withBytes { sec in
                    KeyWrap.keyedHash(
                        key: dk,
                        parts: [
                            Array("keybagfs-passcode-kek-tpm-v1".utf8), Array(file.storeID.utf8), Array(st), Array(sec),
                        ])
                }
            }
        }
    }

    /// One line for a TPM that cannot give the device's secret, naming the way out.
    public static func tpmTrouble(_ e: TPMError) -> String {
        switch e {
        case .notThisTPM, .nvMissing:
            return "this device's TPM does not hold its sealed secret (the TPM was cleared or replaced, or the store "
                + "and device key were copied from another machine): run `keybagfs recover STORE` with the recovery "
                + "key, which enrolls this TPM; nothing was changed"
        case .pcrChanged:
            return "\(e): run `keybagfs recover STORE` with the recovery key, which re-enrolls this TPM in the boot "
                + "state it has now; nothing was changed"
        case .stale:
            return
                "\(e); nothing was changed. Put back the newest keybag, or run `keybagfs recover` with the recovery key"
        default: return "\(e)"
        }
    }

    /// Rewraps A, B and C of every key set of `kb` under a new passcode (new salt); no file
    /// data changes.
    public static func change(_ kb: inout Keybag, old: SecureKey, new: SecureKey, deviceKey: SecureKey) throws {
        let sets = try kb.unlockAll(passcode: old, deviceKey: deviceKey)
        defer { for s in sets { s.wipe() } }
        try rewrapUnderNewSalt(&kb, sets, passcode: new, deviceKey: deviceKey, sealer: kb.sealer)
    }

    /// Rewraps A, B and C of `sets` under `passcode` with a new salt, through `next` (a TPM)
    /// when given, clears the counter and saves; `next` then keeps only the new salt's secret.
    static func rewrapUnderNewSalt(
        _ kb: inout Keybag, _ sets: [UnlockedClassKeys], passcode: SecureKey, deviceKey: SecureKey,
        sealer next: (any PasscodeSealer)?
    ) throws {
        var f = kb.file
        f.kdfSalt = Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString()
        if (next != nil) != (f.tpm2 == true) {
            f.tpm2 = next != nil ? true : nil
            f.generation = nil
        }
        let kek = try derive(passcode: passcode, file: f, deviceKey: deviceKey, sealer: next, making: true)
        defer { kek.wipe() }
        try KeySets.wrapPasscodeSlots(sets, into: &f, passcodeKey: kek)
        try install(&kb, f, sealer: next)
    }

    /// Makes `f` (slots wrapped under a new salt) the keybag's file with its failed-attempt
    /// count cleared, and `next` its sealer; saves, then `next` keeps only the new salt's secret.
    static func install(_ kb: inout Keybag, _ f: KeybagFile, sealer next: (any PasscodeSealer)?) throws {
        var f = f
        f.failedAttempts = 0
        f.lockoutUntil = 0
        kb.file = f
        kb.sealer = next
        try kb.save()
        try next?.keepOnly(salt: f.kdfSalt)
    }
}
