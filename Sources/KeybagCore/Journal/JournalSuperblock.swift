import CSodium
import Glibc

/// The first 512-byte sector of a journal file: the ring's size, where its oldest live record
/// starts and which sequence number it has, and the checksum key of its records.
public struct JournalSuperblock: Sendable, Equatable {
    public static let magic: [UInt8] = Array("KBJS".utf8)
    public static let version: UInt32 = 1
    /// The ring starts after one page (the superblock's).
    public static let ringStart = 4096
    static let encodedSize = 80

    public var ringSize: Int
    public var tailPos: Int
    public var tailSeq: UInt64
    public var key: [UInt8]

    /// A new superblock: an empty ring of `ringSize` bytes, a fresh key.
    public static func fresh(ringSize: Int, firstSeq: UInt64 = 1) -> JournalSuperblock {
        JournalSuperblock(ringSize: ringSize, tailPos: 0, tailSeq: firstSeq, key: Sodium.randomArray(32))
    }

    /// The 512-byte sector.
    public func encoded() -> [UInt8] {
        var b = [UInt8](repeating: 0, count: 512)
        b.withUnsafeMutableBytes { out in
            out.copyBytes(from: Self.magic)
            out.storeBytes(of: Self.version.littleEndian, toByteOffset: 4, as: UInt32.self)
            out.storeBytes(of: UInt64(ringSize).littleEndian, toByteOffset: 8, as: UInt64.self)
            out.storeBytes(of: UInt64(tailPos).littleEndian, toByteOffset: 16, as: UInt64.self)
            out.storeBytes(of: tailSeq.littleEndian, toByteOffset: 24, as: UInt64.self)
            UnsafeMutableRawBufferPointer(rebasing: out[32..<64]).copyBytes(from: key)
        }
        let sum = Self.checksum(b[0..<64])
        b.replaceSubrange(64..<80, with: sum)
        return b
    }

    /// Parses a sector: nil when it is not a whole superblock of this version.
    public static func decode(_ b: [UInt8]) -> JournalSuperblock? {
        guard b.count >= encodedSize, Array(b[0..<4]) == magic, Array(b[64..<80]) == checksum(b[0..<64]) else {
            return nil
        }
        return b.withUnsafeBytes { p in
            guard UInt32(littleEndian: p.loadUnaligned(fromByteOffset: 4, as: UInt32.self)) == version else {
                return nil
            }
            let ring64 = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 8, as: UInt64.self))
            let tail64 = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 16, as: UInt64.self))
            let seq = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 24, as: UInt64.self))
            guard ring64 > 0, ring64 <= 1 << 32, ring64 % 4096 == 0, tail64 < ring64, seq > 0, seq < 1 << 62 else {
                return nil
            }
            let ring = Int(ring64), tail = Int(tail64)
            return JournalSuperblock(
                ringSize: ring, tailPos: tail,
                tailSeq: seq,
                key: Array(b[32..<64]))
        }
    }

    /// Unkeyed BLAKE2b-128 of the fields (it detects damage, nothing more).
    static func checksum(_ b: ArraySlice<UInt8>) -> [UInt8] {
        var out = [UInt8](repeating: 0, count: 16)
        let msg = Array(b)
        _ = crypto_generichash(&out, 16, msg, UInt64(msg.count), nil, 0)
        return out
    }
}
