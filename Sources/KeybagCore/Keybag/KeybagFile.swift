import CSodium
import Foundation

/// Argon2id cost presets of `keybagfs init --kdf`.
public enum KDFStrength: String, Sendable, CaseIterable {
    case interactive, moderate, sensitive

    /// libsodium's opslimit for the preset.
    public var opsLimit: UInt64 {
        switch self {
        case .interactive: return UInt64(crypto_pwhash_OPSLIMIT_INTERACTIVE)
        case .moderate: return UInt64(crypto_pwhash_OPSLIMIT_MODERATE)
        case .sensitive: return UInt64(crypto_pwhash_OPSLIMIT_SENSITIVE)
        }
    }

    /// libsodium's memlimit for the preset, in bytes.
    public var memLimit: UInt64 {
        switch self {
        case .interactive: return UInt64(crypto_pwhash_MEMLIMIT_INTERACTIVE)
        case .moderate: return UInt64(crypto_pwhash_MEMLIMIT_MODERATE)
        case .sensitive: return UInt64(crypto_pwhash_MEMLIMIT_SENSITIVE)
        }
    }
}

/// The on-disk keybag (`STORE/keybag`, JSON): wrapped class keys, KDF parameters and
/// the failed-attempt counter. Nothing in it is usable without the device key.
public struct KeybagFile: Codable, Sendable, Equatable {
    /// Format version (1).
    public var format: Int
    /// Random 16-byte store id, hex; names the default device key file.
    public var storeID: String
    /// The cipher of new files (`xaes256gcm`, `xchacha20poly1305` or `aes256gcm`).
    public var cipher: String
    /// Argon2id13 opslimit.
    public var kdfOpsLimit: UInt64
    /// Argon2id13 memlimit in bytes.
    public var kdfMemLimit: UInt64
    /// Argon2id salt, base64.
    public var kdfSalt: String
    /// Wrapped keys by slot name (`A`, `B`, `C` by the passcode key; `D`, `volume` by the device key), base64.
    public var wrapped: [String: String]
    /// Class B public key, base64 (not secret; stored for inspection, checked against the private key).
    public var classBPublic: String
    /// Failed unlock attempts in a row.
    public var failedAttempts: Int
    /// Unix time before which no unlock is attempted (escalating delay).
    public var lockoutUntil: Double
    /// Format 2: keyed BLAKE2b of storeID, failedAttempts and lockoutUntil under a key
    /// derived from the device key (base64), so the counter cannot be edited offline.
    public var counterMAC: String?
    /// Keyed BLAKE2b of storeID and `cipher` under the counter key (base64), so that the
    /// cipher of new files cannot be edited offline (absent in keybags written before it:
    /// added at the next daemon start).
    public var cipherMAC: String? = nil
    /// Wrong recovery keys in a row (absent: none). Not under the counter MAC: recovery
    /// must work without the device key; the key's 256 bits are the real defence.
    public var recoveryFailedAttempts: Int? = nil
    /// Unix time before which no recovery is attempted (absent: none).
    public var recoveryLockoutUntil: Double? = nil
    /// Format 3: the key set new files are wrapped for (absent: 0, the store's first keys).
    /// Each device removal adds a set; slots of set N ≥ 1 are named `A.N`, `B.N`, `C.N`, `D.N`.
    public var keySet: Int? = nil
    /// Class B public keys of key sets 1 and up, by set number (base64).
    public var classBPublics: [String: String]? = nil
    /// The device this keybag belongs to (`DeviceIdentity`); absent before devices existed.
    public var deviceID: String? = nil
    /// A name for people (`keybagfs device list`); under the settings MAC from format 4.
    public var deviceName: String? = nil
    /// Format 4: keyed BLAKE2b under the counter key of every setting (every field but the
    /// wrapped slots, the cipher and the counters, which have MACs of their own, and the
    /// recovery counters, which recovery without the device key must write), so that any
    /// offline edit of a setting is refused (`KeybagMACs.settingsMessage`).
    public var settingsMAC: String? = nil
    /// This device's passcode key includes a secret sealed in its TPM (absent: no TPM).
    public var tpm2: Bool? = nil
    /// With a TPM: the value of the TPM's monotonic NV counter when this keybag was saved, so
    /// that a keybag put back from an older copy is refused (`TPMBinding.checkGeneration`).
    public var generation: UInt64? = nil
    /// This device's X25519 public key, which other devices seal key sets to, base64
    /// (`DeviceIdentityKeys`; absent before device identities).
    public var identityBox: String? = nil
    /// This device's Ed25519 public key, which its records are signed with, base64.
    public var identitySign: String? = nil
    /// The store's certification key (Ed25519 public, base64): the root this device trusts
    /// other devices' certificates by (`DeviceTrust`). Its private half is escrowed under the
    /// recovery key (slot `rcertify`).
    public var storeCertify: String? = nil
    /// The devices this device trusts at its newest key set, with their public keys (itself
    /// included): where its judgement of newer records starts (`DeviceTrust`), so that a
    /// record deleted from the store takes nothing back.
    public var trustedDevices: [String: DevicePublicKeys]? = nil
    /// The devices this device has seen removed (by a record it verified, or by itself).
    public var removedDevices: [String]? = nil
    /// Who approved each device this device learnt of by its certificate (device id → the
    /// approving device's id, or "store"): removing a device removes what it approved.
    public var approvals: [String: String]? = nil

    /// The bytes of wrapped slot `slot`; `corrupt` when it is missing.
    func blob(_ slot: String) throws -> [UInt8] {
        guard let s = wrapped[slot], let d = Data(base64Encoded: s) else {
            throw KeybagError.corrupt("keybag slot \(slot) missing")
        }
        return [UInt8](d)
    }
}
