import CSodium
import CSystem
import Glibc

/// The first 512-byte sector of a journal file: the ring's size, where its oldest live record
/// starts and which sequence number it has, the checksum key of its records, and which
/// journal file it was written into (a copy of the store has another).
public struct JournalSuperblock: Sendable, Equatable {
    public static let magic: [UInt8] = Array("KBJS".utf8)
    /// The version written; version 1 (records without inode stamps) is still read.
    public static let version: UInt32 = 2
    /// The ring starts after one page (the superblock's).
    public static let ringStart = 4096
    /// The largest ring a reader accepts: 4× the largest written, so a crafted superblock never
    /// makes a replay read or keep more.
    public static let largestRing = 64 << 20

    public var ringSize: Int
    public var tailPos: Int
    public var tailSeq: UInt64
    public var key: [UInt8]
    /// The version the superblock was read as (its records' layout).
    public var version: UInt32 = JournalSuperblock.version
    /// The journal file's own inode number and stamp when written (0: unknown, version 1):
    /// a replay whose journal file still has them runs in the store it was written in.
    public var journalIno: UInt64 = 0
    public var journalStamp: UInt64 = 0

    /// A new superblock: an empty ring of `ringSize` bytes, a fresh key.
    public static func fresh(ringSize: Int, firstSeq: UInt64 = 1) -> JournalSuperblock {
        JournalSuperblock(ringSize: ringSize, tailPos: 0, tailSeq: firstSeq, key: Sodium.randomArray(32))
    }

    /// The same ring from `tailPos`/`tailSeq` on under a fresh key (records written under the
    /// old one, such as those behind a torn record, never read as whole again), for the
    /// journal file `fd`.
    public func rekeyed(tailPos: Int, tailSeq: UInt64, fd: Int32) -> JournalSuperblock {
        var st = stat()
        fstat(fd, &st)
        var sb = JournalSuperblock(
            ringSize: ringSize, tailPos: tailPos % ringSize, tailSeq: tailSeq, key: Sodium.randomArray(32))
        sb.journalIno = UInt64(st.st_ino)
        sb.journalStamp = kbfs_inode_stamp(fd)
        return sb
    }

    /// Whether the journal file `fd` is the one this superblock was written into.
    public func isWritten(in fd: Int32) -> Bool {
        var st = stat()
        guard version >= 2, journalIno != 0, fstat(fd, &st) == 0 else { return false }
        return UInt64(st.st_ino) == journalIno && kbfs_inode_stamp(fd) == journalStamp
    }

    /// The 512-byte sector (always the current version).
    public func encoded() -> [UInt8] {
        var b = [UInt8](repeating: 0, count: 512)
        b.withUnsafeMutableBytes { out in
            out.copyBytes(from: Self.magic)
            out.storeBytes(of: Self.version.littleEndian, toByteOffset: 4, as: UInt32.self)
            out.storeBytes(of: UInt64(ringSize).littleEndian, toByteOffset: 8, as: UInt64.self)
            out.storeBytes(of: UInt64(tailPos).littleEndian, toByteOffset: 16, as: UInt64.self)
            out.storeBytes(of: tailSeq.littleEndian, toByteOffset: 24, as: UInt64.self)
            UnsafeMutableRawBufferPointer(rebasing: out[32..<64]).copyBytes(from: key)
            out.storeBytes(of: journalIno.littleEndian, toByteOffset: 64, as: UInt64.self)
            out.storeBytes(of: journalStamp.littleEndian, toByteOffset: 72, as: UInt64.self)
        }
        b.replaceSubrange(80..<96, with: Self.checksum(b[0..<80]))
        return b
    }

    /// Parses a sector: nil when it is not a whole superblock of a known version within limits.
    public static func decode(_ b: [UInt8]) -> JournalSuperblock? {
        guard b.count >= 96, Array(b[0..<4]) == magic else { return nil }
        let version = b.withUnsafeBytes { UInt32(littleEndian: $0.loadUnaligned(fromByteOffset: 4, as: UInt32.self)) }
        let summed = version == 1 ? 64 : 80
        guard version == 1 || version == 2, Array(b[summed..<(summed + 16)]) == checksum(b[0..<summed]) else {
            return nil
        }
        return b.withUnsafeBytes { p in
            let ring64 = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 8, as: UInt64.self))
            let tail64 = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 16, as: UInt64.self))
            let seq = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 24, as: UInt64.self))
            guard ring64 > 0, ring64 <= UInt64(largestRing), ring64 % 4096 == 0, tail64 < ring64, seq > 0,
                seq < 1 << 62
            else { return nil }
            var sb = JournalSuperblock(
                ringSize: Int(ring64), tailPos: Int(tail64), tailSeq: seq, key: Array(b[32..<64]))
            sb.version = version
            if version >= 2 {
                sb.journalIno = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 64, as: UInt64.self))
                sb.journalStamp = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 72, as: UInt64.self))
            }
            return sb
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
