import CCrypto
import CSodium
import Glibc
import Synchronization

/// The AEAD that encrypts a file's contents, named in each file header. The keybag names
/// the cipher of new files; a store's files may mix ciphers of one nonce size (one layout).
public enum ContentCipher: UInt8, Sendable, CaseIterable {
    /// AES-256-GCM (OpenSSL): 12-byte random nonce per block, so at most 2^32 block writes
    /// per file key (NIST SP 800-38D). Stores made with it keep it; new stores never get it.
    case aes256gcm = 1
    /// XChaCha20-Poly1305-IETF (libsodium): 24-byte random nonce per block; the portable cipher.
    case xchacha20poly1305 = 2
    /// XAES-256-GCM (c2sp.org/XAES-256-GCM, on OpenSSL): 24-byte random nonce per block, a
    /// per-block AES-256-GCM key derived with AES-CMAC from the nonce's first half.
    case xaes256gcm = 3

    /// The cipher of new stores: XAES-256-GCM where the CPU has AES instructions,
    /// XChaCha20-Poly1305 elsewhere. Both take 192-bit random nonces (no practical limit on
    /// block writes per file key) and share one block layout.
    public static var `default`: ContentCipher { HardwareAES.isAvailable ? .xaes256gcm : .xchacha20poly1305 }

    /// Whether this machine can use the cipher at a useful speed.
    public var isAvailable: Bool { self == .xchacha20poly1305 || HardwareAES.isAvailable }

    /// Nonce length in bytes.
    public var nonceSize: Int { self == .aes256gcm ? 12 : 24 }

    /// Whether files of `other` can live in a store of this cipher: the same block layout.
    public func sharesLayout(with other: ContentCipher) -> Bool { nonceSize == other.nonceSize }

    /// The name stored in the keybag.
    public var name: String {
        switch self {
        case .aes256gcm: return "aes256gcm"
        case .xchacha20poly1305: return "xchacha20poly1305"
        case .xaes256gcm: return "xaes256gcm"
        }
    }

    /// Parses a keybag name.
    public init?(name: String) {
        guard let c = ContentCipher.allCases.first(where: { $0.name == name }) else { return nil }
        self = c
    }
}

/// Offset arithmetic of the content format: a fixed header, then blocks of
/// `nonce || ciphertext || tag`, each holding up to `plainBlockSize` plaintext bytes.
public struct BlockLayout: Sendable, Equatable {
    /// Plaintext bytes per block.
    public static let plainBlockSize = 4096
    /// Poly1305 / GCM tag length.
    public static let tagSize = 16

    /// The store's content cipher.
    public let cipher: ContentCipher
    /// Bytes of per-block overhead (nonce + tag).
    public let overhead: Int
    /// Bytes of one full ciphertext block.
    public let cipherBlockSize: Int

    /// Layout for a cipher.
    public init(cipher: ContentCipher) {
        self.cipher = cipher
        self.overhead = cipher.nonceSize + BlockLayout.tagSize
        self.cipherBlockSize = BlockLayout.plainBlockSize + overhead
    }

    /// Offset in the backing file where block `n` starts.
    public func cipherOffset(ofBlock n: Int) -> Int { FileHeader.size + n * cipherBlockSize }

    /// Plaintext size for a backing file size, computed without decrypting. A trailing
    /// fragment too short to hold a block's overhead is ignored (it cannot authenticate).
    public func plainSize(backingSize: Int) -> Int {
        guard backingSize > FileHeader.size else { return 0 }
        let n = backingSize - FileHeader.size
        let full = n / cipherBlockSize
        let rest = n % cipherBlockSize
        return full * BlockLayout.plainBlockSize + (rest > overhead ? rest - overhead : 0)
    }

    /// Backing file size that holds `plainSize` plaintext bytes.
    public func backingSize(plainSize: Int) -> Int {
        let full = plainSize / BlockLayout.plainBlockSize
        let rest = plainSize % BlockLayout.plainBlockSize
        return FileHeader.size + full * cipherBlockSize + (rest > 0 ? rest + overhead : 0)
    }
}

/// A file's content key in guarded memory (with XAES-256-GCM's CMAC subkey). Encrypts and
/// authenticates one block at a time with the file id and block number as associated
/// data. Wiping it makes every later use throw `keyUnavailable`.
public final class FileContentKey: Sendable {
    /// The raw 32-byte file key (needed to rewrap it on a class change).
    public let key: SecureKey
    /// XAES-256-GCM's subkey K1 (16 bytes), present for that cipher.
    private let subkey: SecureKey?
    /// The file's cipher.
    public let cipher: ContentCipher
    /// The file's 16-byte id, bound into every block.
    public let fileID: [UInt8]
    /// The file id as two words, for building associated data without allocating.
    private let idWords: (UInt64, UInt64)

