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
    /// Content cipher name (`aes256gcm` or `xchacha20poly1305`).
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

/// The unwrapped class keys of a successful unlock.
public struct UnlockedClassKeys: Sendable {
    /// Class A key.
    public let classA: SecureKey
    /// Class B X25519 private key.
    public let classBSecret: SecureKey
    /// Class B public key.
    public let classBPublic: [UInt8]
    /// Class C key.
    public let classC: SecureKey

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
    /// The parsed file.
    public private(set) var file: KeybagFile

    /// The store's content cipher.
    public var cipher: ContentCipher { ContentCipher(name: file.cipher) ?? .xchacha20poly1305 }
    /// Path of the keybag file.
    public var path: String { storePath + "/" + Keybag.fileName }

    private static func ad(_ storeID: String, _ slot: String) -> [UInt8] { Array("keybagfs-keybag-v1|\(storeID)|\(slot)".utf8) }

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
    /// neither the passcode nor the device key alone derives it.
    public static func passcodeKey(passcode: SecureKey, file: KeybagFile, deviceKey: SecureKey) throws -> SecureKey {
        guard let salt = Data(base64Encoded: file.kdfSalt), salt.count == Int(crypto_pwhash_SALTBYTES) else {
            throw KeybagError.corrupt("keybag salt")
        }
        let stretched = SecureKey(zeroed: 32)
        defer { stretched.wipe() }
        let rc: Int32 = try passcode.withBytes { p in
            try stretched.withBytes { out in
                [UInt8](salt).withUnsafeBufferPointer { s in
                    crypto_pwhash(UnsafeMutablePointer(mutating: out.baseAddress!.assumingMemoryBound(to: UInt8.self)), 32,
                                  p.baseAddress!.assumingMemoryBound(to: CChar.self), UInt64(p.count),
                                  s.baseAddress!, file.kdfOpsLimit, Int(file.kdfMemLimit), crypto_pwhash_ALG_ARGON2ID13)
                }
            }
        }
        guard rc == 0 else { throw KeybagError.system("crypto_pwhash (out of memory?)", ENOMEM) }
        return try deviceKey.withBytes { dk in
            try stretched.withBytes { st in
                KeyWrap.keyedHash(key: dk, parts: [Array("keybagfs-passcode-kek-v1".utf8), Array(file.storeID.utf8), Array(st)])
            }
        }
    }

    /// Creates a new keybag in `storePath` (which must be empty or absent) and returns it.
    public static func create(storePath: String, storeID: String, passcode: SecureKey, deviceKey: SecureKey, strength: KDFStrength,
                              cipher: ContentCipher = .preferred) throws -> Keybag {
        var file = KeybagFile(format: 1, storeID: storeID, cipher: cipher.name, kdfOpsLimit: strength.opsLimit,
                              kdfMemLimit: strength.memLimit, kdfSalt: Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString(),
                              wrapped: [:], classBPublic: "", failedAttempts: 0, lockoutUntil: 0)
        let kek = try passcodeKey(passcode: passcode, file: file, deviceKey: deviceKey)
        defer { kek.wipe() }
        let dwk = try deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        let a = SecureKey(random: 32), bs = SecureKey(random: 32), c = SecureKey(random: 32)
        let d = SecureKey(random: 32), vol = SecureKey(random: 32)
        defer { [a, bs, c, d, vol].forEach { $0.wipe() } }
        let bp = try ClassBAgreement.publicKey(of: bs)
        for (slot, key, wrapper) in [("A", a, kek), ("B", bs, kek), ("C", c, kek), ("D", d, dwk), ("volume", vol, dwk)] {
            file.wrapped[slot] = Data(try KeyWrap.wrap(key, with: wrapper, ad: ad(storeID, slot))).base64EncodedString()
        }
        file.classBPublic = Data(bp).base64EncodedString()
        let kb = Keybag(storePath: storePath, file: file)
        try kb.save()
        return kb
    }

    /// Reads the keybag of a store.
    public static func load(storePath: String) throws -> Keybag {
        let p = storePath + "/" + fileName
        guard let data = FileManager.default.contents(atPath: p) else {
            throw KeybagError.invalid("no keybag at \(p): not a keybagfs store (run `keybagfs init` first)")
        }
        do {
            let file = try JSONDecoder().decode(KeybagFile.self, from: data)
            guard file.format == 1 else { throw KeybagError.corrupt("unknown keybag format \(file.format)") }
            guard ContentCipher(name: file.cipher) != nil else { throw KeybagError.corrupt("unknown cipher \(file.cipher)") }
            return Keybag(storePath: storePath, file: file)
        } catch let e as KeybagError {
            throw e
        } catch {
            throw KeybagError.corrupt("keybag \(p) is not valid JSON")
        }
    }

