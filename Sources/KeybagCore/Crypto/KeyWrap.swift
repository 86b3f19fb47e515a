import CCrypto
import CSodium

/// Key wrapping: XChaCha20-Poly1305-IETF with a random 24-byte nonce and a purpose
/// string as associated data. Output: nonce (24) || ciphertext || tag (16).
public enum KeyWrap {
    /// Bytes added to a wrapped secret.
    public static let overhead = 24 + 16

    /// Encrypts `secret` under `kek`, binding `ad`.
    public static func wrap(_ secret: SecureKey, with kek: SecureKey, ad: [UInt8]) throws -> [UInt8] {
        defer { kbfs_scrub_stack() }  // libsodium's XChaCha20 subkey of `kek` stays below this frame
        var out = [UInt8](repeating: 0, count: secret.count + overhead)
        try secret.withBytes { s in
            try kek.withBytes { k in
                out.withUnsafeMutableBufferPointer { o in
                    randombytes_buf(o.baseAddress!, 24)
                    var clen: UInt64 = 0
                    _ = crypto_aead_xchacha20poly1305_ietf_encrypt(
                        o.baseAddress! + 24, &clen, s.baseAddress!.assumingMemoryBound(to: UInt8.self), UInt64(s.count),
                        ad, UInt64(ad.count), nil, o.baseAddress!, k.baseAddress!.assumingMemoryBound(to: UInt8.self))
                }
            }
        }
        return out
    }

    /// Decrypts a wrapped secret straight into guarded memory; throws `corrupt` when the
    /// tag does not verify (wrong key, wrong purpose, or tampering).
    public static func unwrap(_ blob: [UInt8], with kek: SecureKey, ad: [UInt8]) throws -> SecureKey {
        guard blob.count > overhead else { throw KeybagError.corrupt("wrapped key too short") }
        let n = blob.count - overhead
        defer { kbfs_scrub_stack() }
        return try SecureKey(count: n) { out in
            let rc: Int32 = try kek.withBytes { k in
                blob.withUnsafeBufferPointer { b in
                    var mlen: UInt64 = 0
                    return crypto_aead_xchacha20poly1305_ietf_decrypt(
                        out.baseAddress!.assumingMemoryBound(to: UInt8.self), &mlen, nil,
                        b.baseAddress! + 24, UInt64(blob.count - 24), ad, UInt64(ad.count), b.baseAddress!,
                        k.baseAddress!.assumingMemoryBound(to: UInt8.self))
                }
            }
            guard rc == 0 else { throw KeybagError.corrupt("wrapped key failed authentication") }
        }
    }

    /// BLAKE2b-256 keyed with `key` over the concatenation of `parts`, into guarded memory.
    public static func keyedHash(key: UnsafeRawBufferPointer, parts: [[UInt8]]) -> SecureKey {
        let total = parts.reduce(0) { $0 + $1.count }
        let message = SecureKey(zeroed: max(total, 1))
        defer { message.wipe() }
        return SecureKey(count: 32) { out in
            try? message.withBytes { m in
                var off = 0
                let mp = UnsafeMutableRawPointer(mutating: m.baseAddress!)
                for p in parts {
                    p.withUnsafeBytes { (mp + off).copyMemory(from: $0.baseAddress!, byteCount: p.count) };
                    off += p.count
                }
                crypto_generichash(
                    out.baseAddress!.assumingMemoryBound(to: UInt8.self), 32,
                    m.baseAddress!.assumingMemoryBound(to: UInt8.self), UInt64(total),
                    key.baseAddress!.assumingMemoryBound(to: UInt8.self), key.count)
            }
        }
    }
}

/// The X25519 derivation of class B (One-Pass DH): the wrapping key of one file is
/// BLAKE2b-256 keyed by the shared secret, over a label, both public keys and the file id.
public enum ClassBAgreement {
    /// Wrap key for a new file: uses a fresh ephemeral pair; returns (wrap key, ephemeral public key).
    public static func newFileWrapKey(classPublicKey: [UInt8], fileID: [UInt8]) throws -> (SecureKey, [UInt8]) {
        let ephSecret = SecureKey(random: 32)
        defer { ephSecret.wipe() }
        var ephPublic = [UInt8](repeating: 0, count: 32)
        try ephSecret.withBytes { s in
            _ = crypto_scalarmult_base(&ephPublic, s.baseAddress!.assumingMemoryBound(to: UInt8.self))
        }
        let key = try derive(
            secret: ephSecret, peerPublic: classPublicKey, ephPublic: ephPublic,
            classPublic: classPublicKey, fileID: fileID)
        return (key, ephPublic)
    }

    /// Wrap key for an existing file, from the class private key and the file's ephemeral public key.
    public static func existingFileWrapKey(
        classSecret: SecureKey, classPublicKey: [UInt8], ephPublic: [UInt8], fileID: [UInt8]
    ) throws -> SecureKey {
        try derive(
            secret: classSecret, peerPublic: ephPublic, ephPublic: ephPublic,
            classPublic: classPublicKey, fileID: fileID)
    }

    /// The public key of an X25519 secret.
    public static func publicKey(of secret: SecureKey) throws -> [UInt8] {
        var pk = [UInt8](repeating: 0, count: 32)
        try secret.withBytes { s in _ = crypto_scalarmult_base(&pk, s.baseAddress!.assumingMemoryBound(to: UInt8.self))
        }
        return pk
    }

    private static func derive(
        secret: SecureKey, peerPublic: [UInt8], ephPublic: [UInt8], classPublic: [UInt8], fileID: [UInt8]
    ) throws -> SecureKey {
        let shared = SecureKey(zeroed: 32)
        defer { shared.wipe() }
        let rc: Int32 = try secret.withBytes { s in
            try shared.withBytes { sh in
                crypto_scalarmult(
                    UnsafeMutablePointer(mutating: sh.baseAddress!.assumingMemoryBound(to: UInt8.self)),
                    s.baseAddress!.assumingMemoryBound(to: UInt8.self), peerPublic)
            }
        }
        guard rc == 0 else { throw KeybagError.corrupt("class B key agreement failed") }
        return try shared.withBytes { sh in
            KeyWrap.keyedHash(key: sh, parts: [Array("keybagfs-classB-wrap-v1".utf8), ephPublic, classPublic, fileID])
        }
    }
}