    /// Whether the last block is sealed as the last (header flag `sealsEnd`).
    public let sealsEnd: Bool
    /// Bit set in the associated data's block number of a file's last block.
    static let lastBlockBit: UInt64 = 1 << 63

    /// The key of the file described by `header`.
    public convenience init(key: SecureKey, header: FileHeader) throws {
        try self.init(key: key, cipher: header.cipher, fileID: header.fileID, sealsEnd: header.endIsSealed)
    }

    /// Wraps a raw key; derives XAES-256-GCM's subkey when needed.
    public init(key: SecureKey, cipher: ContentCipher, fileID: [UInt8], sealsEnd: Bool) throws {
        self.key = key
        self.cipher = cipher
        self.fileID = fileID
        self.sealsEnd = sealsEnd
        precondition(fileID.count == 16)
        self.idWords = fileID.withUnsafeBytes {
            ($0.loadUnaligned(fromByteOffset: 0, as: UInt64.self), $0.loadUnaligned(fromByteOffset: 8, as: UInt64.self))
        }
        if cipher == .xaes256gcm {
            defer { kbfs_scrub_stack() }
            let k1 = SecureKey(zeroed: 16)
            let rc = try key.withBytes { k in
                try k1.withBytes { s in
                    kbfs_xaes_subkey(
                        k.baseAddress!.assumingMemoryBound(to: UInt8.self),
                        UnsafeMutablePointer(mutating: s.baseAddress!.assumingMemoryBound(to: UInt8.self)))
                }
            }
            guard rc == 0 else { k1.wipe(); throw KeybagError.corrupt("the AES library failed to derive a subkey") }
            self.subkey = k1
        } else {
            self.subkey = nil
        }
    }

    /// Zeroes the key and its subkey.
    public func wipe() {
        key.wipe()
        subkey?.wipe()
    }

    /// True once wiped.
    public var isWiped: Bool { key.isWiped }

    /// Associated data: file id (16) || block number (8, little endian), the top bit set
    /// for the file's last block when the end is sealed.
    @inline(__always)
    private func withAD<R>(_ block: UInt64, last: Bool, _ body: (UnsafePointer<UInt8>) throws -> R) rethrows -> R {
        let n = sealsEnd && last ? block | Self.lastBlockBit : block
        var ad = (idWords.0, idWords.1, n.littleEndian)
        return try withUnsafeBytes(of: &ad) { try body($0.baseAddress!.assumingMemoryBound(to: UInt8.self)) }
    }

    /// Encrypts `plain` (1...4096 bytes) as block `block` (`last`: the file's last block)
    /// into `out`, which must hold `plain.count + overhead` bytes: nonce || ciphertext || tag.
    public func seal(
        _ plain: UnsafeRawBufferPointer, block: UInt64, last: Bool, into out: UnsafeMutableRawBufferPointer
    ) throws {
        let ns = cipher.nonceSize
        precondition(out.count >= plain.count + ns + BlockLayout.tagSize)
        let o = out.baseAddress!.assumingMemoryBound(to: UInt8.self)
        NonceStream.fill(o, count: ns)
        let m = plain.baseAddress?.assumingMemoryBound(to: UInt8.self)
        let rc: Int32 = try withAD(block, last: last) { ad in
            try key.withBytes { kb in
                let k = kb.baseAddress!.assumingMemoryBound(to: UInt8.self)
                let c = o + ns, tag = o + ns + plain.count
                switch cipher {
                case .xchacha20poly1305:
                    var clen: UInt64 = 0
                    return crypto_aead_xchacha20poly1305_ietf_encrypt(
                        c, &clen, m, UInt64(plain.count), ad, 24, nil, o, k)
                case .aes256gcm:
                    return kbfs_aes256gcm_seal(k, o, ad, 24, m, plain.count, c, tag)
                case .xaes256gcm:
                    return try subkey!.withBytes { k1 in
                        kbfs_xaes256gcm_seal(
                            k, k1.baseAddress!.assumingMemoryBound(to: UInt8.self), o, ad, 24, m, plain.count, c, tag)
                    }
                }
            }
        }
        guard rc == 0 else { throw KeybagError.corrupt("encryption failed") }
    }

