import Foundation
import Glibc
import XCTest

/// `keybagfs fsck` on stores damaged as crashes and offline edits damage them: it reports
/// exactly that damage, repairs what loses nothing, drops data only with --yes, and
/// leaves a store the daemon reads.
final class FsckTests: XCTestCase {
    /// Sorted kinds of problems.
    func kinds(_ ps: [(kind: String, repair: String)]) -> [String] { ps.map(\.kind).sorted() }

    /// Replaces a backing file's bytes in place.
    func setBytes(_ path: String, _ b: [UInt8]) {
        let fd = open(path, O_WRONLY | O_TRUNC)
        XCTAssertGreaterThanOrEqual(fd, 0, path)
        XCTAssertEqual(write(fd, b, b.count), b.count)
        close(fd)
    }

    func testACleanStoreIsCleanAndAMountedStoreIsRefused() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        XCTAssertEqual(
            writeFile(m.path("d/" + String(repeating: "l", count: 200)), [UInt8](repeating: 1, count: 50_000)), 0)
        XCTAssertEqual(writeFile(m.path("empty"), []), 0)
        XCTAssertEqual(symlink("/some/target", m.path("link")), 0)
        let busy = MountFixture.run(MountFixture.binDir + "/keybagfs", ["fsck", m.store, "--device-key", m.deviceKey])
        XCTAssertEqual(busy.code, 1)
        XCTAssertTrue(busy.stderr.contains("mounted"), busy.stderr)
        m.unmount()
        let r = m.fsck()
        XCTAssertEqual(r.code, 0, "\(r.out)")
        XCTAssertEqual(r.out["clean"] as? Bool, true)
        XCTAssertEqual(r.out["files"] as? Int, 2)
        XCTAssertEqual(r.out["blocks"] as? Int, 13)
        let keyless = m.fsck(passcode: false)
        XCTAssertEqual(keyless.code, 0)
        XCTAssertEqual(keyless.out["filesWithoutKey"] as? Int, 2, "class C contents need the passcode")
    }

    /// fsck with a passcode is one more place to guess it: wrong passcodes count in the
    /// keybag as the daemon's unlock does, and the throttle holds there too (fsck used to try
    /// every passcode it was given, uncounted).
    func testFsckCountsWrongPasscodesAndHonoursTheThrottle() throws {
        let m = try MountFixture(mount: false)
        defer { m.close() }
        for i in 1...5 {
            let r = MountFixture.run(
                MountFixture.binDir + "/keybagfs", ["fsck", m.store, "--device-key", m.deviceKey, "--passcode-stdin"],
                stdin: "guess \(i)\n")
            XCTAssertNotEqual(r.code, 0, "guess \(i) opened the store")
            XCTAssertTrue(r.stderr.contains("wrong passcode"), "guess \(i): \(r.stderr)")
        }
        let kb = try XCTUnwrap(
            JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag")))
                as? [String: Any])
        XCTAssertEqual(kb["failedAttempts"] as? Int, 5, "each wrong guess counted")
        let right = MountFixture.run(
            MountFixture.binDir + "/keybagfs", ["fsck", m.store, "--device-key", m.deviceKey, "--passcode-stdin"],
            stdin: m.passcode + "\n")
        XCTAssertNotEqual(right.code, 0, "the throttle let fsck try a passcode")
        XCTAssertTrue(right.stderr.contains("try again in"), right.stderr)
        try m.mount()
        let r = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertTrue(r.stderr.contains("throttled"), "the daemon sees the same count: \(r.stderr)")
    }

    func testFsckReportsExactlyTheDamageAndRepairsIt() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let data = (0..<30_000).map { UInt8(truncatingIfNeeded: $0 &* 13) }
        for f in ["cut", "torn", "middle", "headerless", "badheader"] {
            XCTAssertEqual(writeFile(m.path(f), data), 0, f)
        }
        let whole = Array(data[0..<(7 * 4096)])
        XCTAssertEqual(writeFile(m.path("fragment"), whole), 0)
        XCTAssertEqual(writeFile(m.path("withxattr"), data), 0)
        XCTAssertEqual(setXattr(m.path("withxattr"), "v", "user.note"), 0)
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        XCTAssertEqual(writeFile(m.path("d/" + String(repeating: "s", count: 220)), data), 0)
        let b = [
            "cut", "torn", "fragment", "middle", "headerless", "badheader", "withxattr",
            "d/" + String(repeating: "s", count: 220),
        ].map { m.backing($0) }
        m.unmount()
        let cb = 4096 + 40
        var bytesOf: [String: [UInt8]] = [:]
        for p in b { bytesOf[p] = [UInt8](try Data(contentsOf: URL(fileURLWithPath: p))) }
        // cut: at a block boundary (no data lost; the end is re-sealed)
        setBytes(b[0], Array(bytesOf[b[0]]![0..<(320 + 5 * cb)]))
        // torn: the last block garbled as a torn write leaves it
        var torn = bytesOf[b[1]]!
        for i in (torn.count - 300)..<torn.count { torn[i] = 0xEE }
        setBytes(b[1], torn)
        // fragment: 10 bytes of a block that never completed (after whole blocks)
        setBytes(b[2], bytesOf[b[2]]! + [UInt8](repeating: 7, count: 10))
        // middle: a damaged block inside the file
        var mid = bytesOf[b[3]]!
        mid[320 + 2 * cb + 100] ^= 1
        setBytes(b[3], mid)
        // headerless: 0 bytes, as a crash during create left files before
        setBytes(b[4], [])
        // badheader: the file key's wrap is damaged
        var bad = bytesOf[b[5]]!
        bad[70] ^= 1
        setBytes(b[5], bad)
        // the file with an xattr set disappears offline: its set is an orphan
        XCTAssertEqual(unlink(b[6]), 0)
        // a long name's entry disappears: its side file is an orphan
        XCTAssertEqual(unlink(b[7]), 0)
        // a temporary of an interrupted atomic write
        XCTAssertTrue(
            FileManager.default.createFile(atPath: m.store + "/data/.kbfs-tmp-leftover", contents: Data([1, 2, 3])))
        let expected = [
            "block-damaged", "end-not-sealed", "header-damaged", "no-header", "side-file-orphan", "temporary",
            "torn-fragment", "torn-tail", "xattr-orphan",
        ]

        let check = m.fsck()
        XCTAssertEqual(check.code, 1)
        XCTAssertEqual(kinds(check.problems), expected)
        XCTAssertTrue(
            check.problems.allSatisfy { ["repairable", "drops-data", "not-repairable"].contains($0.repair) },
            "\(check.problems)")
        XCTAssertEqual(
            check.problems.first { $0.kind == "xattr-orphan" }?.repair, "not-repairable",
            "kept while a header is unreadable")
        XCTAssertEqual(check.problems.first { $0.kind == "torn-tail" }?.repair, "drops-data")
        XCTAssertEqual(check.problems.first { $0.kind == "header-damaged" }?.repair, "not-repairable")
        // Without the passcode the class C contents are not read: no block problems.
        XCTAssertEqual(
            kinds(m.fsck(passcode: false).problems),
            ["header-damaged", "no-header", "side-file-orphan", "temporary", "torn-fragment", "xattr-orphan"])

        // --repair: everything that loses nothing.
        let r1 = m.fsck(["--repair"])
        XCTAssertEqual(r1.code, 1)
        for (k, rep) in r1.problems {
            let want =
                ["torn-tail", "block-damaged"].contains(k)
                ? "drops-data" : ["header-damaged", "xattr-orphan"].contains(k) ? "not-repairable" : "repaired"
            XCTAssertEqual(rep, want, k)
        }
        try m.mount()
        m.unlock()
        XCTAssertEqual(
            try readFile(m.path("cut")).get(), Array(data[0..<(5 * 4096)]), "the cut file reads up to its cut")
        XCTAssertEqual(try readFile(m.path("fragment")).get(), whole)
        XCTAssertEqual(try readFile(m.path("headerless")).get(), [])
        XCTAssertEqual(errnoOf(readFile(m.path("torn"))), EIO, "before --yes the torn tail stays")
        XCTAssertEqual(unlink(m.path("badheader")), 0, "a file whose key is lost can be deleted")
        XCTAssertEqual(rmdir(m.path("d")), 0)
        m.unmount()

        // --repair --yes: the data-dropping repairs too; then the store is clean.
        let r2 = m.fsck(["--repair", "--yes"])
        XCTAssertEqual(kinds(r2.problems), ["block-damaged", "torn-tail", "xattr-orphan"])
        XCTAssertTrue(r2.problems.allSatisfy { $0.repair == "repaired" }, "\(r2.problems)")
        XCTAssertEqual(m.fsck().code, 0, "clean after repair")
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("torn")).get(), Array(data[0..<(7 * 4096)]), "cut after the last good block")
        var want = data
        want.replaceSubrange((2 * 4096)..<(3 * 4096), with: [UInt8](repeating: 0, count: 4096))
        XCTAssertEqual(try readFile(m.path("middle")).get(), want, "the damaged block reads as zeros, the rest is kept")
        XCTAssertEqual(
            try FileManager.default.contentsOfDirectory(atPath: m.mnt).sorted(),
            ["cut", "fragment", "headerless", "middle", "torn"])
    }
}
