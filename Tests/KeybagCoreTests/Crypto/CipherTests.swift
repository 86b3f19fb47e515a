import CCrypto
import CSodium
import CTestSupport
import XCTest

@testable import KeybagCore

/// The content ciphers on hardware AES: published vectors, agreement with libsodium for the
/// stores it wrote, and the pool of key schedules.
final class CipherTests: XCTestCase {
    func hex(_ s: String) -> [UInt8] {
        var out: [UInt8] = []
        var i = s.startIndex
        while i < s.endIndex { let j = s.index(i, offsetBy: 2); out.append(UInt8(s[i..<j], radix: 16)!); i = j }
        return out
    }

    override func setUp() {
        XCTAssertTrue(HardwareAES.start(), "OpenSSL's AES-256-GCM and AES-256-ECB")
    }

    /// c2sp.org/XAES-256-GCM's two test vectors, sealed and opened.
    func testXAES256GCMVectorsFromTheSpecification() throws {
        let cases: [(key: UInt8, aad: String, sealed: String)] = [
            (0x01, "", "ce546ef63c9cc60765923609b33a9a1974e96e52daf2fcf7075e2271"),
            (0x03, "c2sp.org/XAES-256-GCM", "986ec1832593df5443a179437fd083bf3fdb41abd740a21f71eb769d"),
        ]
        let plain = Array("XAES-256-GCM".utf8)
        for c in cases {
            kbfs_crypto_forget()  // no batch going on: the seal takes the nonce given
            var nonce = Array("ABCDEFGHIJKLMNOPQRSTUVWX".utf8)
            let key = [UInt8](repeating: c.key, count: 32), ad = Array(c.aad.utf8)
            var k1 = [UInt8](repeating: 0, count: 16)
            XCTAssertEqual(kbfs_xaes_subkey(key, &k1), 0)
            var ct = [UInt8](repeating: 0, count: plain.count), tag = [UInt8](repeating: 0, count: 16)
            XCTAssertEqual(kbfs_xaes256gcm_seal(key, k1, &nonce, ad, ad.count, plain, plain.count, &ct, &tag), 0)
            XCTAssertEqual(nonce, Array("ABCDEFGHIJKLMNOPQRSTUVWX".utf8))
            XCTAssertEqual(ct + tag, hex(c.sealed), "key \(c.key)")
            var back = [UInt8](repeating: 0, count: plain.count)
            XCTAssertEqual(kbfs_xaes256gcm_open(key, k1, nonce, ad, ad.count, ct, ct.count, tag, &back), 0)
            XCTAssertEqual(back, plain)
            var bad = tag; bad[15] ^= 1
            XCTAssertEqual(kbfs_xaes256gcm_open(key, k1, nonce, ad, ad.count, ct, ct.count, bad, &back), -1)
            XCTAssertEqual(back, [UInt8](repeating: 0, count: plain.count), "a failed open leaves no plaintext")
        }
    }

    /// XAES' derived key by hand from single AES blocks: AES_K(M1 ^ K1) || AES_K(M2 ^ K1).
    private func derivedKey(_ key: [UInt8], k1: [UInt8], prefix: ArraySlice<UInt8>) -> [UInt8] {
        [UInt8(1), 2].flatMap { i in
            let m = zip([0, i, 0x58, 0] + prefix, k1).map { $0 ^ $1 }
            var out = [UInt8](repeating: 0, count: 16)
            XCTAssertEqual(kbfs_test_aes256_block(key, m, &out), 0)
            return out
        }
    }

    /// GCM specification test case 16 (AES-256, 96-bit IV, AAD): AES-256-GCM itself.
    func testAES256GCMVector() throws {
        let key = hex("feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308"),
            iv = hex("cafebabefacedbaddecaf888")
        let p = hex(
            "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b39"
        )
        let ad = hex("feedfacedeadbeeffeedfacedeadbeefabaddad2")
        var ct = [UInt8](repeating: 0, count: p.count), tag = [UInt8](repeating: 0, count: 16)
        XCTAssertEqual(kbfs_aes256gcm_seal(key, iv, ad, ad.count, p, p.count, &ct, &tag), 0)
        XCTAssertEqual(
            ct,
            hex(
                "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662"
            ))
        XCTAssertEqual(tag, hex("76fc6ece0f4e1768cddf8853bb2d551b"))
    }