    /// Decrypts block `block` (`last`: the file's last block) from `sealed` (nonce ||
    /// ciphertext || tag) into `out`, returning the plaintext length. With a sealed end the
    /// last block must carry the end mark; a block inside the file may carry either (one
    /// that was the end before the file grew keeps its mark: one per growing write).
    /// `markedRun` counts the marked blocks just before this one in the same read: after two
    /// in a row (a file grown by block-sized appends) the mark is tried first, else the
    /// unmarked form, so a lone mark after a large append costs one extra tag check. An
    /// all-zero block inside the file is a hole and reads as zeros; the end is never a hole.
    public func open(
        _ sealed: UnsafeRawBufferPointer, block: UInt64, last: Bool, markedRun: inout Int,
        into out: UnsafeMutableRawBufferPointer
    ) throws -> Int {
        let ns = cipher.nonceSize
        guard sealed.count > ns + BlockLayout.tagSize else { throw KeybagError.corrupt("block \(block) truncated") }
        let plainLen = sealed.count - ns - BlockLayout.tagSize
        precondition(out.count >= plainLen)
        if sealsEnd && !last {
            let first = markedRun >= 2
            if try decrypt(sealed, block: block, last: first, into: out) {
                markedRun = first ? markedRun + 1 : 0; return plainLen
            }
            if try decrypt(sealed, block: block, last: !first, into: out) {
                markedRun = first ? 0 : markedRun + 1; return plainLen
            }
        } else if try decrypt(sealed, block: block, last: last, into: out) {
            return plainLen
        }
        // Not authentic: a hole (all zero bytes, never produced by sealing) or a write into one
        // cut off by a power cut (a zero sector left: its old version, zeros), a cut end, or damage.
        if !(sealsEnd && last) && FileContentKey.isHoleOrTornFill(sealed, block: block, nonceSize: ns) {
            if try holdsShorterVersion(sealed, block: block, into: out) {
                sodium_memzero(out.baseAddress!, plainLen)
                throw KeybagError.corrupt(
                    "block \(block) holds an older, shorter version and zeros: its new one is not in place")
            }
            memset(out.baseAddress!, 0, plainLen)
            return plainLen
        }
        if sealsEnd && last, try decrypt(sealed, block: block, last: false, into: out) {
            sodium_memzero(out.baseAddress!, plainLen)
            throw KeybagError.corrupt("block \(block) is not the file's end: blocks after it were cut off")
        }
        throw KeybagError.corrupt("block \(block) failed authentication")
    }

    /// Decrypts one block (see the other `open`), trying the unmarked form first.
    public func open(
        _ sealed: UnsafeRawBufferPointer, block: UInt64, last: Bool, into out: UnsafeMutableRawBufferPointer
    ) throws -> Int {
        var markedRun = 0
        return try open(sealed, block: block, last: last, markedRun: &markedRun, into: out)
    }

    /// What one sealed block is, for `fsck`.
    public enum BlockCheck: Sendable, Equatable {
        /// Authenticates where it stands.
        case authentic
        /// All zero bytes inside the file: a sparse hole.
        case hole
        /// The last block, authentic but not sealed as the end: the file was cut after it
        /// (offline, or a truncate cut off between its steps).
        case wrongEnd
        /// Does not authenticate at all.
        case damaged
    }

    /// Classifies a sealed block; `scratch` (≥ the plaintext length) is zeroed afterwards.
    public func check(
        _ sealed: UnsafeRawBufferPointer, block: UInt64, last: Bool, scratch: UnsafeMutableRawBufferPointer
    ) -> BlockCheck {
        guard sealed.count > cipher.nonceSize + BlockLayout.tagSize else { return .damaged }
        defer { sodium_memzero(scratch.baseAddress!, scratch.count) }
        if (try? decrypt(sealed, block: block, last: last, into: scratch)) == true { return .authentic }
        if sealsEnd && !last && (try? decrypt(sealed, block: block, last: true, into: scratch)) == true {
            return .authentic
        }
        if !(sealsEnd && last) && FileContentKey.isHoleOrTornFill(sealed, block: block, nonceSize: cipher.nonceSize) {
            return (try? holdsShorterVersion(sealed, block: block, into: scratch)) == false ? .hole : .damaged
        }
        if sealsEnd && last && (try? decrypt(sealed, block: block, last: false, into: scratch)) == true {
            return .wrongEnd
        }
        return .damaged
    }

