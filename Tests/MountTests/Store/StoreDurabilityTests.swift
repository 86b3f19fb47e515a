import CFuse
import Foundation
import Glibc
import XCTest

/// What a power cut, or a store's filesystem, can leave that the mount must take without
/// losing anything (issue "Nothing lost on a power cut"; the crash states themselves are
/// Tests/powercut's): a store whose filesystem gives no space figures, and an xattr set a power
/// cut left empty.
final class StoreDurabilityTests: XCTestCase {
    /// A store on a tmpfs mounted without a size (statfs: 0 blocks, as LazyFS and some FUSE and
    /// network filesystems report) takes writes of every size, as gocryptfs does.
    func testAStoreWhoseFilesystemGivesNoSpaceFiguresTakesWrites() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock {
            m.unmount()
            umount2(m.store, Int32(MNT_DETACH))
            m.close()
        }
        // The store again, on a tmpfs without a size, with the fixture's device key and passcode.
        XCTAssertEqual(MountFixture.run("/bin/rm", ["-rf", m.store]).code, 0)
        XCTAssertEqual(mkdir(m.store, 0o700), 0)
        XCTAssertEqual(MountFixture.run("/bin/mount", ["-t", "tmpfs", "-o", "size=0", "tmpfs", m.store]).code, 0)
        var s = statvfs()
        XCTAssertEqual(statvfs(m.store, &s), 0)
        XCTAssertEqual(s.f_blocks, 0, "the filesystem under the store gives no space figures")
        let r = MountFixture.run(
            MountFixture.binDir + "/keybagfs",
            [
                "init", m.store, "--passcode-stdin", "--device-key", m.deviceKey, "--kdf", "interactive", "--tpm2",
                "off", "--no-recovery-key",
            ], stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 0, r.stderr)
        try m.mount()
        m.unlock()
        let big = [UInt8]((0..<(3 << 20)).map { UInt8(truncatingIfNeeded: $0 &* 31) })
        XCTAssertEqual(writeFile(m.path("small.txt"), bytes("hello")), 0, "a small write was refused")
        XCTAssertEqual(writeFile(m.path("big.bin"), big), 0, "a 3 MiB write was refused")
        let fd = open(m.path("big.bin"), O_RDONLY)
        XCTAssertEqual(fsync(fd), 0)
        close(fd)
        XCTAssertEqual(try readFile(m.path("big.bin")).get(), big)
        XCTAssertEqual(try readFile(m.path("small.txt")).get(), bytes("hello"))
    }

    /// An xattr set whose rename reached the disk before its bytes (set without an fsync of its
    /// file, then a power cut) is an empty file in the store: the file's xattr calls answer as
    /// for a file without stored xattrs (user.protection still there), a new xattr can be set,
    /// and fsck names the damaged set and removes it.
    func testAnXattrSetAPowerCutLeftEmptyIsNoEIOAndFsckRemovesIt() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("doc.txt"), bytes("contents")), 0)
        XCTAssertEqual(setXattr(m.path("doc.txt"), "a note", "user.note"), 0)
        m.unmount()
        let sets = try FileManager.default.contentsOfDirectory(atPath: m.store + "/xattrs")
        XCTAssertEqual(sets.count, 1)
        XCTAssertEqual(truncate(m.store + "/xattrs/" + sets[0], 0), 0, "the power cut: an empty set")
        let found = m.fsck()
        XCTAssertTrue(found.problems.contains { $0.kind == "xattr-set-damaged" }, "fsck names it: \(found.out)")
        try m.mount()
        m.unlock()
        var names = [CChar](repeating: 0, count: 1024)
        let n = listxattr(m.path("doc.txt"), &names, names.count)
        XCTAssertGreaterThan(n, 0, "listxattr answered \(errno)")
        let listed = names[0..<max(0, n)].split(separator: 0).map {
            String(decoding: $0.map { UInt8($0) }, as: UTF8.self)
        }
        XCTAssertEqual(listed, ["user.protection"], "the xattrs that survived")
        XCTAssertEqual(try getXattr(m.path("doc.txt")).get(), "completeUntilFirstUserAuthentication")
        XCTAssertEqual(try readFile(m.path("doc.txt")).get(), bytes("contents"))
        XCTAssertEqual(setXattr(m.path("doc.txt"), "a new note", "user.note"), 0)
        XCTAssertEqual(try getXattr(m.path("doc.txt"), "user.note").get(), "a new note")
        m.unmount()
        XCTAssertEqual(m.fsck().code, 0, "clean once the set was written again")
        // Damaged again; the repair removes it, losing nothing readable.
        XCTAssertEqual(truncate(m.store + "/xattrs/" + sets[0], 0), 0)
        _ = m.fsck(["--repair"])
        XCTAssertEqual(m.fsck().code, 0, "clean after --repair: \(m.fsck().out)")
        XCTAssertFalse(FileManager.default.fileExists(atPath: m.store + "/xattrs/" + sets[0]))
    }
}
