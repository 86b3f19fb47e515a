import CSodium
import Foundation
import Glibc
import KeybagCore
import XCTest

/// The overwrite journal against other versions and copies of its store (issue "The write
/// path", N3, N4, N8): a file a sync engine replaced never takes the old version's records, a
/// copy of the store replays into files created in the crashed mount, and a crafted journal
/// costs a replay no more memory than a real one. Each failed on a84772e.
final class OverwriteJournalReplicaTests: XCTestCase {
    static let block = 4096
    static let sealed = 4096 + 40
    /// Background commits put blocks in place but keep their records (as before a retirement),
    /// so a block torn on the store after a kill is one whose record is live.
    static let keepRecords = ["KEYBAGFS_TEST_FAILPOINTS": "journal-keeps-records=on"]

    /// Writes `data` at `offset` of `path` and fsyncs it.
    func writeSynced(_ path: String, _ data: [UInt8], at offset: Int) {
        let fd = open(path, O_WRONLY | O_CREAT, 0o644)
        XCTAssertGreaterThanOrEqual(fd, 0)
        defer { close(fd) }
        XCTAssertEqual(pwrite(fd, data, data.count, off_t(offset)), data.count)
        XCTAssertEqual(fsync(fd), 0)
    }

    /// Kills the daemon: no checkpoint, the journal's records stay live.
    func kill9(_ m: MountFixture) throws {
        kill(try XCTUnwrap(m.daemon?.processIdentifier), SIGKILL)
        m.unmount()
    }

    /// A mounted, unlocked fixture whose journal keeps its records.
    func mounted() throws -> MountFixture {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(environment: Self.keepRecords)
        m.unlock()
        return m
    }

    /// N3: a sync engine puts another version of a file (same file id) in place by a rename;
    /// a crash of the mount that journaled a rewrite of the old version must not write that
    /// rewrite into the new one (it read `aaZa`, a file that never existed).
    func testAFileReplacedByASyncEngineNeverTakesTheOldVersionsRecords() throws {
        let m = try mounted()
        let path = m.path("doc.bin")
        writeSynced(path, [UInt8](repeating: 0x61, count: 4 * Self.block), at: 0)
        try kill9(m)  // the file known by its name from now on
        try m.mount(environment: Self.keepRecords)
        m.unlock()
        let backing = m.backing("doc.bin")
        let otherVersion = try Data(contentsOf: URL(fileURLWithPath: backing))
        writeSynced(path, [UInt8](repeating: 0x5a, count: Self.block), at: 2 * Self.block)
        try kill9(m)
        // The sync engine: the other device's version, written beside it, renamed over it.
        try otherVersion.write(to: URL(fileURLWithPath: backing + ".syncthing.tmp"))
        XCTAssertEqual(rename(backing + ".syncthing.tmp", backing), 0)
        try m.mount()
        m.unlock()
        let got = try [UInt8](Data(contentsOf: URL(fileURLWithPath: path)))
        XCTAssertTrue(got == [UInt8](repeating: 0x61, count: 4 * Self.block), "the replaced version, as it came")
    }

    /// N4: a file created in the crashed mount (unnamed, then linked) had no path in its
    /// records, so a copy of the store (other inode numbers) found nothing to replay into and
    /// its torn block read EIO there, while the original replayed.
    func testACopyOfTheStoreReplaysIntoAFileCreatedInTheCrashedMount() throws {
        let m = try mounted()
        let path = m.path("new.bin")
        writeSynced(path, [UInt8](repeating: 0x11, count: 3 * Self.block), at: 0)
        let backing = m.backing("new.bin")
        let rel = String(backing.dropFirst(m.store.count))
        let old = try [UInt8](Data(contentsOf: URL(fileURLWithPath: backing)))
        writeSynced(path, [UInt8](repeating: 0x22, count: Self.block), at: Self.block)
        try kill9(m)
        let copy = try MountFixture(replicaOf: m, passcode: m.passcode)
        addTeardownBlock { copy.close() }
        try FileManager.default.copyItem(atPath: m.deviceKey, toPath: copy.deviceKey)
        // In the copy, block 1's second backing page as before the rewrite (a cut mid-write).
        let blockStart = 320 + Self.sealed
        let pageEnd = (blockStart / 4096 + 1) * 4096
        let fd = open(copy.store + rel, O_WRONLY)
        XCTAssertGreaterThanOrEqual(fd, 0)
        let tail = Array(old[pageEnd..<(blockStart + Self.sealed)])
        XCTAssertEqual(pwrite(fd, tail, tail.count, off_t(pageEnd)), tail.count)
        close(fd)
        try copy.mount()
        copy.unlock()
        guard case .success(let got) = readFile(copy.path("new.bin")) else {
            return XCTFail("the copy's file does not read (EIO: its records found no file)")
        }
        let want = [0x11, 0x22, 0x11].flatMap { [UInt8](repeating: $0, count: Self.block) }
        XCTAssertTrue(got == want, "the copy reads the acknowledged rewrite")
    }

