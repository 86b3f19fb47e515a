import CSodium

/// Encrypted names, symlink targets and directory metadata, all under the volume key
/// (wrapped by the device key only, so the tree stays browsable in every lock state).
///
/// Names use an SIV construction built from libsodium parts: the synthetic IV is a keyed
/// BLAKE2b-128 of the directory IV and the name; it is both the authentication tag and
/// (with the first 8 bytes of the directory IV) the XChaCha20 nonce. The same name in the
/// same directory always encrypts the same way, so a lookup needs no scan; the same name
/// in two directories (different IVs) encrypts differently.
public final class NameCipher: Sendable {
    /// Longest name a backing directory entry may have.
    public static let backingNameMax = 255
    /// Prefix of a hashed long name; `.` is outside base64url, so no encrypted name has it.
    public static let longPrefix = "kbl."
    /// Suffix of the side file that holds a long name's full encrypted form.
    public static let longSuffix = ".name"
    /// Backing names the store reserves for its own files (`.kbfs-dir`, temporaries);
    /// encrypted names are base64url and never start with a dot.
    public static let reservedPrefix = ".kbfs-"
    /// Prefix of a symlink target that lives in the store's target folder.
    public static let longTargetPrefix = "kbt."

    private let encKey: SecureKey
    private let macKey: SecureKey
    private let metaKey: SecureKey

    /// Subkeys of the volume key by `crypto_kdf_derive_from_key` (context "kbfsname"):
    /// 1 name stream, 2 name MAC, 3 symlink targets and directory metadata.
    public init(volumeKey: SecureKey) throws {
        func derive(_ id: UInt64) throws -> SecureKey {
            try volumeKey.withBytes { vk in
                SecureKey(count: 32) { out in
                    _ = crypto_kdf_derive_from_key(
                        out.baseAddress!.assumingMemoryBound(to: UInt8.self), 32, id, "kbfsname",
                        vk.baseAddress!.assumingMemoryBound(to: UInt8.self))
                }
            }
        }
        encKey = try derive(1)
        macKey = try derive(2)
        metaKey = try derive(3)
    }

    /// Zeroes the subkeys.
    public func wipe() { encKey.wipe(); macKey.wipe(); metaKey.wipe() }

    /// The synthetic IV of a name in a directory.
    private func siv(_ name: [UInt8], dirIV: [UInt8]) throws -> [UInt8] {
        let msg = Array("keybagfs-name-v1".utf8) + dirIV + name
        var out = [UInt8](repeating: 0, count: 16)
        try macKey.withBytes { k in
            _ = crypto_generichash(
                &out, 16, msg, UInt64(msg.count), k.baseAddress!.assumingMemoryBound(to: UInt8.self), 32)
        }
        return out
    }

    /// The name IV of a new store's root: BLAKE2b-128 keyed by the name MAC key of a label, so
    /// every device that makes the root's metadata writes the same bytes.
    public func rootIV() throws -> [UInt8] {
        let msg = Array("keybagfs-dir-iv-v1keybagfs-root".utf8)
        var out = [UInt8](repeating: 0, count: 16)
        try macKey.withBytes { k in
            _ = crypto_generichash(
                &out, 16, msg, UInt64(msg.count), k.baseAddress!.assumingMemoryBound(to: UInt8.self), 32)
        }
        return out
    }

    /// XChaCha20 keystream xor with nonce = siv || dirIV[0..<8].
    private func xor(_ data: [UInt8], siv: [UInt8], dirIV: [UInt8]) throws -> [UInt8] {
        let nonce = siv + Array(dirIV[0..<8])
        var out = [UInt8](repeating: 0, count: data.count)
        try encKey.withBytes { k in
            _ = crypto_stream_xchacha20_xor(
                &out, data, UInt64(data.count), nonce, k.baseAddress!.assumingMemoryBound(to: UInt8.self))
        }
        return out
    }

    /// The encrypted form of a plaintext name (base64url, no padding); may exceed 255 bytes.
    public func encrypt(_ name: [UInt8], dirIV: [UInt8]) throws -> String {
        let tag = try siv(name, dirIV: dirIV)
        return Base64URL.encode(tag + (try xor(name, siv: tag, dirIV: dirIV)))
    }

