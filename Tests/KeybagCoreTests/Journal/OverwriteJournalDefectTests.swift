import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// The overwrite journal's defects found by review (issue "The write path", N1–N9), each
/// reproduced on real files; every test here failed on a84772e.
extension OverwriteJournalCoreTests {
    /// Appends records for a place far past the file's end (never replayed, never pending)
    /// until the ring's head is `room` bytes before its end.
    func fillRing(_ journal: OverwriteJournal, _ j: JournaledFile, fd: Int32, leaving room: Int) throws {
        let pathLength = j.id.path.utf8.count
        let bare = JournalRecord.encodedLength(pathLength: 0, count: 0) - 16
        let full = JournalRecord.encodedLength(pathLength: pathLength, count: 4136)
        while true {
            let left = journal.ringSize - journal.state.withLock { $0.headPos } - room
            if left == 0 { return }
            let count = left >= 2 * full ? 4136 : left - 16 - bare - pathLength
            XCTAssertGreaterThan(count, 0)
            let bytes = [UInt8](repeating: 0x5a, count: count)
            try bytes.withUnsafeBytes {
                try journal.append(j, fd: fd, offset: 1 << 30, bytes: $0, stride: count, pending: false)
            }
        }
    }

    /// N1: a record ending exactly at the ring's end, then a checkpoint: the superblock once
    /// said tail = ring size, the next replay found "no valid superblock" and dropped every
    /// record after the checkpoint (an fsynced rewrite read back torn).
    func testARecordEndingAtTheRingsEndKeepsTheRecordsAfterACheckpoint() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 64 << 10) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 3, fill: 1, journal: journal)
        defer { close(fd) }
        try fillRing(journal, j, fd: fd, leaving: 0)
        XCTAssertEqual(journal.state.withLock { $0.headPos }, journal.ringSize)
        try journal.checkpoint()
        let new = [UInt8](repeating: 2, count: 4096)
        try new.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 4096, data: $0, journal: j) }
        try journal.sync()  // the fsync's journal half: acknowledged
        // The cut: block 1 torn in place (its first bytes garbage), the daemon gone.
        XCTAssertEqual(
            pwrite(fd, [UInt8](repeating: 0xee, count: 100), 100, off_t(c.layout.cipherOffset(ofBlock: 1))), 100)
        try JournalReplay.replay(storePath: dir, deviceID: "dev") { _ in }
        XCTAssertEqual(Array(try read(c, fd, key, nil)[4096..<8192]), new, "the acknowledged rewrite replayed")
    }

    /// N2: a replay that stops at a torn record once kept its key, position and sequence
    /// number; the next session wrote a record of the same length there, and at the mount
    /// after, the crashed session's records behind it replayed: a lost write came back.
    func testARecordLostInOneCrashNeverComesBackAfterTheNext() throws {
        let j1 = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 4, fill: 1, journal: j1)
        defer { close(fd) }
        var starts: [Int] = []
        for (b, fill) in [(1, 2), (2, 3), (3, 4)] as [(Int, UInt8)] {
            starts.append(j1.state.withLock { $0.headPos })
            let data = [UInt8](repeating: fill, count: 4096)
            try data.withUnsafeBytes { try c.write(fd: fd, key: key, offset: b * 4096, data: $0, journal: j) }
        }
        try j1.sync()
        // Crash 1: the second record torn (its second half never reached the disk).
        let torn = JournalSuperblock.ringStart + starts[1] + 2048
        XCTAssertEqual(pwrite(j1.fd, [UInt8](repeating: 0, count: 2048), 2048, off_t(torn)), 2048)
        let j2 = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        XCTAssertEqual(try read(c, fd, key, nil), [1, 2, 1, 1].flatMap { [UInt8](repeating: $0, count: 4096) })
        // Session 2 rewrites block 2 (a record of the same length where the torn one was).
        let again = JournaledFile(journal: j2, id: j.id)
        let five = [UInt8](repeating: 5, count: 4096)
        try five.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 2 * 4096, data: $0, journal: again) }
        try j2.sync()
        // Crash 2, then the next mount's replay: block 3's lost write must stay lost.
        try JournalReplay.replay(storePath: dir, deviceID: "dev") { _ in }
        XCTAssertEqual(
            try read(c, fd, key, nil), [1, 2, 5, 1].flatMap { [UInt8](repeating: $0, count: 4096) },
            "block 3 read 4: a write lost in the first crash came back")
    }

    /// N5: a record whose path now names a folder refused the replay (and so the mount); one
    /// naming a path through a symlink a store writer placed made the replay open a FIFO and a
    /// regular file outside `data/` read-write before checking where they lie.
    func testAReplayNeverOpensAFolderASymlinkOrAnythingOutsideData() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, _, c, j) = try makeFile(blocks: 2, fill: 1, journal: journal)
        close(fd)
        let outside = dir + "/outside"
        mkdir(outside, 0o700)
        XCTAssertTrue(FileManager.default.createFile(atPath: outside + "/victim", contents: Data(count: 9000)))
        XCTAssertEqual(mkfifo(outside + "/pipe", 0o600), 0)
        XCTAssertEqual(symlink(outside, dir + "/data/link"), 0)
        XCTAssertEqual(symlink(outside + "/victim", dir + "/data/direct"), 0)
        unlink(dir + "/data/f")
        XCTAssertEqual(mkdir(dir + "/data/f", 0o700), 0)  // rm f; mkdir f
        let watch = inotify_init1(Int32(IN_NONBLOCK))
        let inOpen: UInt32 = 0x20  // IN_OPEN
        XCTAssertGreaterThanOrEqual(inotify_add_watch(watch, outside, inOpen), 0)
        defer { close(watch) }
        let bytes = [UInt8](repeating: 0xaa, count: 64)
        let records = ["data/f", "data/link/victim", "data/link/pipe", "data/direct"].enumerated().map { i, path in
            JournalRecord(
                kind: .bytes, seq: UInt64(i + 1), file: JournalFileID(ino: j.id.ino, fileID: j.id.fileID, path: path),
                offset: c.layout.cipherOffset(ofBlock: 0), bytes: bytes)
        }
        let summary = try JournalReplay.write(records, storePath: dir)
        XCTAssertEqual(summary.written, 0)
        var events = [UInt8](repeating: 0, count: 4096)
        XCTAssertLessThanOrEqual(Glibc.read(watch, &events, events.count), 0, "something outside data/ was opened")
        XCTAssertEqual(
            try [UInt8](Data(contentsOf: URL(fileURLWithPath: outside + "/victim"))), [UInt8](repeating: 0, count: 9000)
        )
    }

    /// N6: right after an unaligned append that crosses into a new block, the store's own copy
    /// (a sync engine's, a backup's) holds the old short last block and zeros where its new
    /// version is pending; that read as zeros (the torn-fill rule) and fsck said clean. It is
    /// neither version: EIO.
    func testAnOldShortBlockAndZerosIsDamageNotATornFill() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 0, fill: 1, journal: journal)
        defer { close(fd) }
        let first = [UInt8](repeating: 1, count: 100)
        try first.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 0, data: $0, journal: j) }
        let more = [UInt8](repeating: 2, count: 5000)
        try more.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 100, data: $0, journal: j) }
        XCTAssertEqual(journal.pendingBlocks, 1, "block 0's new version waits in the journal")
        XCTAssertEqual(try read(c, fd, key, j), first + more)
        XCTAssertThrowsError(try read(c, fd, key, nil), "the store's copy read as zeros")
        var sealed = [UInt8](repeating: 0, count: c.layout.cipherBlockSize)
        XCTAssertEqual(pread(fd, &sealed, sealed.count, off_t(FileHeader.size)), sealed.count)
        var scratch = [UInt8](repeating: 0, count: 4096)
        let verdict = sealed.withUnsafeBytes { s in
            scratch.withUnsafeMutableBytes { key.check(s, block: 0, last: false, scratch: $0) }
        }
        XCTAssertEqual(verdict, .damaged, "fsck's verdict")
    }

    /// N9: a fill torn so that only its piece of a sector at the block's edge stayed zero
    /// (under 32 bytes) read EIO, where it is its old version, zeros.
    func testAFillTornAtABlocksEdgeReadsAsZeros() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 1, fill: 7, journal: journal)
        defer { close(fd) }
        let last = [UInt8](repeating: 8, count: 4096)
        try last.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 20 * 4096, data: $0, journal: j) }
        // Block 17 starts 24 bytes before a sector boundary; block 4 ends 8 bytes after one.
        let start17 = c.layout.cipherOffset(ofBlock: 17), end4 = c.layout.cipherOffset(ofBlock: 5)
        XCTAssertEqual(512 - start17 % 512, 24)
        XCTAssertEqual(end4 % 512, 8)
        let fill = [UInt8](repeating: 9, count: 4096)
        for b in [4, 17] {
            try fill.withUnsafeBytes { try c.write(fd: fd, key: key, offset: b * 4096, data: $0, journal: j) }
        }
        XCTAssertEqual(journal.pendingBlocks, 0, "fills of zeros go in place")
        XCTAssertEqual(pwrite(fd, [UInt8](repeating: 0, count: 24), 24, off_t(start17)), 24)
        XCTAssertEqual(pwrite(fd, [UInt8](repeating: 0, count: 8), 8, off_t(end4 - 8)), 8)
        let got = try read(c, fd, key, j)
        let zeros = [UInt8](repeating: 0, count: 4096)
        XCTAssertTrue(got[(17 * 4096)..<(18 * 4096)].elementsEqual(zeros), "a 24-byte edge piece")
        XCTAssertTrue(got[(4 * 4096)..<(5 * 4096)].elementsEqual(zeros), "an 8-byte edge piece")
    }

    /// N7: a shrink whose second record met a full ring checkpointed between its two records,
    /// retiring the `exactEnd` one before the new last block was in place: a cut then (its
    /// plain record not durable, the block torn in place) read EIO.
    func testAShrinkMeetingAFullRingKeepsItsNewLastBlock() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 64 << 10) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 4, fill: 5, journal: journal)
        defer { close(fd) }
        let pathLength = j.id.path.utf8.count
        let record = JournalRecord.encodedLength(pathLength: pathLength, count: 904 + c.layout.overhead)
        let void = JournalRecord.encodedLength(pathLength: pathLength, count: 0)
        try fillRing(journal, j, fd: fd, leaving: void + record + 16)
        try c.truncate(fd: fd, key: key, to: 5000, journal: j)
        // The cut: the plain record never reached the disk, the block in place torn.
        let head = journal.state.withLock { $0.headPos }
        let zeros = [UInt8](repeating: 0, count: record)
        XCTAssertEqual(pwrite(journal.fd, zeros, record, off_t(JournalSuperblock.ringStart + head - record)), record)
        XCTAssertEqual(
            pwrite(fd, [UInt8](repeating: 0xee, count: 100), 100, off_t(c.layout.cipherOffset(ofBlock: 1))), 100)
        try JournalReplay.replay(storePath: dir, deviceID: "dev") { _ in }
        XCTAssertEqual(try read(c, fd, key, nil), [UInt8](repeating: 5, count: 5000))
    }

    /// Found by review of the retirement: a durable version of a block replaced in memory by a
    /// newer, not yet durable one (a write-back of a mapped page while an fsync applies) went
    /// unwritten, and the retirement moved the tail past its record: a power cut then read the
    /// version before the fsynced one. Such a record is not retired until the block is in place.
    func testARecordWhoseBlockWasReplacedBeforeGoingInPlaceIsNotRetired() throws {
        let journal = try JournalReplay.open(storePath: dir, deviceID: "dev", ringSize: 1 << 20) { _ in }
        let (fd, key, c, j) = try makeFile(blocks: 2, fill: 1, journal: journal)
        defer { close(fd) }
        let mark = journal.state.withLock { $0.nextSeq }
        let fsynced = [UInt8](repeating: 2, count: 4096), later = [UInt8](repeating: 3, count: 4096)
        try fsynced.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 4096, data: $0, journal: j) }
        try journal.sync()  // durable: an fsync may now return once it is in place or its record live
        try later.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 4096, data: $0, journal: j) }
        try journal.apply()  // the newer version is not durable: nothing goes in place
        let next = journal.state.withLock { $0.nextSeq }
        XCTAssertFalse(
            journal.state.withLock { $0.allInPlace(before: next - 1) },
            "the fsynced version (record \(mark)) is neither in place nor pending: its record must stay")
    }
}