    /// A version-1 journal (as a84772e wrote them) of a `ring`-byte ring holding one record
    /// of `count` data bytes with a valid checksum: what a store writer can craft.
    func craftJournal(_ path: String, ring: Int, count: Int) throws {
        let key = [UInt8](repeating: 7, count: 32)
        var sb = [UInt8](repeating: 0, count: 4096)
        sb.replaceSubrange(0..<4, with: Array("KBJS".utf8))
        sb.withUnsafeMutableBytes { p in
            p.storeBytes(of: UInt32(1).littleEndian, toByteOffset: 4, as: UInt32.self)
            p.storeBytes(of: UInt64(ring).littleEndian, toByteOffset: 8, as: UInt64.self)
            p.storeBytes(of: UInt64(1).littleEndian, toByteOffset: 24, as: UInt64.self)
        }
        sb.replaceSubrange(32..<64, with: key)
        var sum = [UInt8](repeating: 0, count: 16)
        _ = crypto_generichash(&sum, 16, Array(sb[0..<64]), 64, nil, 0)
        sb.replaceSubrange(64..<80, with: sum)
        let total = (64 + count + 15) / 16 * 16 + 16
        var record = [UInt8](repeating: 0, count: total)
        record.replaceSubrange(0..<4, with: Array("KBJR".utf8))
        record[4] = 1
        record.withUnsafeMutableBytes { p in
            p.storeBytes(of: UInt64(1).littleEndian, toByteOffset: 8, as: UInt64.self)
            p.storeBytes(of: UInt32(total).littleEndian, toByteOffset: 16, as: UInt32.self)
            p.storeBytes(of: UInt64(4096).littleEndian, toByteOffset: 48, as: UInt64.self)
            p.storeBytes(of: UInt64(count).littleEndian, toByteOffset: 56, as: UInt64.self)
        }
        _ = record.withUnsafeMutableBufferPointer { r in
            crypto_onetimeauth(r.baseAddress! + total - 16, r.baseAddress!, UInt64(total - 16), key)
        }
        let fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0o600)
        defer { close(fd) }
        XCTAssertEqual(pwrite(fd, sb, sb.count, 0), sb.count)
        XCTAssertEqual(pwrite(fd, record, total, 4096), total)
        XCTAssertEqual(ftruncate(fd, off_t(4096 + ring)), 0)
    }

    /// N8: a crafted journal (a large ring holding one record as long as it) made fsck read
    /// and copy the whole record: 1.07 GB for a 512 MiB ring. A replay now holds one record of
    /// at most 4 MiB at a time and refuses rings over 64 MiB; the peak stays near fsck's own.
    func testACraftedJournalCostsAReplayNoMoreMemoryThanARealOne() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        writeSynced(m.path("f"), [UInt8](repeating: 1, count: 10_000), at: 0)
        m.unmount()
        let journal = try XCTUnwrap(
            try FileManager.default.contentsOfDirectory(atPath: m.store).first { $0.hasPrefix(".kbfs-journal-") })
        let path = m.store + "/" + journal
        /// fsck's peak resident memory in KiB and its exit code.
        func fsckPeak(_ extra: [String] = []) -> (Int, Int32) {
            let r = MountFixture.run(
                "/usr/bin/time",
                ["-f", "peak %M", MountFixture.binDir + "/keybagfs", "fsck", m.store, "--device-key", m.deviceKey]
                    + extra)
            let peak = r.stderr.split(separator: "\n").last { $0.hasPrefix("peak ") }.flatMap { Int($0.dropFirst(5)) }
            return (peak ?? -1, r.code)
        }
        let (baseline, clean) = fsckPeak()
        XCTAssertEqual(clean, 0)
        XCTAssertGreaterThan(baseline, 0)
        try craftJournal(path, ring: 64 << 20, count: 48 << 20)
        let (withRecord, code) = fsckPeak()
        XCTAssertLessThan(
            withRecord, baseline + 24 << 10, "a 48 MiB record: peak \(withRecord) KiB, \(baseline) without")
        XCTAssertEqual(code, 0, "a record too long to be one ends the journal")
        try craftJournal(path, ring: 256 << 20, count: 200 << 20)
        let (withRing, refused) = fsckPeak()
        XCTAssertLessThan(withRing, baseline + 24 << 10, "a 256 MiB ring: peak \(withRing) KiB")
        XCTAssertNotEqual(refused, 0, "a ring over the limit is damage: refused, named")
        XCTAssertEqual(fsckPeak(["--repair"]).1, 0, "--repair sets it aside")
        XCTAssertTrue(FileManager.default.fileExists(atPath: path + ".damaged"))
        try m.mount()
        m.unlock()
        XCTAssertTrue(
            try [UInt8](Data(contentsOf: URL(fileURLWithPath: m.path("f")))) == [UInt8](repeating: 1, count: 10_000))
    }
}