    /// One AEAD decryption; false when the tag does not verify.
    private func decrypt(
        _ sealed: UnsafeRawBufferPointer, block: UInt64, last: Bool, into out: UnsafeMutableRawBufferPointer
    ) throws -> Bool {
        let ns = cipher.nonceSize
        let s0 = sealed.baseAddress!.assumingMemoryBound(to: UInt8.self)
        let o = out.baseAddress!.assumingMemoryBound(to: UInt8.self)
        let clen = sealed.count - ns - BlockLayout.tagSize
        let rc: Int32 = try withAD(block, last: last) { ad in
            try key.withBytes { kb in
                let k = kb.baseAddress!.assumingMemoryBound(to: UInt8.self)
                switch cipher {
                case .xchacha20poly1305:
                    var mlen: UInt64 = 0
                    return crypto_aead_xchacha20poly1305_ietf_decrypt(
                        o, &mlen, nil, s0 + ns, UInt64(sealed.count - ns), ad, 24, s0, k)
                case .aes256gcm:
                    return kbfs_aes256gcm_open(k, s0, ad, 24, s0 + ns, clen, s0 + ns + clen, o)
                case .xaes256gcm:
                    return try subkey!.withBytes { k1 in
                        kbfs_xaes256gcm_open(
                            k, k1.baseAddress!.assumingMemoryBound(to: UInt8.self), s0, ad, 24, s0 + ns, clen,
                            s0 + ns + clen, o)
                    }
                }
            }
        }
        if rc < -1 { throw KeybagError.corrupt("the AES library failed") }
        return rc == 0
    }

    /// True for a hole (every byte zero) and for a write into zeros that a power cut tore: the
    /// block's piece of some 512-byte sector of the store (`tornPieceMinimum` bytes or more:
    /// edge pieces count, so a page's few bytes left unwritten at a block's edge do too) is all
    /// zero, which sealed bytes are with a chance of 2^-64 at most. Its old version was zeros,
    /// so it reads as zeros (docs/FORMAT.md, "Overwrites"), unless `holdsShorterVersion`.
    static func isHoleOrTornFill(_ b: UnsafeRawBufferPointer, block: UInt64, nonceSize: Int) -> Bool {
        if isAllZero(b) { return true }
        let start = FileHeader.size + Int(block) * (BlockLayout.plainBlockSize + nonceSize + BlockLayout.tagSize)
        var at = 0
        while at < b.count {
            let end = min(b.count, at + 512 - (start + at) % 512)
            if end - at >= tornPieceMinimum && isAllZero(UnsafeRawBufferPointer(rebasing: b[at..<end])) { return true }
            at = end
        }
        return false
    }

    /// The shortest zero piece of a sector taken for a torn fill: 8 bytes (blocks start 8-byte
    /// aligned with the 24-byte nonces, so every edge piece of a whole block is 8 bytes or more).
    static let tornPieceMinimum = 8

    /// Whether the block's bytes before its trailing zeros open as a shorter block at this
    /// place: the old partial last block of a file that grew, whose new version has not gone
    /// in place (the store's copy while it is pending, or after a cut); that is not a torn
    /// fill, and reads `EIO`, never zeros. Tries the lengths that leave up to three of the
    /// old tag's last bytes zero.
    func holdsShorterVersion(_ sealed: UnsafeRawBufferPointer, block: UInt64, into out: UnsafeMutableRawBufferPointer)
        throws -> Bool
    {
        var end = sealed.count
        while end > 0 && sealed[end - 1] == 0 { end -= 1 }
        let minimum = cipher.nonceSize + BlockLayout.tagSize + 1
        guard end > 0, end < sealed.count else { return false }  // a hole, or no zeros at the end
        for length in max(end, minimum)..<min(sealed.count, max(end, minimum) + 4) {
            let prefix = UnsafeRawBufferPointer(rebasing: sealed[0..<length])
            if try decrypt(prefix, block: block, last: true, into: out) { return true }
            if try decrypt(prefix, block: block, last: false, into: out) { return true }
        }
        return false
    }

    /// True when every byte is zero (a sparse hole in the backing file).
    static func isAllZero(_ b: UnsafeRawBufferPointer) -> Bool {
        guard let base = b.baseAddress else { return true }
        return sodium_is_zero(base.assumingMemoryBound(to: UInt8.self), b.count) == 1
    }
}
