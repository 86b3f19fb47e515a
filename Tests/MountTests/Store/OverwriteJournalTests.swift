import Foundation
import Glibc
import XCTest

/// Overwrites in place and what a crash leaves of them (issue "Overwrites a power cut cannot
/// tear"; docs/FORMAT.md, "Overwrites"). The daemon is killed, then the store is made to look
/// as a power cut leaves it (one backing page of a rewritten block new, its neighbour old),
/// and the next mount must read each block as its old or new version, never EIO.
final class OverwriteJournalTests: XCTestCase {
    static let block = 4096
    /// Sealed block size on the store (XAES and XChaCha: 40 bytes of nonce and tag).
    static let sealed = 4096 + 40

    /// Writes `data` at `offset` of the mounted file and fsyncs it.
    func writeSynced(_ path: String, _ data: [UInt8], at offset: Int) throws {
        let fd = open(path, O_WRONLY)
        XCTAssertGreaterThanOrEqual(fd, 0)
        defer { close(fd) }
        XCTAssertEqual(pwrite(fd, data, data.count, off_t(offset)), data.count)
        XCTAssertEqual(fsync(fd), 0)
    }

    /// The backing bytes of block `b` of the store file `backing`.
    func backingBlock(_ backing: String, _ b: Int) throws -> [UInt8] {
        let all = try [UInt8](Data(contentsOf: URL(fileURLWithPath: backing)))
        let at = 320 + b * Self.sealed
        return Array(all[at..<min(all.count, at + Self.sealed)])
    }

    /// Puts `bytes` at `offset` of the backing file, as the disk would have them after a cut.
    func tear(_ backing: String, _ bytes: [UInt8], at offset: Int) {
        let fd = open(backing, O_WRONLY)
        defer { close(fd) }
        XCTAssertEqual(pwrite(fd, bytes, bytes.count, off_t(offset)), bytes.count)
        fsync(fd)
    }

    /// Kills the daemon (nothing unmounts cleanly, the journal is left as it was).
    func kill9(_ m: MountFixture) throws {
        let pid = try XCTUnwrap(m.daemon?.processIdentifier)
        kill(pid, SIGKILL)
        m.unmount()
    }

    /// A block rewritten and fsynced, then torn on the store (its second backing page put
    /// back as before the rewrite, as a power cut may leave it): the next mount reads the new
    /// version. On the code before the journal it read EIO.
    func testAnAcknowledgedRewriteTornOnTheStoreReadsAsItsNewVersion() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let path = m.path("db.bin")
        XCTAssertTrue(
            FileManager.default.createFile(atPath: path, contents: Data(repeating: 0x11, count: 3 * Self.block)))
        try writeSynced(path, [UInt8](repeating: 0x11, count: 3 * Self.block), at: 0)
        let backing = m.backing("db.bin")
        let old = try backingBlock(backing, 1)
        try writeSynced(path, [UInt8](repeating: 0x22, count: Self.block), at: Self.block)
        let new = try backingBlock(backing, 1)
        XCTAssertNotEqual(old, new, "the rewrite reached the store in place after its fsync")
        try kill9(m)
        // The first backing page of block 1 new, the rest of the block as before the rewrite.
        let blockStart = 320 + Self.sealed
        let pageEnd = (blockStart / 4096 + 1) * 4096
        tear(backing, Array(old[(pageEnd - blockStart)...]), at: pageEnd)
        try m.mount()
        m.unlock()
        let got = try [UInt8](Data(contentsOf: URL(fileURLWithPath: path)))
        XCTAssertEqual(got.count, 3 * Self.block)
        XCTAssertTrue(Array(got[Self.block..<(2 * Self.block)]) == [UInt8](repeating: 0x22, count: Self.block))
        XCTAssertTrue(Array(got[0..<Self.block]) == [UInt8](repeating: 0x11, count: Self.block))
        XCTAssertEqual(m.fsck().problems.map(\.kind), [])
    }

    /// A rewrite never synced whose journal record is lost with the crash: the block in place
    /// was never touched (blocks go in place only once their record is durable), so it reads
    /// as its old version. A rewrite whose record survived reads as its new version.
    func testAnUnsyncedRewriteReadsAsOldOrNewNeverTorn() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let path = m.path("pages.bin")
        XCTAssertTrue(FileManager.default.createFile(atPath: path, contents: nil))
        try writeSynced(path, [UInt8](repeating: 0x31, count: 4 * Self.block), at: 0)
        let backing = m.backing("pages.bin")
        let before = try [UInt8](Data(contentsOf: URL(fileURLWithPath: backing)))
        // Rewritten without fsync (close sends the kernel's dirty pages to the daemon).
        let fd = open(path, O_WRONLY)
        XCTAssertEqual(
            pwrite(fd, [UInt8](repeating: 0x32, count: Self.block), Self.block, off_t(2 * Self.block)), Self.block)
        close(fd)
        XCTAssertEqual(
            try [UInt8](Data(contentsOf: URL(fileURLWithPath: path)))[2 * Self.block], 0x32,
            "the mount shows the rewrite")
        let journals = try FileManager.default.contentsOfDirectory(atPath: m.store).filter {
            $0.hasPrefix(".kbfs-journal-")
        }
        XCTAssertEqual(journals.count, 1, "one journal, named for this device")
        try kill9(m)
        XCTAssertTrue(try [UInt8](Data(contentsOf: URL(fileURLWithPath: backing))) == before, "nothing went in place")
        // Never synced, the rewrite may have died with the daemon (its record is written out
        // with the next ones or at a sync) or survived it: the old or the new version, whole.
        let journal = m.store + "/" + (try XCTUnwrap(journals.first))
        let saved = try Data(contentsOf: URL(fileURLWithPath: journal))
        try m.mount()
        m.unlock()
        let after = try [UInt8](Data(contentsOf: URL(fileURLWithPath: path)))
        let third = Array(after[(2 * Self.block)..<(3 * Self.block)])
        XCTAssertTrue(
            third == [UInt8](repeating: 0x31, count: Self.block) || third == [UInt8](repeating: 0x32, count: Self.block)
        )
        m.unmount()
        // The same crash with the record lost (a power cut before the journal reached the
        // disk): the old version, whole.
        tear(backing, before, at: 0)
        // The ring as a fresh one (its superblock, durable since the journal was made, stays).
        try (saved.prefix(4096) + Data(repeating: 0, count: saved.count - 4096)).write(
            to: URL(fileURLWithPath: journal))
        try m.mount()
        m.unlock()
        let got = try [UInt8](Data(contentsOf: URL(fileURLWithPath: path)))
        XCTAssertTrue(got == [UInt8](repeating: 0x31, count: 4 * Self.block), "the old version, whole")
    }
}