    /// The derivation by hand from single AES blocks (another OpenSSL API): K1 = dbl(AES_K(0)),
    /// the derived key AES_K(M1 ^ K1) || AES_K(M2 ^ K1) seals like AES-256-GCM under it.
    func testXAESIsAESGCMUnderTheCMACDerivedKey() throws {
        var rng = SystemRandomNumberGenerator()
        for _ in 0..<50 {
            let key = (0..<32).map { _ in UInt8.random(in: 0...255, using: &rng) }
            var nonce = (0..<24).map { _ in UInt8.random(in: 0...255, using: &rng) }
            let plain = (0..<Int.random(in: 1...4096, using: &rng)).map { _ in UInt8.random(in: 0...255, using: &rng) }
            var l = [UInt8](repeating: 0, count: 16)
            XCTAssertEqual(kbfs_test_aes256_block(key, [UInt8](repeating: 0, count: 16), &l), 0)
            var k1 = (0..<16).map { i in UInt8(truncatingIfNeeded: (l[i] << 1) | (i < 15 ? l[i + 1] >> 7 : 0)) }
            if l[0] & 0x80 != 0 { k1[15] ^= 0x87 }
            var ours = [UInt8](repeating: 0, count: 16)
            XCTAssertEqual(kbfs_xaes_subkey(key, &ours), 0)
            XCTAssertEqual(ours, k1)
            let kx = derivedKey(key, k1: k1, prefix: nonce[0..<12])
            var a = [UInt8](repeating: 0, count: plain.count), ta = [UInt8](repeating: 0, count: 16)
            var b = a, tb = ta
            XCTAssertEqual(kbfs_xaes256gcm_seal(key, k1, &nonce, nil, 0, plain, plain.count, &a, &ta), 0)
            XCTAssertEqual(kbfs_aes256gcm_seal(kx, Array(nonce[12..<24]), nil, 0, plain, plain.count, &b, &tb), 0)
            XCTAssertEqual(a + ta, b + tb)
        }
    }

    /// Stores sealed by libsodium's AES-256-GCM (before keybagfs used OpenSSL) open, and
    /// the other way round.
    func testAES256GCMAgreesWithLibsodiumBothWays() throws {
        Sodium.ensureInitialized()
        guard crypto_aead_aes256gcm_is_available() == 1 else { return XCTFail("this CPU has no AES-NI") }
        for n in [1, 15, 16, 17, 4095, 4096] {
            let key = Sodium.randomArray(32), nonce = Sodium.randomArray(12), ad = Sodium.randomArray(24),
                plain = Sodium.randomArray(n)
            var sodium = [UInt8](repeating: 0, count: n + 16)
            var clen: UInt64 = 0
            XCTAssertEqual(crypto_aead_aes256gcm_encrypt(&sodium, &clen, plain, UInt64(n), ad, 24, nil, nonce, key), 0)
            var back = [UInt8](repeating: 0, count: n)
            XCTAssertEqual(kbfs_aes256gcm_open(key, nonce, ad, 24, sodium, n, Array(sodium[n...]), &back), 0)
            XCTAssertEqual(back, plain)
            var ct = [UInt8](repeating: 0, count: n), tag = [UInt8](repeating: 0, count: 16)
            XCTAssertEqual(kbfs_aes256gcm_seal(key, nonce, ad, 24, plain, n, &ct, &tag), 0)
            XCTAssertEqual(ct + tag, sodium)
        }
    }

    /// Forgetting frees every idle context (and with it every cached key schedule).
    func testForgettingFreesIdleContexts() throws {
        let key = try FileContentKey(
            key: SecureKey(random: 32), cipher: .xaes256gcm, fileID: Sodium.randomArray(16), sealsEnd: true)
        var sealed = [UInt8](repeating: 0, count: 4096 + 40)
        let plain = [UInt8](repeating: 7, count: 4096)
        try plain.withUnsafeBytes { p in
            try sealed.withUnsafeMutableBytes { try key.seal(p, block: 0, last: true, into: $0) }
        }
        XCTAssertGreaterThan(HardwareAES.contexts, 0)
        HardwareAES.forgetKeySchedules()
        XCTAssertEqual(HardwareAES.contexts, 0)
        var out = [UInt8](repeating: 0, count: 4096)
        XCTAssertEqual(
            try sealed.withUnsafeBytes { s in
                try out.withUnsafeMutableBytes { try key.open(s, block: 0, last: true, into: $0) }
            }, 4096)
        XCTAssertEqual(out, plain, "a new context after forgetting")
    }