    /// The plaintext of an encrypted name; `corrupt` when it was altered or is not a name.
    public func decrypt(_ stored: String, dirIV: [UInt8]) throws -> [UInt8] {
        guard let raw = Base64URL.decode(stored), raw.count > 16 else {
            throw KeybagError.corrupt("not an encrypted name")
        }
        let tag = Array(raw[0..<16])
        let name = try xor(Array(raw[16...]), siv: tag, dirIV: dirIV)
        guard sodium_memcmp(try siv(name, dirIV: dirIV), tag, 16) == 0 else {
            throw KeybagError.corrupt("name failed authentication")
        }
        guard !name.contains(0), !name.contains(UInt8(ascii: "/")), name != [0x2e], name != [0x2e, 0x2e] else {
            throw KeybagError.corrupt("decrypted name is not a file name")
        }
        return name
    }

    /// The backing entry for an encrypted name: itself when short enough, else a hashed
    /// name whose side file (`kbl.<hash>.name`) holds the full encrypted form.
    public static func backingEntry(for encrypted: String) -> (name: String, sideFile: String?) {
        guard encrypted.utf8.count > backingNameMax else { return (encrypted, nil) }
        var h = [UInt8](repeating: 0, count: 32)
        let b = Array(encrypted.utf8)
        crypto_generichash(&h, 32, b, UInt64(b.count), nil, 0)
        let name = longPrefix + Base64URL.encode(h)
        return (name, name + longSuffix)
    }

    /// Whether a backing entry is a long name's side file.
    public static func isSideFile(_ backing: String) -> Bool {
        backing.hasPrefix(longPrefix) && backing.hasSuffix(longSuffix)
    }

    /// Whether a backing entry is a hashed long name.
    public static func isLongName(_ backing: String) -> Bool {
        backing.hasPrefix(longPrefix) && !backing.hasSuffix(longSuffix)
    }

    /// Seals small metadata (symlink targets, a directory's class) with a random nonce:
    /// nonce(24) || XChaCha20-Poly1305(data, ad = purpose).
    public func seal(_ data: [UInt8], purpose: String) throws -> [UInt8] {
        let ad = Array(purpose.utf8)
        var out = [UInt8](repeating: 0, count: 24 + data.count + 16)
        randombytes_buf(&out, 24)
        let nonce = Array(out[0..<24])
        var clen: UInt64 = 0
        try metaKey.withBytes { k in
            out.withUnsafeMutableBufferPointer { o in
                _ = crypto_aead_xchacha20poly1305_ietf_encrypt(
                    o.baseAddress! + 24, &clen, data, UInt64(data.count), ad, UInt64(ad.count),
                    nil, nonce, k.baseAddress!.assumingMemoryBound(to: UInt8.self))
            }
        }
        return out
    }

    /// Opens what `seal` produced; `corrupt` when altered.
    public func open(_ sealed: [UInt8], purpose: String) throws -> [UInt8] {
        guard sealed.count >= 40 else { throw KeybagError.corrupt("sealed metadata too short") }
        let ad = Array(purpose.utf8)
        var out = [UInt8](repeating: 0, count: sealed.count - 40)
        var mlen: UInt64 = 0
        let rc: Int32 = try metaKey.withBytes { k in
            sealed.withUnsafeBufferPointer { s in
                crypto_aead_xchacha20poly1305_ietf_decrypt(
                    &out, &mlen, nil, s.baseAddress! + 24, UInt64(sealed.count - 24), ad, UInt64(ad.count),
                    s.baseAddress!, k.baseAddress!.assumingMemoryBound(to: UInt8.self))
            }
        }
        guard rc == 0 else { throw KeybagError.corrupt("sealed metadata failed authentication") }
        return Array(out[0..<Int(mlen)])
    }

    /// A symlink target as stored in the backing symlink.
    public func encryptTarget(_ target: [UInt8]) throws -> String {
        Base64URL.encode(try seal(target, purpose: "keybagfs-symlink-v1"))
    }

