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
    /// offline edit of a setting is refused (`Keybag.settingsMessage`).
    public var settingsMAC: String? = nil
    /// This device's passcode key includes a secret sealed in its TPM (absent: no TPM).
    public var tpm2: Bool? = nil
    /// With a TPM: the value of the TPM's monotonic NV counter when this keybag was saved, so
    /// that a keybag put back from an older copy is refused (`Keybag.checkGeneration`).
    public var generation: UInt64? = nil
}

/// Delay policy after failed unlocks: none for the first four, then 1, 5, 15, 15 minutes,
/// then 60 minutes for each further failure (as iOS).
public enum UnlockThrottle {
    /// Seconds of lockout after the `failures`-th failure in a row.
    public static func delay(afterFailures failures: Int) -> Double {
        switch failures {
        case ..<5: return 0
        case 5: return 60
        case 6: return 300
        case 7, 8: return 900
        default: return 3600
        }
    }
}

/// The unwrapped class keys of one key set, from a successful unlock.
public struct UnlockedClassKeys: Sendable {
    /// Class A key.
    public let classA: SecureKey
    /// Class B X25519 private key.
    public let classBSecret: SecureKey
    /// Class B public key.
    public let classBPublic: [UInt8]
    /// Class C key.
    public let classC: SecureKey
    /// The key set these keys belong to.
    public var keySet: UInt8 = 0

    /// Zeroes all three secrets.
    public func wipe() { classA.wipe(); classBSecret.wipe(); classC.wipe() }
}

/// Keybag operations: create, open with the device key, unlock with a passcode,
/// change the passcode, record failures. Writes are atomic (temp file, fsync, rename).
public struct Keybag: Sendable {
    /// File name of the keybag inside the store.
    public static let fileName = "keybag"
    /// Folder inside the store that holds the encrypted tree.
    public static let dataDirName = "data"
    /// Folder inside the store for symlink targets too long for a backing symlink.
    public static let targetsDirName = "targets"
    /// Folder inside the store for sealed user xattrs.
    public static let xattrsDirName = "xattrs"

    /// Path of the store.
    public let storePath: String
    /// The keybag file's path inside the store: `keybag` (the device that made the store) or
    /// `devices/ID.keybag`.
    public let relativePath: String
    /// The parsed file.
    public internal(set) var file: KeybagFile
    /// The key that authenticates the failed-attempt counter (from the device key), once known.
    var counterKey: SecureKey?
    /// The first device's keybag learnt its device id on load; `authenticate` saves it.
    var pendingDeviceID = false
    /// This device's TPM, when its passcode key includes a sealed secret (`file.tpm2`).
    public var sealer: (any PasscodeSealer)? = nil
    /// Current keybag format: 4 (settings MAC; device-only slots wrapped with the v4 AD).
    /// Format 2 brought the counter MAC, 3 marks key sets.
    public static let currentFormat = settingsFormat
    /// The keybag format whose settings are authenticated as a whole (`settingsMAC`).
    public static let settingsFormat = 4
    /// Most Argon2id passes and memory a keybag may ask for (hostile values would stall or kill the daemon).
    public static let maxOpsLimit: UInt64 = 32
    public static let maxMemLimit: UInt64 = 4 << 30
    /// Most failures in a row a keybag may record.
    public static let maxFailedAttempts = 1_000_000

    init(storePath: String, file: KeybagFile, counterKey: SecureKey? = nil, relativePath: String = Keybag.fileName) {
        self.storePath = storePath
        self.relativePath = relativePath
        self.file = file
        self.counterKey = counterKey
    }

    /// The store's content cipher.
    public var cipher: ContentCipher { ContentCipher(name: file.cipher) ?? .xchacha20poly1305 }
    /// Path of the keybag file.
    public var path: String { storePath + "/" + relativePath }
    /// The key set new files are wrapped for.
    public var currentKeySet: Int { file.keySet ?? 0 }
    /// The keybag format that marks key sets (an older daemon refuses such a keybag).
    public static let keySetsFormat = 3

