import CSodium
import Foundation

/// Ed25519 signatures (libsodium `crypto_sign_*`): a key pair from a 32-byte seed kept in
/// guarded memory; the 64-byte secret key exists only for the length of one signature.
public enum Ed25519 {
    /// Bytes of a public key.
    public static let publicKeyBytes = 32
    /// Bytes of a signature.
    public static let signatureBytes = 64

    /// The public key of `seed`.
    public static func publicKey(seed: SecureKey) throws -> [UInt8] {
        var pk = [UInt8](repeating: 0, count: publicKeyBytes)
        let sk = SecureKey(zeroed: 64)
        defer { sk.wipe() }
        try seed.withBytes { s in
            try sk.withBytes { k in
                _ = crypto_sign_seed_keypair(
                    &pk, UnsafeMutablePointer(mutating: k.baseAddress!.assumingMemoryBound(to: UInt8.self)),
                    s.baseAddress!.assumingMemoryBound(to: UInt8.self))
            }
        }
        return pk
    }

    /// The detached signature of `message` under `seed`'s key pair.
    public static func sign(_ message: [UInt8], seed: SecureKey) throws -> [UInt8] {
        var sig = [UInt8](repeating: 0, count: signatureBytes)
        var pk = [UInt8](repeating: 0, count: publicKeyBytes)
        let sk = SecureKey(zeroed: 64)
        defer { sk.wipe() }
        try seed.withBytes { s in
            try sk.withBytes { k in
                let kp = UnsafeMutablePointer(mutating: k.baseAddress!.assumingMemoryBound(to: UInt8.self))
                _ = crypto_sign_seed_keypair(&pk, kp, s.baseAddress!.assumingMemoryBound(to: UInt8.self))
                _ = crypto_sign_detached(&sig, nil, message, UInt64(message.count), kp)
            }
        }
        return sig
    }

    /// Whether `signature` is `publicKey`'s over `message` (false for malformed input).
    public static func verify(_ signature: [UInt8], of message: [UInt8], publicKey: [UInt8]) -> Bool {
        guard signature.count == signatureBytes, publicKey.count == publicKeyBytes else { return false }
        Sodium.ensureInitialized()
        return crypto_sign_verify_detached(signature, message, UInt64(message.count), publicKey) == 0
    }
}

/// Anonymous public-key encryption to an X25519 key (libsodium `crypto_box_seal`): what one
/// device uses to hand a key set to another device that only its public key names.
public enum SealedBox {
    /// Bytes a sealed box adds to its plaintext.
    public static let overhead = Int(crypto_box_sealbytes())

    /// The X25519 public key of `secret`.
    public static func publicKey(of secret: SecureKey) throws -> [UInt8] {
        try ClassBAgreement.publicKey(of: secret)
    }

    /// `plaintext` (guarded memory) sealed to `publicKey`.
    public static func seal(_ plaintext: SecureKey, to publicKey: [UInt8]) throws -> [UInt8] {
        guard publicKey.count == 32 else { throw KeybagError.corrupt("not an X25519 public key") }
        var out = [UInt8](repeating: 0, count: plaintext.count + overhead)
        let rc = try plaintext.withBytes { p in
            crypto_box_seal(&out, p.baseAddress!.assumingMemoryBound(to: UInt8.self), UInt64(p.count), publicKey)
        }
        guard rc == 0 else { throw KeybagError.corrupt("crypto_box_seal failed") }
        return out
    }

    /// Opens a box sealed to `secret`'s public key, into guarded memory; `corrupt` when it
    /// was sealed to another key or altered.
    public static func open(_ box: [UInt8], secret: SecureKey) throws -> SecureKey {
        guard box.count > overhead else { throw KeybagError.corrupt("a sealed box too short") }
        let pk = try publicKey(of: secret)
        return try SecureKey(count: box.count - overhead) { out in
            let rc = try secret.withBytes { s in
                crypto_box_seal_open(
                    out.baseAddress!.assumingMemoryBound(to: UInt8.self), box, UInt64(box.count), pk,
                    s.baseAddress!.assumingMemoryBound(to: UInt8.self))
            }
            guard rc == 0 else { throw KeybagError.corrupt("a sealed box that does not open with this device's key") }
        }
    }
}

/// A message to sign: a label, then fields, each by name and length-prefixed (little-endian
/// UInt32), so that no two different records give the same bytes.
public struct SignedMessage {
    /// The bytes so far.
    public private(set) var bytes: [UInt8]

    /// A message starting with `label`.
    public init(_ label: String) { bytes = Array(label.utf8) + [0] }

    /// Appends field `name` with `value`.
    public mutating func add(_ name: String, _ value: [UInt8]) {
        for part in [Array(name.utf8), value] {
            withUnsafeBytes(of: UInt32(part.count).littleEndian) { bytes += $0 }
            bytes += part
        }
    }

    /// Appends field `name` with a string value.
    public mutating func add(_ name: String, _ value: String) { add(name, Array(value.utf8)) }
}