    /// Writes the keybag atomically: temp file, fsync, rename, fsync of the folder.
    public func save() throws {
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        let data = try enc.encode(file)
        let tmp = path + ".tmp"
        let fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
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
        let dfd = open(storePath, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dfd >= 0 { fsync(dfd); close(dfd) }
    }

    private func blob(_ slot: String) throws -> [UInt8] {
        guard let s = file.wrapped[slot], let d = Data(base64Encoded: s) else { throw KeybagError.corrupt("keybag slot \(slot) missing") }
        return [UInt8](d)
    }

    /// Unwraps a device-only key (`D` or `volume`); a wrong device key gives `badDeviceKey`.
    public func unwrapDeviceKeySlot(_ slot: String, deviceKey: SecureKey) throws -> SecureKey {
        let dwk = try Keybag.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        do { return try KeyWrap.unwrap(try blob(slot), with: dwk, ad: Keybag.ad(file.storeID, slot)) } catch KeybagError.corrupt {
            throw KeybagError.badDeviceKey
        }
    }

    /// Unwraps A, B and C with a passcode; `badPasscode` when it is wrong. Does not count attempts.
    public func unlock(passcode: SecureKey, deviceKey: SecureKey) throws -> UnlockedClassKeys {
        let kek = try Keybag.passcodeKey(passcode: passcode, file: file, deviceKey: deviceKey)
        defer { kek.wipe() }
        do {
            let a = try KeyWrap.unwrap(try blob("A"), with: kek, ad: Keybag.ad(file.storeID, "A"))
            let b = try KeyWrap.unwrap(try blob("B"), with: kek, ad: Keybag.ad(file.storeID, "B"))
            let c = try KeyWrap.unwrap(try blob("C"), with: kek, ad: Keybag.ad(file.storeID, "C"))
            let pk = try ClassBAgreement.publicKey(of: b)
            return UnlockedClassKeys(classA: a, classBSecret: b, classBPublic: pk, classC: c)
        } catch KeybagError.corrupt {
            throw KeybagError.badPasscode
        }
    }

    /// Rewraps A, B and C under a new passcode (new salt); no file data changes.
    public mutating func changePasscode(old: SecureKey, new: SecureKey, deviceKey: SecureKey) throws {
        let keys = try unlock(passcode: old, deviceKey: deviceKey)
        defer { keys.wipe() }
        var next = file
        next.kdfSalt = Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString()
        let kek = try Keybag.passcodeKey(passcode: new, file: next, deviceKey: deviceKey)
        defer { kek.wipe() }
        for (slot, key) in [("A", keys.classA), ("B", keys.classBSecret), ("C", keys.classC)] {
            next.wrapped[slot] = Data(try KeyWrap.wrap(key, with: kek, ad: Keybag.ad(file.storeID, slot))).base64EncodedString()
        }
        next.failedAttempts = 0
        next.lockoutUntil = 0
        file = next
        try save()
    }

    /// Seconds until the next attempt is allowed (0 when allowed now).
    public func retryAfter(now: Double) -> Double { max(0, file.lockoutUntil - now) }

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
        if !dir.isEmpty { try? FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700]) }
        let fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw KeybagError.system("cannot create device key \(path)", errno) }
        defer { close(fd) }
        let key = SecureKey(random: 32)
        let n = try key.withBytes { write(fd, $0.baseAddress!, 32) }
        guard n == 32, fsync(fd) == 0 else { throw KeybagError.system("cannot write device key \(path)", errno) }
        return key
    }

    /// Reads a device key; it must be exactly 32 bytes.
    public static func load(from path: String) throws -> SecureKey {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { throw KeybagError.system("cannot read device key \(path)", errno) }
        defer { close(fd) }
        var st = stat()
        guard fstat(fd, &st) == 0, st.st_size == 32 else { throw KeybagError.invalid("device key \(path) must be exactly 32 bytes") }
        return try SecureKey(count: 32) { out in
            guard read(fd, out.baseAddress!, 32) == 32 else { throw KeybagError.system("cannot read device key \(path)", errno) }
        }
    }
}
