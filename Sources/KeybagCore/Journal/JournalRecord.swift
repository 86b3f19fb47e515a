import CSodium
import CSystem
import Glibc

/// Which backing file a journal record is about: its inode number and that inode's stamp
/// (generation or birth time: which file the number names), the file id of its header
/// (checked before anything is replayed into it) and its path in the store when written (how
/// a copy of the store, with other inode numbers, finds it).
public struct JournalFileID: Hashable, Sendable {
    public let ino: UInt64
    /// `kbfs_inode_stamp` of the file (0: its file system offers none).
    public let stamp: UInt64
    public let fileID: [UInt8]
    public let path: String

    public init(ino: UInt64, stamp: UInt64 = 0, fileID: [UInt8], path: String) {
        self.ino = ino
        self.stamp = stamp
        self.fileID = fileID
        self.path = path
    }

    /// What tells two files apart in the live journal: an inode number may be reused by a
    /// new file after a delete, with another stamp; a replaced version has another inode.
    public var key: JournalFileKey { JournalFileKey(ino: ino, stamp: stamp, fileID: fileID) }
}

/// A file's key in the live journal's tables: inode number, its stamp and file id.
public struct JournalFileKey: Hashable, Sendable {
    public let ino: UInt64
    public let stamp: UInt64
    public let fileID: [UInt8]

    /// The fields' bytes at once (an array's own hash feeds the hasher byte by byte).
    public func hash(into hasher: inout Hasher) {
        hasher.combine(ino)
        hasher.combine(stamp)
        fileID.withUnsafeBytes { hasher.combine(bytes: $0) }
    }
}

/// One record of the overwrite journal (docs/FORMAT.md, "Overwrites"): sealed bytes to be
/// put at a backing offset of one file, or the end of that file's earlier records.
public struct JournalRecord: Sendable, Equatable {
    /// What a record asks of its file at replay.
    public enum Kind: UInt8, Sendable {
        /// Put `bytes` at `offset` where the file reaches that far.
        case bytes = 1
        /// Put `bytes` at `offset` only where the file ends exactly after them (a shrink's new
        /// last block, written before the cut it belongs to is known durable).
        case exactEnd = 2
        /// The file's earlier records are void (its blocks were made durable in place, then
        /// cut or punched).
        case void = 3
        /// Nothing more at this ring position: the next record starts at the ring's start.
        case wrap = 4
    }

    public static let magic: [UInt8] = Array("KBJR".utf8)
    /// Header bytes before the path (journal version 2; version 1 had 64, without the stamp).
    public static let headerSize = 80
    /// The header size of a journal version's records.
    public static func headerSize(version: UInt32) -> Int { version == 1 ? 64 : headerSize }
    /// The largest record a reader accepts (the writer splits at a quarter of the ring, at
    /// most `largestData` data bytes): a longer one ends the journal, so a crafted length
    /// never makes a reader allocate more.
    public static let largestData = 4 << 20
    public static let largestRecord = largestData + 64 << 10
    /// The checksum at the end of every record.
    public static let tagSize = 16

    public let kind: Kind
    public let seq: UInt64
    public let file: JournalFileID
    public let offset: Int
    public let bytes: [UInt8]

    public init(kind: Kind, seq: UInt64, file: JournalFileID, offset: Int = 0, bytes: [UInt8] = []) {
        self.kind = kind
        self.seq = seq
        self.file = file
        self.offset = offset
        self.bytes = bytes
    }

    /// The encoded length of a record with a path of `pathLength` bytes and `count` data bytes.
    public static func encodedLength(pathLength: Int, count: Int, version: UInt32 = 2) -> Int {
        let body = headerSize(version: version) + pathLength + count
        return (body + 15) / 16 * 16 + tagSize
    }

    /// Writes the record into `out` (at least `encodedLength` bytes) with its checksum under
    /// `key`; the data comes from `data` (the record's own `bytes` are ignored when given).
    public func encode(into out: UnsafeMutableRawBufferPointer, key: [UInt8], data: UnsafeRawBufferPointer? = nil)
        -> Int
    {
        let path = Array(file.path.utf8)
        let count = data?.count ?? bytes.count
        let total = Self.encodedLength(pathLength: path.count, count: count)
        let base = out.baseAddress!
        memset(base, 0, Self.headerSize)  // the data is copied in below, then the padding zeroed
        memset(
            base + Self.headerSize + path.count + count, 0, total - Self.tagSize - Self.headerSize - path.count - count)
        out.copyBytes(from: Self.magic)
        out[4] = kind.rawValue
        out.storeBytes(of: seq.littleEndian, toByteOffset: 8, as: UInt64.self)
        out.storeBytes(of: UInt32(total).littleEndian, toByteOffset: 16, as: UInt32.self)
        out.storeBytes(of: UInt16(path.count).littleEndian, toByteOffset: 20, as: UInt16.self)
        out.storeBytes(of: file.ino.littleEndian, toByteOffset: 24, as: UInt64.self)
        UnsafeMutableRawBufferPointer(rebasing: out[32..<48]).copyBytes(from: file.fileID.prefix(16))
        out.storeBytes(of: UInt64(offset).littleEndian, toByteOffset: 48, as: UInt64.self)
        out.storeBytes(of: UInt64(count).littleEndian, toByteOffset: 56, as: UInt64.self)
        out.storeBytes(of: file.stamp.littleEndian, toByteOffset: 64, as: UInt64.self)
        let h = Self.headerSize
        UnsafeMutableRawBufferPointer(rebasing: out[h..<(h + path.count)]).copyBytes(from: path)
        let at = h + path.count
        if let data {
            UnsafeMutableRawBufferPointer(rebasing: out[at..<(at + count)]).copyMemory(from: data)
        } else {
            UnsafeMutableRawBufferPointer(rebasing: out[at..<(at + count)]).copyBytes(from: bytes)
        }
        out.storeBytes(of: Self.session(key).littleEndian, toByteOffset: 72, as: UInt64.self)
        Self.check(UnsafeRawBufferPointer(rebasing: out[0..<(total - Self.tagSize)]), into: base + total - 16)
        return total
    }

