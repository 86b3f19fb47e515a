import CSodium
import Foundation

/// A recovery key: 32 random bytes that unwrap the keybag's escrow slots (every class key,
/// the class D key and the volume key) without the passcode and without the device key.
/// Written for people as `KBR1-` and eleven groups of five base32 characters: the 32 bytes
/// and a 2-byte check, so a mistyped character is caught before it counts as an attempt.
public struct RecoveryKey: Sendable {
    /// The 32 secret bytes.
    public let secret: SecureKey
    /// Length of the written form, dashes and prefix included.
    public static let textLength = 5 + 11 * 5 + 10
    static let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567".utf8)

    /// A new random recovery key.
    public static func generate() -> RecoveryKey { RecoveryKey(secret: SecureKey(random: 32)) }

    /// The 2-byte check of `key`: BLAKE2b-128 of a label keyed by the key, first two bytes.
    static func check(_ key: UnsafeRawBufferPointer) -> (UInt8, UInt8) {
        var h = [UInt8](repeating: 0, count: 16)
        // Keyed by R itself, so R is never copied into an ordinary buffer.
        let label = Array("keybagfs-recovery-check-v1".utf8)
        crypto_generichash(
            &h, 16, label, UInt64(label.count), key.baseAddress!.assumingMemoryBound(to: UInt8.self), key.count)
        return (h[0], h[1])
    }

    /// The written form, in guarded memory (`KBR1-XXXXX-…`, no newline).
    public func text() throws -> SecureKey {
        try secret.withBytes { k in
            let raw = SecureKey(count: 34) { out in
                out.copyMemory(from: k)
                let c = Self.check(k)
                out[32] = c.0
                out[33] = c.1
            }
            defer { raw.wipe() }
            return try raw.withBytes { r in
                SecureKey(count: Self.textLength) { out in
                    for (i, ch) in "KBR1".utf8.enumerated() { out[i] = ch }
                    var pos = 4
                    for i in 0..<55 {
                        if i % 5 == 0 { out[pos] = UInt8(ascii: "-"); pos += 1 }
                        // Character i holds bits 5i ..< 5i+5 of the 272-bit value (the last is padded with zeros).
                        var v = 0
                        for bit in 0..<5 {
                            let n = i * 5 + bit
                            let b = n < 272 ? (Int(r[n / 8]) >> (7 - n % 8)) & 1 : 0
                            v = v << 1 | b
                        }
                        out[pos] = Self.alphabet[v]
                        pos += 1
                    }
                }
            }
        }
    }

    /// Parses the written form (case, spaces and dashes do not matter). A wrong length,
    /// character or check is an `invalid` error: a typo, not a guess.
    public static func parse(_ text: SecureKey) throws -> RecoveryKey {
        let bits = SecureKey(zeroed: 40)
        defer { bits.wipe() }
        var count = 0
        var prefixOK = false
        try text.withBytes { t in
            try bits.withBytes { bb in
                let out = UnsafeMutableRawBufferPointer(mutating: bb)
                var chars = 0
                var i = 0
                // Skip the `KBR1` prefix (required).
                var letters: [UInt8] = []
                while i < t.count && letters.count < 4 {
                    let c = t[i] | 0x20
                    if t[i] != UInt8(ascii: " ") && t[i] != UInt8(ascii: "-") && t[i] != UInt8(ascii: "\t") {
                        letters.append(c)
                    }
                    i += 1
                }
                prefixOK = letters == Array("kbr1".utf8)
                while i < t.count {
                    let c = t[i]
                    i += 1
                    if c == UInt8(ascii: " ") || c == UInt8(ascii: "-") || c == UInt8(ascii: "\t") { continue }
                    let up = (c >= 0x61 && c <= 0x7A) ? c - 0x20 : c
                    guard let v = alphabet.firstIndex(of: up) else {
                        throw KeybagError.invalid("not a recovery key: it uses only the letters A-Z and the digits 2-7")
                    }
                    guard chars < 55 else { throw KeybagError.invalid("not a recovery key: too long") }
                    for bit in 0..<5 {
                        let n = chars * 5 + bit
                        guard (v >> (4 - bit)) & 1 == 1 else { continue }
                        // The last character's low three bits are padding and written as zeros.
                        guard n < 272 else {
                            throw KeybagError.invalid("not a recovery key: its last character is mistyped")
                        }
                        out[n / 8] |= UInt8(0x80 >> (n % 8))
                    }
                    chars += 1
                }
                count = chars
            }
        }
        guard prefixOK else { throw KeybagError.invalid("not a recovery key: it starts with KBR1-") }
        guard count == 55 else { throw KeybagError.invalid("not a recovery key: \(count) of 55 characters") }
        let key = try bits.withBytes { b -> SecureKey in
            let k = UnsafeRawBufferPointer(rebasing: b[0..<32])
            let c = check(k)
            guard c.0 == b[32], c.1 == b[33] else {
                throw KeybagError.invalid("not a recovery key: its check does not match (a character is mistyped)")
            }
            return SecureKey(count: 32) { $0.copyMemory(from: k) }
        }
        return RecoveryKey(secret: key)
    }

    /// The key that wraps the escrow slots of store `storeID`.
    func wrapKey(storeID: String) throws -> SecureKey {
        try secret.withBytes { k in
            KeyWrap.keyedHash(key: k, parts: [Array("keybagfs-recovery-kek-v1".utf8), Array(storeID.utf8)])
        }
    }

    /// Zeroes the secret.
    public func wipe() { secret.wipe() }
}