    /// Length of a symlink that keeps its target in the store's `targets/` folder: the
    /// prefix and the base64url BLAKE2b-256 id. Shorter than any directly stored target
    /// (the smallest, one byte, seals to 41 bytes: 55 characters).
    public static let longTargetLinkLength = longTargetPrefix.utf8.count + 43

    /// The plaintext length of a symlink target stored as `storedLength` characters
    /// (base64url without padding of nonce, ciphertext and tag).
    public static func targetLength(storedLength: Int) -> Int {
        max(0, storedLength / 4 * 3 + storedLength % 4 * 3 / 4 - 40)
    }

    /// The plaintext of a stored symlink target.
    public func decryptTarget(_ stored: String) throws -> [UInt8] {
        guard let raw = Base64URL.decode(stored) else { throw KeybagError.corrupt("not an encrypted symlink target") }
        return try open(raw, purpose: "keybagfs-symlink-v1")
    }
}

/// The per-directory metadata file `.kbfs-dir`: magic `KBD1`, the directory's random
/// 16-byte name IV, then optionally its sealed default class.
public struct DirectoryMeta: Sendable, Equatable {
    /// Reserved backing name of the file.
    public static let fileName = ".kbfs-dir"
    static let magic: [UInt8] = Array("KBD1".utf8)
    /// Random IV for the names in this directory.
    public var iv: [UInt8]
    /// Default class of new files, if set.
    public var defaultClass: ProtectionClass?

    /// Fresh metadata with a random IV.
    public static func fresh() -> DirectoryMeta { DirectoryMeta(iv: Sodium.randomArray(16), defaultClass: nil) }

    public init(iv: [UInt8], defaultClass: ProtectionClass?) {
        self.iv = iv
        self.defaultClass = defaultClass
    }

    /// File contents.
    public func encode(_ cipher: NameCipher) throws -> [UInt8] {
        var b = Self.magic + iv
        if let c = defaultClass {
            b += try cipher.seal([c.rawValue], purpose: "keybagfs-dirclass-v1|" + Base64URL.encode(iv))
        }
        return b
    }

    /// Parses file contents; a class that fails authentication is `corrupt`.
    public static func decode(_ b: [UInt8], _ cipher: NameCipher) throws -> DirectoryMeta {
        guard b.count >= 20, Array(b[0..<4]) == magic else { throw KeybagError.corrupt("directory metadata") }
        let iv = Array(b[4..<20])
        var cls: ProtectionClass? = nil
        if b.count > 20 {
            let v = try cipher.open(Array(b[20...]), purpose: "keybagfs-dirclass-v1|" + Base64URL.encode(iv))
            guard v.count == 1, let c = ProtectionClass(rawValue: v[0]) else {
                throw KeybagError.corrupt("directory class")
            }
            cls = c
        }
        return DirectoryMeta(iv: iv, defaultClass: cls)
    }
}

/// base64url without padding (libsodium's `sodium_bin2base64` URLSAFE_NO_PADDING).
public enum Base64URL {
    static let variant = Int32(sodium_base64_VARIANT_URLSAFE_NO_PADDING)

    /// Encodes bytes.
    public static func encode(_ b: [UInt8]) -> String {
        let len = sodium_base64_encoded_len(b.count, variant)
        var out = [CChar](repeating: 0, count: len)
        _ = sodium_bin2base64(&out, len, b, b.count, variant)
        return String(decoding: out.prefix(len - 1).map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    /// Decodes, or nil when the text is not strict base64url.
    public static func decode(_ s: String) -> [UInt8]? {
        let input = Array(s.utf8)
        var out = [UInt8](repeating: 0, count: input.count * 3 / 4 + 3)
        var binLen = 0
        let rc = input.withUnsafeBufferPointer { i in
            i.withMemoryRebound(to: CChar.self) { c in
                sodium_base642bin(&out, out.count, c.baseAddress, input.count, nil, &binLen, nil, variant)
            }
        }
        guard rc == 0 else { return nil }
        return Array(out[0..<binLen])
    }
}