    /// Parses the record at the start of `b` (seq `seq` expected, checksum under `key`): nil
    /// when it is not that record whole (a torn or stale one ends the journal).
    public static func decode(_ b: UnsafeRawBufferPointer, seq: UInt64, key: [UInt8], version: UInt32 = 2)
        -> JournalRecord?
    {
        let headerSize = headerSize(version: version)
        guard b.count >= headerSize + tagSize, Array(b[0..<4]) == magic, let kind = Kind(rawValue: b[4]) else {
            return nil
        }
        let total = Int(UInt32(littleEndian: b.loadUnaligned(fromByteOffset: 16, as: UInt32.self)))
        guard UInt64(littleEndian: b.loadUnaligned(fromByteOffset: 8, as: UInt64.self)) == seq,
            total >= headerSize + tagSize, total <= b.count, total <= largestRecord, total % 16 == 0
        else { return nil }
        let pathLength = Int(UInt16(littleEndian: b.loadUnaligned(fromByteOffset: 20, as: UInt16.self)))
        let count = UInt64(littleEndian: b.loadUnaligned(fromByteOffset: 56, as: UInt64.self))
        let offset = UInt64(littleEndian: b.loadUnaligned(fromByteOffset: 48, as: UInt64.self))
        guard count <= UInt64(total),
            encodedLength(pathLength: pathLength, count: Int(count), version: version) == total,
            offset < 1 << 62, kind == .void || kind == .wrap || offset >= UInt64(FileHeader.size)
        else { return nil }
        var want = [UInt8](repeating: 0, count: tagSize)
        want.withUnsafeMutableBytes {
            let body = UnsafeRawBufferPointer(rebasing: b[0..<(total - tagSize)])
            if version == 1 { tag(body, key: key, into: $0.baseAddress!) } else { check(body, into: $0.baseAddress!) }
        }
        guard sodium_memcmp(want, b.baseAddress! + total - tagSize, tagSize) == 0 else { return nil }
        guard version == 1 || b.loadUnaligned(fromByteOffset: 72, as: UInt64.self) == session(key).littleEndian
        else { return nil }  // written in another session: the records behind a torn one
        let at = headerSize + pathLength
        let file = JournalFileID(
            ino: UInt64(littleEndian: b.loadUnaligned(fromByteOffset: 24, as: UInt64.self)),
            stamp: version == 1 ? 0 : UInt64(littleEndian: b.loadUnaligned(fromByteOffset: 64, as: UInt64.self)),
            fileID: Array(b[32..<48]), path: String(decoding: b[headerSize..<at], as: UTF8.self))
        return JournalRecord(
            kind: kind, seq: seq, file: file,
            offset: Int(offset),
            bytes: Array(b[at..<(at + Int(count))]))
    }

    /// The record's length as its header states it (before the whole record is checked).
    public static func statedLength(_ header: UnsafeRawBufferPointer) -> Int? {
        guard header.count >= 20, Array(header[0..<4]) == magic else { return nil }
        return Int(UInt32(littleEndian: header.loadUnaligned(fromByteOffset: 16, as: UInt32.self)))
    }

    /// The session a record was written in: the first 8 bytes of the superblock's key, which
    /// every replay makes anew (so records of a crashed session never read as whole later).
    static func session(_ key: [UInt8]) -> UInt64 {
        key.withUnsafeBytes { $0.loadUnaligned(as: UInt64.self) }
    }

    /// The check of a version 2 record: CRC32C of everything before it (u32 LE, then 12 zero
    /// bytes), as jbd2's; it tells a whole record from a torn or stale one. What makes the
    /// replayed bytes authentic is each sealed block's own AEAD tag.
    static func check(_ msg: UnsafeRawBufferPointer, into out: UnsafeMutableRawPointer) {
        memset(out, 0, tagSize)
        let crc = kbfs_crc32c(0, msg.baseAddress, UInt(msg.count))
        out.storeBytes(of: crc.littleEndian, as: UInt32.self)
    }

    /// The check of a version 1 record: Poly1305 (libsodium `crypto_onetimeauth`) under the journal's key. It
    /// tells a whole record from a torn or stale one; it is not what makes replayed bytes
    /// authentic (each sealed block still opens only under its file key).
    static func tag(_ msg: UnsafeRawBufferPointer, key: [UInt8], into out: UnsafeMutableRawPointer) {
        _ = crypto_onetimeauth(
            out.assumingMemoryBound(to: UInt8.self), msg.baseAddress!.assumingMemoryBound(to: UInt8.self),
            UInt64(msg.count), key)
    }
}