    /// Seals `n` blocks of `size` bytes under `key` (block numbers 0..<n); returns them sealed.
    private func sealBlocks(_ key: FileContentKey, _ n: Int, size: Int = 64) throws -> [[UInt8]] {
        try (0..<n).map { b in
            let plain = [UInt8](repeating: UInt8(truncatingIfNeeded: b), count: size)
            var sealed = [UInt8](repeating: 0, count: size + 40)
            try plain.withUnsafeBytes { p in
                try sealed.withUnsafeMutableBytes { try key.seal(p, block: UInt64(b), last: false, into: $0) }
            }
            return sealed
        }
    }

    /// The blocks one context seals under one file key share a nonce prefix (so the derived
    /// key is made once per run) and never a whole nonce: the suffix counts up from a random
    /// start. Every block is standard XAES-256-GCM: it opens with the derivation done by hand.
    func testBlocksOfOneKeyShareAPrefixButNeverANonce() throws {
        kbfs_crypto_forget()
        let raw = Sodium.randomArray(32)
        let key = try FileContentKey(
            key: SecureKey(count: 32) { $0.copyBytes(from: raw) }, cipher: .xaes256gcm, fileID: Sodium.randomArray(16),
            sealsEnd: true)
        let sealed = try sealBlocks(key, 300)
        let nonces = sealed.map { Array($0[0..<24]) }
        XCTAssertEqual(Set(nonces.map { $0 }).count, 300, "no nonce twice")
        XCTAssertEqual(Set(nonces.map { Array($0[0..<12]) }).count, 1, "one prefix for the run")
        let first = nonces[0][20..<24].reduce(0) { $0 << 8 | UInt32($1) }
        for (i, n) in nonces.enumerated() {
            XCTAssertEqual(n[12..<20], nonces[0][12..<20])
            XCTAssertEqual(n[20..<24].reduce(0) { $0 << 8 | UInt32($1) }, first &+ UInt32(i))
        }
        var k1 = [UInt8](repeating: 0, count: 16)
        XCTAssertEqual(kbfs_xaes_subkey(raw, &k1), 0)
        for (b, s) in sealed.enumerated() {
            let kx = derivedKey(raw, k1: k1, prefix: s[0..<12])
            var back = [UInt8](repeating: 0, count: 64)
            let ad = key.fileID + withUnsafeBytes(of: UInt64(b).littleEndian) { Array($0) }
            XCTAssertEqual(
                kbfs_aes256gcm_open(kx, Array(s[12..<24]), ad, 24, Array(s[24..<88]), 64, Array(s[88...]), &back), 0)
            XCTAssertEqual(back, [UInt8](repeating: UInt8(truncatingIfNeeded: b), count: 64))
        }
    }

    /// A batch ends after its size in blocks, when another key is sealed on the context, and
    /// when the contexts are forgotten; blocks of every batch, opened in any order, verify.
    func testABatchEndsWithItsSizeAnotherKeyOrAForget() throws {
        kbfs_crypto_forget()
        kbfs_test_set_xaes_batch(3)
        defer { kbfs_test_set_xaes_batch(0) }
        func key() throws -> FileContentKey {
            try FileContentKey(
                key: SecureKey(random: 32), cipher: .xaes256gcm, fileID: Sodium.randomArray(16), sealsEnd: true)
        }
        let a = try key(), b = try key()
        let prefixes = { (s: [[UInt8]]) in s.map { Array($0[0..<12]) } }
        let a1 = try sealBlocks(a, 7)
        let p = prefixes(a1)
        XCTAssertEqual(p[0], p[2]); XCTAssertNotEqual(p[2], p[3]); XCTAssertEqual(p[3], p[5]);
        XCTAssertNotEqual(p[5], p[6])
        let b1 = try sealBlocks(b, 2)
        let a2 = try sealBlocks(a, 2)
        XCTAssertNotEqual(prefixes(a2)[0], p[6], "another key in between starts a new batch")
        HardwareAES.forgetKeySchedules()
        let a3 = try sealBlocks(a, 1)
        XCTAssertNotEqual(prefixes(a3)[0], prefixes(a2)[1], "a forget starts a new batch")
        XCTAssertEqual(Set((a1 + a2 + a3).map { Array($0[0..<24]) }).count, 10)
        // Interleaved opens: every block under its own key, whatever the context last held.
        let all =
            a1.enumerated().map { (a, $0.offset, $0.element) } + b1.enumerated().map { (b, $0.offset, $0.element) }
            + a2.enumerated().map { (a, $0.offset, $0.element) }
        for (k, blk, s) in all.shuffled() + all.reversed() {
            var out = [UInt8](repeating: 0, count: 64)
            var run = 0
            let n = try s.withUnsafeBytes { sb in
                try out.withUnsafeMutableBytes {
                    try k.open(sb, block: UInt64(blk), last: false, markedRun: &run, into: $0)
                }
            }
            XCTAssertEqual(n, 64)
            XCTAssertEqual(out, [UInt8](repeating: UInt8(truncatingIfNeeded: blk), count: 64))
            var bad = s; bad[30] ^= 1
            XCTAssertThrowsError(
                try bad.withUnsafeBytes { sb in
                    try out.withUnsafeMutableBytes {
                        try k.open(sb, block: UInt64(blk), last: false, markedRun: &run, into: $0)
                    }
                })
        }
    }