    /// Name of `base`'s slot in key set `set` (`A`, `A.1`, …).
    public static func slot(_ base: String, _ set: Int) -> String { set == 0 ? base : "\(base).\(set)" }

    /// Associated data of a wrapped slot. Format 2 wraps the device-only slots (`D`,
    /// `volume`) under a v2 tag, so a format-2 keybag edited to claim format 1 (to drop the
    /// counter MAC) no longer opens with the device key; format 4 under a v4 tag, so a keybag
    /// edited to claim an older format (to drop the settings MAC) no longer opens either.
    static func ad(_ storeID: String, _ slot: String, format: Int = 1) -> [UInt8] {
        let deviceOnly = slot == "volume" || slot == "D" || slot.hasPrefix("D.")
        let v = !deviceOnly ? "v1" : format >= settingsFormat ? "v4" : format >= 2 ? "v2" : "v1"
        return Array("keybagfs-keybag-\(v)|\(storeID)|\(slot)".utf8)
    }

    /// What the settings MAC covers: every field of `f` but the wrapped slots, the cipher
    /// (cipher MAC), the failed-attempt counter and lockout (counter MAC), the recovery
    /// counters and the MACs themselves; each field by name, absent ones marked, lengths
    /// prefixed (little-endian UInt32), so no two keybags share a message.
    static func settingsMessage(_ f: KeybagFile) -> [UInt8] {
        var msg = Array("keybagfs-settings-v1|".utf8)
        func field(_ name: String, _ value: String?) {
            func put(_ bytes: [UInt8]) { withUnsafeBytes(of: UInt32(bytes.count).littleEndian) { msg += $0 }; msg += bytes }
            put(Array(name.utf8))
            if let value { msg.append(1); put(Array(value.utf8)) } else { msg.append(0) }
        }
        field("format", String(f.format))
        field("storeID", f.storeID)
        field("kdfOpsLimit", String(f.kdfOpsLimit))
        field("kdfMemLimit", String(f.kdfMemLimit))
        field("kdfSalt", f.kdfSalt)
        field("classBPublic", f.classBPublic)
        field("keySet", f.keySet.map { String($0) })
        field("classBPublics", f.classBPublics.map { $0.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: ",") })
        field("deviceID", f.deviceID)
        field("deviceName", f.deviceName)
        if f.tpm2 != nil || f.generation != nil {   // keybags without a TPM keep their message
            field("tpm2", f.tpm2.map { $0 ? "1" : "0" })
            field("generation", f.generation.map { String($0) })
        }
        return msg
    }

    /// The settings MAC of `f` under the counter key.
    static func settingsMAC(_ f: KeybagFile, key: SecureKey) throws -> String {
        let msg = settingsMessage(f)
        return try mac(msg, key: key)
    }

    /// Whether the stored settings MAC of `f` verifies under `key` (false when absent).
    static func settingsAreAuthentic(_ f: KeybagFile, key: SecureKey) throws -> Bool {
        guard let stored = f.settingsMAC.flatMap({ Data(base64Encoded: $0) }).map([UInt8].init) else { return false }
        let expected = [UInt8](Data(base64Encoded: try settingsMAC(f, key: key)) ?? Data())
        return stored.count == expected.count && sodium_memcmp(stored, expected, expected.count) == 0
    }

    /// The key for the counter MAC: crypto_kdf subkey 2 of the device key, context "kbfscnt1".
    public static func counterKey(_ deviceKey: SecureKey) throws -> SecureKey {
        try deviceKey.withBytes { dk in
            SecureKey(count: 32) { out in
                _ = crypto_kdf_derive_from_key(out.baseAddress!.assumingMemoryBound(to: UInt8.self), 32, 2, "kbfscnt1",
                                               dk.baseAddress!.assumingMemoryBound(to: UInt8.self))
            }
        }
    }

    /// Keyed BLAKE2b-256 of `msg` under `key`, base64 (the keybag's MACs).
    static func mac(_ msg: [UInt8], key: SecureKey) throws -> String {
        var mac = [UInt8](repeating: 0, count: 32)
        try key.withBytes { k in
            _ = crypto_generichash(
                &mac, 32, msg, UInt64(msg.count), k.baseAddress!.assumingMemoryBound(to: UInt8.self), k.count)
        }
        return Data(mac).base64EncodedString()
    }

    /// The MAC of the counter state of `f`.
    static func counterMAC(_ f: KeybagFile, key: SecureKey) throws -> String {
        var msg = Array("keybagfs-counter-v1|\(f.storeID)|".utf8)
        withUnsafeBytes(of: Int64(f.failedAttempts).littleEndian) { msg += $0 }
        withUnsafeBytes(of: f.lockoutUntil.bitPattern.littleEndian) { msg += $0 }
        return try mac(msg, key: key)
    }

    /// The MAC of the cipher name of `f`.
    /// Besides the cipher it covers the key set of new files once there is more than one
    /// (keybags without key sets keep the message they were written with).
    static func cipherMAC(_ f: KeybagFile, key: SecureKey) throws -> String {
        var text = "keybagfs-cipher-v1|\(f.storeID)|\(f.cipher)"
        if let set = f.keySet, set > 0 { text += "|set=\(set)" }
        let msg = Array(text.utf8)
        return try mac(msg, key: key)
    }

    /// Whether the stored cipher MAC of `f` verifies under `key`; nil when there is none.
    static func cipherIsAuthentic(_ f: KeybagFile, key: SecureKey) throws -> Bool? {
        guard let stored = f.cipherMAC.flatMap({ Data(base64Encoded: $0) }).map([UInt8].init) else { return nil }
        let expected = [UInt8](Data(base64Encoded: try cipherMAC(f, key: key)) ?? Data())
        return stored.count == expected.count && sodium_memcmp(stored, expected, expected.count) == 0
    }

    /// The key that wraps device-only keys: crypto_kdf subkey 1, context "kbfsdev1".
    public static func deviceWrapKey(_ deviceKey: SecureKey) throws -> SecureKey {
        try deviceKey.withBytes { dk in
            SecureKey(count: 32) { out in
                _ = crypto_kdf_derive_from_key(out.baseAddress!.assumingMemoryBound(to: UInt8.self), 32, 1, "kbfsdev1",
                                               dk.baseAddress!.assumingMemoryBound(to: UInt8.self))
            }
        }
    }

    /// Passcode key: Argon2id(passcode, salt), then BLAKE2b keyed by the device key, so that
    /// neither the passcode nor the device key alone derives it. With a TPM (`file.tpm2`) the
    /// Argon2id output also derives the TPM authorization that releases the device's sealed
    /// secret, which goes into the BLAKE2b too: no passcode can be tried off that TPM, and
    /// each wrong one counts in the TPM's lockout. `making`: seal a new secret when the TPM
    /// holds none for this salt (wrapping under a new passcode).
    public static func passcodeKey(
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
                "this device's passcode is bound to its TPM, and its TPM enrollment (STATE/DEVICEID.tpm2) was not given " +
                    "to this command; run `keybagfs recover` with the recovery key")
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
                        parts: [Array("keybagfs-passcode-kek-tpm-v1".utf8), Array(file.storeID.utf8), Array(st), Array(sec)])
                }
            }
        }
    }

    /// One line for a TPM that cannot give the device's secret, naming the way out.
    public static func tpmTrouble(_ e: TPMError) -> String {
        switch e {
        case .notThisTPM, .nvMissing:
            return "this device's TPM does not hold its sealed secret (the TPM was cleared or replaced, or the store " +
                "and device key were copied from another machine): run `keybagfs recover STORE` with the recovery " +
                "key, which enrolls this TPM; nothing was changed"
        case .stale:
            return "\(e); nothing was changed. Put back the newest keybag, or run `keybagfs recover` with the recovery key"
        default: return "\(e)"
        }
    }

    /// Creates a new keybag in `storePath` (which must be empty or absent) and returns it.
    /// With `recovery`, the five keys are also wrapped for that recovery key.
    public static func create(
        storePath: String, storeID: String, passcode: SecureKey, deviceKey: SecureKey, strength: KDFStrength,
        cipher: ContentCipher = .default, format: Int = Keybag.currentFormat, recovery: RecoveryKey? = nil,
        deviceName: String? = nil, sealer: (any PasscodeSealer)? = nil
    ) throws -> Keybag {
        var file = KeybagFile(
            format: format, storeID: storeID, cipher: cipher.name, kdfOpsLimit: strength.opsLimit,
            kdfMemLimit: strength.memLimit,
            kdfSalt: Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString(),
            wrapped: [:], classBPublic: "", failedAttempts: 0, lockoutUntil: 0, counterMAC: nil)
        file.deviceID = try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID)
        file.deviceName = deviceName
        if sealer != nil { file.tpm2 = true }
        let kek = try passcodeKey(passcode: passcode, file: file, deviceKey: deviceKey, sealer: sealer, making: true)
        defer { kek.wipe() }
        let dwk = try deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        let a = SecureKey(random: 32), bs = SecureKey(random: 32), c = SecureKey(random: 32)
        let d = SecureKey(random: 32), vol = SecureKey(random: 32)
        defer { [a, bs, c, d, vol].forEach { $0.wipe() } }
        let bp = try ClassBAgreement.publicKey(of: bs)
        for (slot, key, wrapper) in [("A", a, kek), ("B", bs, kek), ("C", c, kek), ("D", d, dwk), ("volume", vol, dwk)]
        {
            file.wrapped[slot] = Data(try KeyWrap.wrap(key, with: wrapper, ad: ad(storeID, slot, format: format)))
                .base64EncodedString()
        }
        if let recovery {
            try writeEscrow(
                &file, keys: [("A", a), ("B", bs), ("C", c), ("D", d), ("volume", vol)], recovery: recovery)
        }
        file.classBPublic = Data(bp).base64EncodedString()
        var kb = Keybag(storePath: storePath, file: file, counterKey: format >= 2 ? try counterKey(deviceKey) : nil)
        kb.sealer = sealer
        try kb.save()
        try sealer?.keepOnly(salt: file.kdfSalt)
        return kb
    }

    /// Checks every field a hostile keybag could use against the daemon: each bad value is a
    /// `corrupt` error naming the field, never a trap. A lockout further away than the
    /// longest delay stays as stored (its MAC covers it); `retryAfter` cuts the wait.
    static func validate(_ f: inout KeybagFile, now: Double = Date().timeIntervalSince1970) throws {
        func bad(_ field: String, _ why: String) -> KeybagError { .corrupt("keybag field \(field): \(why)") }
        guard (1...settingsFormat).contains(f.format) else {
            throw bad("format", "unknown format \(f.format) (written by a newer keybagfs?)")
        }
        guard f.storeID.utf8.count == 32,
            f.storeID.utf8.allSatisfy({ (0x30...0x39).contains($0) || (0x61...0x66).contains($0) })
        else {
            throw bad("storeID", "not 32 lowercase hex digits")
        }
        guard ContentCipher(name: f.cipher) != nil else {
            throw bad("cipher", "unknown cipher \(f.cipher.prefix(40)) (written by a newer keybagfs?)")
        }
        guard f.kdfOpsLimit >= UInt64(crypto_pwhash_opslimit_min()), f.kdfOpsLimit <= maxOpsLimit else {
            throw bad("kdfOpsLimit", "out of range")
        }
        guard f.kdfMemLimit >= UInt64(crypto_pwhash_memlimit_min()), f.kdfMemLimit <= maxMemLimit else {
            throw bad("kdfMemLimit", "out of range")
        }
        guard let salt = Data(base64Encoded: f.kdfSalt), salt.count == Int(crypto_pwhash_SALTBYTES) else {
            throw bad("kdfSalt", "not a salt")
        }
        for slot in ["A", "B", "C", "D", "volume"] {
            guard let w = f.wrapped[slot].flatMap({ Data(base64Encoded: $0) }), w.count == 32 + KeyWrap.overhead else {
                throw bad("wrapped.\(slot)", "missing or not a wrapped key")
            }
        }
        guard let pk = Data(base64Encoded: f.classBPublic), pk.count == 32 else {
            throw bad("classBPublic", "not a public key")
        }
        try validateKeySets(f)
        guard f.failedAttempts >= 0, f.failedAttempts <= maxFailedAttempts else {
            throw bad("failedAttempts", "out of range")
        }
        guard f.lockoutUntil.isFinite, f.lockoutUntil >= 0 else { throw bad("lockoutUntil", "not a time") }
        if let mac = f.counterMAC {
            guard let m = Data(base64Encoded: mac), m.count == 32 else { throw bad("counterMAC", "not a MAC") }
        }
        if let mac = f.cipherMAC {
            guard let m = Data(base64Encoded: mac), m.count == 32 else { throw bad("cipherMAC", "not a MAC") }
        }
        if f.format >= settingsFormat {
            guard let m = f.settingsMAC.flatMap({ Data(base64Encoded: $0) }), m.count == 32 else {
                throw bad("settingsMAC", "missing or not a MAC (format \(f.format) keybags carry one)")
            }
        }
        let escrow = escrowedSlots.filter { f.wrapped["r" + $0] != nil }
        guard escrow.isEmpty || escrow.count == escrowedSlots.count else {
            throw bad("wrapped.r*", "some recovery slots are missing")
        }
        for slot in escrow {
            guard let w = f.wrapped["r" + slot].flatMap({ Data(base64Encoded: $0) }), w.count == 32 + KeyWrap.overhead
            else { throw bad("wrapped.r\(slot)", "not a wrapped key") }
        }
        if let n = f.recoveryFailedAttempts {
            guard n >= 0, n <= maxFailedAttempts else { throw bad("recoveryFailedAttempts", "out of range") }
        }
        if let t = f.recoveryLockoutUntil {
            guard t.isFinite, t >= 0 else { throw bad("recoveryLockoutUntil", "not a time") }
        }
    }

    /// What `authenticate` found.
    public enum CounterCheck: Equatable, Sendable { case authentic, upgraded, tampered }

    /// Binds the keybag to the device key (daemon start). Format 4: the settings MAC must
    /// verify, or the keybag was edited offline and is refused. Older keybags are upgraded in
    /// place to format 4 (device-only slots rewrapped under the v4 tag, settings MAC written):
    /// a format-1 keybag at once (it has no MAC to check), formats 2 and 3 after their cipher
    /// and counter MACs are checked. A missing or wrong counter MAC means the counter was
    /// edited offline: it is set to the longest lockout from now and saved, so editing it can
    /// only ever cost the editor time.
    public mutating func authenticate(
        deviceKey: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> CounterCheck {
        let key = try Keybag.counterKey(deviceKey)
        counterKey = key
        if file.format == 1 {
            try upgradeToSettingsFormat(deviceKey: deviceKey)
            return .upgraded
        }
        if file.format >= Keybag.settingsFormat, try !Keybag.settingsAreAuthentic(file, key: key) {
            throw KeybagError.corrupt(
                "keybag \(relativePath) was edited offline: its settings MAC does not match (a setting such as the " +
                    "format, the KDF cost or salt, the key set or the device was changed); nothing was changed. Put " +
                    "back the keybag from a backup, or run `keybagfs recover` with the recovery key")
        }
        switch try Keybag.cipherIsAuthentic(file, key: key) {
        case false?:
            throw KeybagError.corrupt(
                "keybag field cipher (\(file.cipher.prefix(40))) was edited offline: its MAC does not match; set it " +
                    "again with `keybagfs cipher`"
            )
        case nil:
            // Every keybag written since devices and key sets has the MAC: one without it is stripped.
            guard currentKeySet == 0, file.format < Keybag.keySetsFormat, file.deviceID == nil || pendingDeviceID
            else {
                throw KeybagError.corrupt("keybag field cipherMAC was removed offline (the keybag was edited)")
            }
            file.cipherMAC = try Keybag.cipherMAC(file, key: key)   // keybags written before the MAC
            if file.format >= Keybag.settingsFormat { try saveWithoutCounter() }
        case true?:
            if pendingDeviceID && file.format >= Keybag.settingsFormat { try saveWithoutCounter() }
        }
        pendingDeviceID = false
        let expected = [UInt8](Data(base64Encoded: try Keybag.counterMAC(file, key: key)) ?? Data())
        var check = CounterCheck.tampered
        if let stored = file.counterMAC.flatMap({ Data(base64Encoded: $0) }).map([UInt8].init),
           stored.count == expected.count, sodium_memcmp(stored, expected, expected.count) == 0 {
            check = .authentic
        } else {
            file.failedAttempts = max(file.failedAttempts, 9)
            file.lockoutUntil = now + UnlockThrottle.delay(afterFailures: file.failedAttempts)
        }
        if file.format < Keybag.settingsFormat {
            try upgradeToSettingsFormat(deviceKey: deviceKey)   // saves the counter as checked above
            return check == .authentic ? .upgraded : .tampered
        }
        if check == .tampered { try save() }
        return check
    }

    /// Rewraps the device-only slots (`D` of every key set, `volume`) under the format-4
    /// associated data, sets format 4 and saves (settings, cipher and counter MACs written).
    private mutating func upgradeToSettingsFormat(deviceKey: SecureKey) throws {
        let dwk = try Keybag.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        var next = file
        next.format = Keybag.settingsFormat
        for slot in ["volume"] + (0...currentKeySet).map({ Keybag.slot("D", $0) }) {
            let k = try unwrapDeviceKeySlot(slot, deviceKey: deviceKey)
            defer { k.wipe() }
            next.wrapped[slot] = Data(try KeyWrap.wrap(k, with: dwk, ad: Keybag.ad(file.storeID, slot, format: next.format)))
                .base64EncodedString()
        }
        file = next
        try save()
    }

    /// Whether the stored failed-attempt counter authenticates (format 2), without changing
    /// anything (`fsck`); nil for format 1, which has no MAC yet.
    public func counterIsAuthentic(deviceKey: SecureKey) throws -> Bool? {
        guard file.format >= 2 else { return nil }
        let key = try Keybag.counterKey(deviceKey)
        defer { key.wipe() }
        let expected = [UInt8](Data(base64Encoded: try Keybag.counterMAC(file, key: key)) ?? Data())
        guard let stored = file.counterMAC.flatMap({ Data(base64Encoded: $0) }).map([UInt8].init),
            stored.count == expected.count
        else { return false }
        return sodium_memcmp(stored, expected, expected.count) == 0
    }

    /// Whether the stored cipher name authenticates under the device key (nil: no MAC yet).
    public func cipherIsAuthentic(deviceKey: SecureKey) throws -> Bool? {
        let key = try Keybag.counterKey(deviceKey)
        defer { key.wipe() }
        return try Keybag.cipherIsAuthentic(file, key: key)
    }

    /// Names the cipher of new files, with its MAC under the device key, and saves; the
    /// failed-attempt counter and its MAC stay as stored.
    public mutating func setCipherOfNewFiles(_ cipher: ContentCipher, deviceKey: SecureKey) throws {
        let key = try Keybag.counterKey(deviceKey)
        defer { key.wipe() }
        file.cipher = cipher.name
        file.cipherMAC = try Keybag.cipherMAC(file, key: key)
        try saveWithoutCounter()
    }

    /// Writes the keybag atomically: temp file, fsync, rename, fsync of the folder.
    public func save() throws { try save(recomputingCounterMAC: true) }

    /// Writes the keybag keeping the stored counter MAC: only for changes outside what it
    /// covers (the recovery counter), when the device key is not at hand.
    func saveWithoutCounter() throws { try save(recomputingCounterMAC: false) }

    private func save(recomputingCounterMAC: Bool) throws {
        var file = self.file
        // With a TPM each save is one generation past the TPM's counter, which then steps:
        // an older copy of the keybag is then below the counter.
        let counting = file.tpm2 == true && file.format >= Keybag.settingsFormat && counterKey != nil
        if counting, let sealer, let counted = try sealer.generation() { file.generation = counted + 1 }
        if file.format >= 2 && recomputingCounterMAC {
            guard let counterKey else {
                throw KeybagError.invalid("keybag not bound to its device key; cannot authenticate the counter")
            }
            file.counterMAC = try Keybag.counterMAC(file, key: counterKey)
            file.cipherMAC = try Keybag.cipherMAC(file, key: counterKey)
        }
        // The settings MAC is written whenever the device key is at hand (saves without it
        // change only what it does not cover: the recovery counters).
        if file.format >= Keybag.settingsFormat, let counterKey {
            file.settingsMAC = try Keybag.settingsMAC(file, key: counterKey)
        }
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        try Keybag.writeAtomically(try enc.encode(file), to: path)
        if counting, let sealer { try sealer.advanceGeneration() }
    }

    /// Writes `data` to `path` atomically: temp file, fsync, rename, fsync of the folder.
    static func writeAtomically(_ data: Data, to path: String) throws {
        // The temporary is always a new file of our own: a stale one (or a symlink planted in
        // its place) is removed first, and O_EXCL|O_NOFOLLOW never writes through a link
        // that appears in between (the daemon runs as root).
        let tmp = path + ".tmp"
        if unlink(tmp) != 0 && errno != ENOENT { throw KeybagError.system("cannot remove the stale \(tmp)", errno) }
        let fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw KeybagError.system("cannot write \(tmp)", errno) }
        let ok = data.withUnsafeBytes { b -> Bool in
            var off = 0
            while off < b.count {
                let n = write(fd, b.baseAddress! + off, b.count - off)
                if n <= 0 { return false }
                off += n
            }
            return fsync(fd) == 0
        }
        let err = errno
        close(fd)
        guard ok else { unlink(tmp); throw KeybagError.system("cannot write \(tmp)", err) }
        guard rename(tmp, path) == 0 else { throw KeybagError.system("cannot replace \(path)", errno) }
        DeviceKeyFile.syncFolder(of: path)
    }

    func blob(_ slot: String) throws -> [UInt8] {
        guard let s = file.wrapped[slot], let d = Data(base64Encoded: s) else {
            throw KeybagError.corrupt("keybag slot \(slot) missing")
        }
        return [UInt8](d)
    }

    /// Unwraps a device-only key (`D` or `volume`); a wrong device key gives `badDeviceKey`.
    public func unwrapDeviceKeySlot(_ slot: String, deviceKey: SecureKey) throws -> SecureKey {
        let dwk = try Keybag.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        do {
            return try KeyWrap.unwrap(try blob(slot), with: dwk, ad: Keybag.ad(file.storeID, slot, format: file.format))
        } catch KeybagError.corrupt {
            // A format-4 keybag edited to claim an older format: the slot opens under the v4 tag.
            if file.format < Keybag.settingsFormat,
                let k = try? KeyWrap.unwrap(
                    try blob(slot), with: dwk, ad: Keybag.ad(file.storeID, slot, format: Keybag.settingsFormat))
            {
                k.wipe()
                throw KeybagError.corrupt(
                    "keybag field format was edited offline (it says \(file.format); the keybag was written as format " +
                        "\(Keybag.settingsFormat)); nothing was changed")
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
        let kek = try Keybag.passcodeKey(passcode: passcode, file: file, deviceKey: deviceKey, sealer: sealer)
        defer { kek.wipe() }
        var sets: [UnlockedClassKeys] = []
        do {
            for n in 0...currentKeySet {
                func take(_ base: String) throws -> SecureKey {
                    let slot = Keybag.slot(base, n)
                    return try KeyWrap.unwrap(try blob(slot), with: kek, ad: Keybag.ad(file.storeID, slot))
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
        let kek = try Keybag.passcodeKey(passcode: passcode, file: f, deviceKey: deviceKey, sealer: next, making: true)
        defer { kek.wipe() }
        try Keybag.wrapPasscodeSlots(sets, into: &f, passcodeKey: kek)
        f.failedAttempts = 0
        f.lockoutUntil = 0
        file = f
        sealer = next
        try save()
        try next?.keepOnly(salt: f.kdfSalt)
    }

    /// Refuses a keybag older than the one this device last wrote: with a TPM, its
    /// generation must be at least the TPM's NV counter (a crash between the keybag's save
    /// and the counter's step leaves it one ahead, which is fine).
    public func checkGeneration() throws {
        guard file.tpm2 == true, let sealer else { return }
        let counted: UInt64?
        do { counted = try sealer.generation() } catch let e as TPMError { throw KeybagError.invalid(Keybag.tpmTrouble(e)) }
        guard let counted else {
            // Every completed enrollment has its counter: one without names no counter to check
            // (an edited enrollment), so nothing would stop an older keybag.
            throw KeybagError.corrupt(
                "this device's TPM enrollment names no keybag counter (it was edited); nothing was changed. Run " +
                    "`keybagfs recover` with the recovery key")
        }
        let mine = file.generation ?? 0
        guard mine >= counted else {
            throw KeybagError.corrupt(
                "keybag \(relativePath) is older than the one this device last wrote (generation \(mine), the TPM's " +
                    "counter is at \(counted)): it was put back from an older copy; nothing was changed. Put back the " +
                    "newest keybag, or run `keybagfs recover` with the recovery key")
        }
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

/// The device key file: 32 random bytes, mode 0600, outside the store.
public enum DeviceKeyFile {
    /// Default location for a store id.
    public static func defaultPath(storeID: String) -> String { "/var/lib/keybagfs/\(storeID).key" }

    /// Creates a new device key at `path` (refuses to overwrite), returns it.
    public static func create(at path: String) throws -> SecureKey {
        let dir = (path as NSString).deletingLastPathComponent
        if !dir.isEmpty {
            try? FileManager.default.createDirectory(
                atPath: dir, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        }
        let fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw KeybagError.system("cannot create device key \(path)", errno) }
        defer { close(fd) }
        let key = SecureKey(random: 32)
        let n = try key.withBytes { write(fd, $0.baseAddress!, 32) }
        guard n == 32, fsync(fd) == 0 else { throw KeybagError.system("cannot write device key \(path)", errno) }
        syncFolder(of: path)
        return key
    }

    /// Makes a new or renamed entry in the folder of `path` durable.
    public static func syncFolder(of path: String) {
        let dir = (path as NSString).deletingLastPathComponent
        let dfd = open(dir.isEmpty ? "." : dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dfd >= 0 { fsync(dfd); close(dfd) }
    }

    /// Reads a device key; it must be exactly 32 bytes.
    public static func load(from path: String) throws -> SecureKey {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { throw KeybagError.system("cannot read device key \(path)", errno) }
        defer { close(fd) }
        var st = stat()
        guard fstat(fd, &st) == 0, st.st_size == 32 else {
            throw KeybagError.invalid("device key \(path) must be exactly 32 bytes")
        }
        return try SecureKey(count: 32) { out in
            guard read(fd, out.baseAddress!, 32) == 32 else {
                throw KeybagError.system("cannot read device key \(path)", errno)
            }
        }
    }
}
