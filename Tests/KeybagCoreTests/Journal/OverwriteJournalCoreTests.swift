import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// The overwrite journal's records, its pending blocks and its replay, on real files with
/// real headers (docs/FORMAT.md, "Overwrites").
final class OverwriteJournalCoreTests: TempDirTestCase {
    let cipher = ContentCipher.xaes256gcm

    /// A store folder with `data/f`, a file of `blocks` sealed blocks of `fill`: its
    /// descriptor, key, content layer and journaled identity.
    func makeFile(blocks: Int, fill: UInt8, journal: OverwriteJournal) throws -> (
        Int32, FileContentKey, EncryptedContent, JournaledFile
    ) {
        mkdir(dir + "/data", 0o700)
        let fd = open(dir + "/data/f", O_RDWR | O_CREAT | O_TRUNC, 0o600)
        let raw = SecureKey(random: 32)
        let h = try FileHeader.create(
            fileKey: raw, class: .none, cipher: cipher, using: .symmetric(SecureKey(random: 32)))
        try HeaderSlots.writeNew(fd: fd, h)
        let key = try FileContentKey(key: raw, header: h)
        let c = EncryptedContent(layout: BlockLayout(cipher: cipher))
        let data = [UInt8](repeating: fill, count: blocks * 4096)
        try data.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 0, data: $0) }
        var st = stat()
        fstat(fd, &st)
        let id = JournalFileID(ino: UInt64(st.st_ino), fileID: h.fileID, path: "data/f")
        return (fd, key, c, JournaledFile(journal: journal, id: id))
    }

    /// The file's plaintext.
    func read(_ c: EncryptedContent, _ fd: Int32, _ key: FileContentKey, _ j: JournaledFile?) throws -> [UInt8] {
        var out = [UInt8](repeating: 0, count: 1 << 18)
        let n = try out.withUnsafeMutableBytes { try c.read(fd: fd, key: key, offset: 0, into: $0, journal: j) }
        return Array(out[0..<n])
    }

    func testARecordReadsBackWholeAndATornOrStaleOneDoesNot() throws {
        let key = Sodium.randomArray(32)
        let id = JournalFileID(ino: 42, fileID: Sodium.randomArray(16), path: "data/x/y")
        let r = JournalRecord(kind: .bytes, seq: 7, file: id, offset: 4456, bytes: Sodium.randomArray(4136))
        var b = [UInt8](repeating: 0, count: JournalRecord.encodedLength(pathLength: 8, count: 4136))
        _ = b.withUnsafeMutableBytes { r.encode(into: $0, key: key) }
        XCTAssertEqual(b.withUnsafeBytes { JournalRecord.decode($0, seq: 7, key: key) }, r)
        XCTAssertNil(b.withUnsafeBytes { JournalRecord.decode($0, seq: 8, key: key) }, "a record of another lap")
        XCTAssertNil(b.withUnsafeBytes { JournalRecord.decode($0, seq: 7, key: Sodium.randomArray(32)) })
        var torn = b
        for i in 4096..<torn.count { torn[i] = 0 }  // its second page never written
        XCTAssertNil(torn.withUnsafeBytes { JournalRecord.decode($0, seq: 7, key: key) }, "a torn record")
        let sb = JournalSuperblock.fresh(ringSize: 1 << 20, firstSeq: 9)
        XCTAssertEqual(JournalSuperblock.decode(sb.encoded()), sb)
        var bad = sb.encoded()
        bad[20] ^= 1
        XCTAssertNil(JournalSuperblock.decode(bad))
    }

    /// An overwrite goes to the journal and reads back from it before anything is in place; a
    /// replay writes it in place (the store's block was torn meanwhile); after an fsync it is
    /// in place and a checkpoint leaves nothing to replay.
    func testAnOverwriteIsReadFromTheJournalThenReplayedOverATornBlock() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 3, fill: 1, journal: journal)
        defer { close(fd) }
        let before = try [UInt8](Data(contentsOf: URL(fileURLWithPath: dir + "/data/f")))
        let new = [UInt8](repeating: 2, count: 4096)
        try new.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 4096, data: $0, journal: j) }
        XCTAssertEqual(journal.pendingBlocks, 1)
        XCTAssertEqual(try [UInt8](Data(contentsOf: URL(fileURLWithPath: dir + "/data/f"))), before, "nothing in place")
        XCTAssertEqual(Array(try read(c, fd, key, j)[4096..<8192]), new, "read from the journal")
        XCTAssertEqual(Array(try read(c, fd, key, nil)[4096..<8192]), [UInt8](repeating: 1, count: 4096))
        try journal.sync()
        // Torn in place: the block's first page new garbage, as a cut during its write leaves it.
        let off = c.layout.cipherOffset(ofBlock: 1)
        XCTAssertEqual(pwrite(fd, [UInt8](repeating: 0xee, count: 100), 100, off_t(off)), 100)
        let sb = try XCTUnwrap(JournalSuperblock.decode(Self.sector(journal.fd)))
        let summary = try JournalReplay.write(
            try JournalReplay.scan(journal.fd, sb).0, from: journal.fd, sb, storePath: dir)
        XCTAssertEqual(summary.written, 1)
        XCTAssertEqual(Array(try read(c, fd, key, nil)[4096..<8192]), new, "replayed over the torn block")
        try journal.fsync(j, fd: fd, dataOnly: true)
        XCTAssertEqual(journal.pendingBlocks, 0, "in place after the fsync")
        try journal.checkpoint()
        XCTAssertEqual(try JournalReplay.scan(journal.fd, JournalSuperblock.decode(Self.sector(journal.fd))!).0, [])
    }

    /// A void record ends the records before it, an `exactEnd` record is replayed only where
    /// the file ends right after it, a `bytes` record only where the file reaches past it.
    func testReplayHonoursVoidExactEndAndTheFilesEnd() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 4, fill: 3, journal: journal)
        defer { close(fd) }
        let cb = c.layout.cipherBlockSize
        let id = j.id
        let garbage = [UInt8](repeating: 0xaa, count: cb)
        let records = [
            JournalRecord(kind: .bytes, seq: 1, file: id, offset: c.layout.cipherOffset(ofBlock: 0), bytes: garbage),
            JournalRecord(kind: .void, seq: 2, file: id),
            JournalRecord(kind: .bytes, seq: 3, file: id, offset: c.layout.cipherOffset(ofBlock: 9), bytes: garbage),
            JournalRecord(kind: .exactEnd, seq: 4, file: id, offset: c.layout.cipherOffset(ofBlock: 1), bytes: garbage),
        ]
        let s = try JournalReplay.write(records, storePath: dir)
        XCTAssertEqual(s.written, 0)
        XCTAssertEqual(s.skipped, 3)
        XCTAssertEqual(try read(c, fd, key, nil), [UInt8](repeating: 3, count: 4 * 4096), "nothing written")
        // An inode number that was another file's before: that file's records are not this
        // one's, and this one's still are (the replay once took the first miss for both).
        let other = JournalFileID(ino: id.ino, fileID: Sodium.randomArray(16), path: "data/f")
        let fresh = try FileHeader.parse(Self.sector(fd)).fileID == id.fileID
        XCTAssertTrue(fresh)
        var sealed = [UInt8](repeating: 0, count: cb)
        XCTAssertEqual(pread(fd, &sealed, cb, off_t(c.layout.cipherOffset(ofBlock: 2))), cb)
        let s2 = try JournalReplay.write(
            [
                JournalRecord(kind: .bytes, seq: 5, file: other, offset: 320, bytes: garbage),
                JournalRecord(kind: .bytes, seq: 6, file: id, offset: c.layout.cipherOffset(ofBlock: 0), bytes: sealed),
            ], storePath: dir)
        XCTAssertEqual(s2.unknownFiles, 1, "another file id at the same inode is not the record's file")
        XCTAssertEqual(s2.written, 1, "the file's own record is written")
        XCTAssertEqual(try? read(c, fd, key, nil), nil, "block 2's bytes at block 0 do not open: it was written")
        XCTAssertFalse(JournalFileFinder.isInsideData("../x"))
        XCTAssertFalse(JournalFileFinder.isInsideData("data/../keybag"))
        XCTAssertFalse(JournalFileFinder.isInsideData("/etc/passwd"))
        XCTAssertTrue(JournalFileFinder.isInsideData("data/a/b"))
    }

    /// A shrink re-seals the new last block through the journal, and the file reads right.
    func testAShrinkAndAPunchThroughTheJournalKeepTheContent() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 4, fill: 5, journal: journal)
        defer { close(fd) }
        let new = [UInt8](repeating: 6, count: 6000)
        try new.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 1000, data: $0, journal: j) }
        try c.truncate(fd: fd, key: key, to: 5000, journal: j)
        var want = [UInt8](repeating: 5, count: 1000) + new
        want = Array(want[0..<5000])
        XCTAssertEqual(try read(c, fd, key, j), want)
        XCTAssertEqual(try read(c, fd, key, nil), want, "in place after the cut")
        try c.zeroRange(fd: fd, key: key, offset: 10, length: 20, journal: j) { _, _ in false }
        for i in 10..<30 { want[i] = 0 }
        XCTAssertEqual(try read(c, fd, key, j), want)
        try journal.checkpoint()
        XCTAssertEqual(try read(c, fd, key, nil), want)
    }

    /// A write into zeros (a gap the kernel's write-back left, a hole) goes in place with no
    /// record; cut off by a power cut (one 512-byte sector still zero) it reads as zeros, its old
    /// version, where it read EIO before.
    func testAWriteIntoZerosGoesInPlaceAndATornOneReadsAsZeros() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 1, fill: 7, journal: journal)
        defer { close(fd) }
        let last = [UInt8](repeating: 8, count: 4096)
        try last.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 3 * 4096, data: $0, journal: j) }  // a gap
        let fill = [UInt8](repeating: 9, count: 4096)
        try fill.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 4096, data: $0, journal: j) }
        XCTAssertEqual(journal.pendingBlocks, 0, "the gap was zeros: written in place")
        XCTAssertEqual(Array(try read(c, fd, key, j)[4096..<8192]), fill)
        // The fill torn: its first whole sector of the store back to zeros.
        let off = c.layout.cipherOffset(ofBlock: 1)
        let sector = (off + 511) / 512 * 512
        XCTAssertEqual(pwrite(fd, [UInt8](repeating: 0, count: 512), 512, off_t(sector)), 512)
        let got = try read(c, fd, key, j)
        XCTAssertEqual(Array(got[4096..<8192]), [UInt8](repeating: 0, count: 4096), "old version: zeros")
        XCTAssertEqual(Array(got[0..<4096]), [UInt8](repeating: 7, count: 4096))
        // A block torn without a zero sector is damage, as before.
        XCTAssertEqual(pwrite(fd, [UInt8](repeating: 1, count: 512), 512, off_t(sector)), 512)
        XCTAssertThrowsError(try read(c, fd, key, j))
    }

    /// The superblock's sector of a journal.
    static func sector(_ fd: Int32) -> [UInt8] {
        var b = [UInt8](repeating: 0, count: 512)
        _ = pread(fd, &b, 512, 0)
        return b
    }
}