    /// The derived key a context keeps is tagged with the subkey too: an open with a wrong
    /// subkey (which fails) does not leave a key behind that fails the next block of the batch
    /// with the right one, nor lets a wrong subkey open a block after a right one.
    func testTheKeptDerivedKeyBelongsToItsSubkey() throws {
        kbfs_crypto_forget()
        let key = Sodium.randomArray(32), plain = [UInt8](repeating: 5, count: 100)
        var k1 = [UInt8](repeating: 0, count: 16)
        XCTAssertEqual(kbfs_xaes_subkey(key, &k1), 0)
        var wrong = k1; wrong[0] ^= 1
        var blocks: [(nonce: [UInt8], ct: [UInt8], tag: [UInt8])] = []
        for _ in 0..<3 {
            var nonce = Sodium.randomArray(24), ct = [UInt8](repeating: 0, count: 100),
                tag = [UInt8](repeating: 0, count: 16)
            XCTAssertEqual(kbfs_xaes256gcm_seal(key, k1, &nonce, nil, 0, plain, 100, &ct, &tag), 0)
            blocks.append((nonce, ct, tag))
        }
        XCTAssertEqual(blocks[0].nonce[0..<12], blocks[2].nonce[0..<12], "one batch")
        var back = [UInt8](repeating: 0, count: 100)
        let b = blocks
        XCTAssertEqual(kbfs_xaes256gcm_open(key, wrong, b[0].nonce, nil, 0, b[0].ct, 100, b[0].tag, &back), -1)
        XCTAssertEqual(kbfs_xaes256gcm_open(key, k1, b[1].nonce, nil, 0, b[1].ct, 100, b[1].tag, &back), 0)
        XCTAssertEqual(back, plain)
        XCTAssertEqual(kbfs_xaes256gcm_open(key, wrong, b[2].nonce, nil, 0, b[2].ct, 100, b[2].tag, &back), -1)
        // A seal after an open of the batch's block (the context keyed for decryption) goes on
        // with the batch and is still XAES under the right key.
        XCTAssertEqual(kbfs_xaes256gcm_open(key, k1, b[2].nonce, nil, 0, b[2].ct, 100, b[2].tag, &back), 0)
        var nonce = Sodium.randomArray(24), ct = [UInt8](repeating: 0, count: 100),
            tag = [UInt8](repeating: 0, count: 16)
        XCTAssertEqual(kbfs_xaes256gcm_seal(key, k1, &nonce, nil, 0, plain, 100, &ct, &tag), 0)
        XCTAssertEqual(nonce[0..<12], b[0].nonce[0..<12], "the batch goes on")
        let kx = derivedKey(key, k1: k1, prefix: nonce[0..<12])
        XCTAssertEqual(kbfs_aes256gcm_open(kx, Array(nonce[12..<24]), nil, 0, ct, 100, tag, &back), 0)
        XCTAssertEqual(back, plain)
    }

    /// XAES-256-GCM and XChaCha20-Poly1305 share a layout (and can share a store); AES-256-GCM does not.
    func testWhichCiphersShareAStore() {
        XCTAssertTrue(ContentCipher.xaes256gcm.sharesLayout(with: .xchacha20poly1305))
        XCTAssertFalse(ContentCipher.aes256gcm.sharesLayout(with: .xaes256gcm))
        XCTAssertEqual(
            BlockLayout(cipher: .xaes256gcm).cipherBlockSize, BlockLayout(cipher: .xchacha20poly1305).cipherBlockSize)
        XCTAssertEqual(ContentCipher.default, kbfs_cpu_has_aes() == 1 ? .xaes256gcm : .xchacha20poly1305)
    }
}
