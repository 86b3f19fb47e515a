import Foundation
import Glibc
import XCTest

/// `--inactivity-relock`: a device locked longer than the limit returns to
/// `beforeFirstUnlock`: class C keys go, open class B and C handles stop working, only
/// `none` stays readable; an unlock before the limit cancels it.
final class InactivityRelockTests: XCTestCase {
    /// 0.0005 hours = 1.8 s.
    static let hours = "0.0005"

    func classedMount() throws -> MountFixture {
        let m = try MountFixture(mount: false)
        try m.mount(extra: ["--inactivity-relock", Self.hours])
        m.unlock()
        for (dir, cls) in [
            ("a", "complete"), ("b", "completeUnlessOpen"), ("c", "completeUntilFirstUserAuthentication"),
            ("d", "none"),
        ] {
            XCTAssertEqual(mkdir(m.path(dir), 0o755), 0)
            XCTAssertEqual(setXattr(m.path(dir), cls), 0)
            XCTAssertEqual(writeFile(m.path(dir + "/f"), bytes("data of " + cls)), 0)
        }
        return m
    }

    func testLockedPastTheLimitOnlyNoneStaysReadable() throws {
        let m = try classedMount()
        addTeardownBlock { m.close() }
        let watch = try WatchCollector(m)
        defer { watch.stop() }
        let heldB = sysOpen(m.path("b/f"), O_RDONLY)
        let heldC = sysOpen(m.path("c/f"), O_RDONLY)
        XCTAssertGreaterThanOrEqual(heldB, 0)
        XCTAssertGreaterThanOrEqual(heldC, 0)
        defer { close(heldB); close(heldC) }

        m.lock()
        var st = m.status()
        XCTAssertEqual(st["state"] as? String, "locked")
        XCTAssertEqual(st["inactivityRelock"] as? Double, 0.0005)
        XCTAssertLessThanOrEqual(st["relockIn"] as? Int ?? 99, 2)
        // Right after the lock: class C and the open class B handle still read.
        XCTAssertEqual(try readFile(m.path("c/f")).get(), bytes("data of completeUntilFirstUserAuthentication"))
        XCTAssertEqual(try sysPread(heldB, 64, 0).get(), bytes("data of completeUnlessOpen"))

        XCTAssertTrue(
            waitUntil(10) { m.status()["state"] as? String == "beforeFirstUnlock" }, "back to beforeFirstUnlock")
        watch.wait(for: 3)
        XCTAssertEqual(
            Array(watch.events.suffix(3)),
            [
                "protectedDataWillBecomeUnavailable", "protectedDataDidBecomeUnavailable",
                "deviceDidReturnToBeforeFirstUnlock",  // the contract's name (SPEC.md §2)
            ])
        st = m.status()
        XCTAssertTrue(st["relockIn"] is NSNull, "\(st)")
        XCTAssertEqual(errnoOf(readFile(m.path("c/f"))), EACCES, "class C is gone")
        XCTAssertEqual(errnoOf(sysPread(heldC, 64, 0)), EACCES, "even through a handle opened before")
        XCTAssertEqual(errnoOf(sysPread(heldB, 64, 0)), EACCES, "an open class B handle too")
        XCTAssertEqual(errnoOf(readFile(m.path("a/f"))), EACCES)
        XCTAssertEqual(try readFile(m.path("d/f")).get(), bytes("data of none"), "none stays readable")
        XCTAssertEqual(sysOpen(m.path("c/new"), O_CREAT | O_WRONLY), -EACCES, "no new class C file")
        XCTAssertEqual(
            sysOpen(m.path("b/new"), O_CREAT | O_WRONLY), -EACCES, "no new class B file: its public key went too")

        // The passcode brings everything back.
        m.unlock()
        XCTAssertEqual(try readFile(m.path("c/f")).get(), bytes("data of completeUntilFirstUserAuthentication"))
        XCTAssertEqual(try readFile(m.path("a/f")).get(), bytes("data of complete"))
        XCTAssertEqual(
            try sysPread(heldC, 64, 0).get(), bytes("data of completeUntilFirstUserAuthentication"),
            "the old handle reads again")
    }

    // The kernel takes a full-page write through a cached handle into its page cache without
    // asking the daemon; after the return to beforeFirstUnlock, old class B and C handles
    // must still be refused (and nothing written read back), as class A's are after a lock.
    func testFullPageWritesThroughOldHandlesAreRefusedAfterTheReturn() throws {
        let m = try classedMount()
        addTeardownBlock { m.close() }
        var held: [String: Int32] = [:]
        for dir in ["b", "c"] {
            let fd = sysOpen(m.path(dir + "/f"), O_RDWR)
            XCTAssertGreaterThanOrEqual(fd, 0)
            held[dir] = fd
        }
        defer { held.values.forEach { close($0) } }
        m.lock()
        XCTAssertTrue(
            waitUntil(10) { m.status()["state"] as? String == "beforeFirstUnlock" }, "back to beforeFirstUnlock")
        for (dir, fd) in held.sorted(by: { $0.key < $1.key }) {
            for round in 0..<3 {
                var st = stat()
                XCTAssertEqual(stat(m.path(dir + "/f"), &st), 0, "metadata stays")
                let w = sysPwrite(fd, [UInt8](repeating: 0x5a, count: 4096), 8192)
                XCTAssertEqual(
                    errnoOf(w), EACCES, "\(dir) round \(round): a full-page write through an old handle (returned \(w))"
                )
                XCTAssertEqual(errnoOf(sysPread(fd, 4096, 8192)), EACCES, "\(dir) round \(round): read back")
            }
        }
        m.unlock()
        for dir in ["b", "c"] {
            let cls = dir == "b" ? "completeUnlessOpen" : "completeUntilFirstUserAuthentication"
            XCTAssertEqual(try readFile(m.path(dir + "/f")).get(), bytes("data of " + cls), "\(dir) after unlock")
        }
    }

    func testAnUnlockBeforeTheLimitCancelsIt() throws {
        let m = try classedMount()
        addTeardownBlock { m.close() }
        m.lock()
        usleep(900_000)
        m.unlock()
        m.lock()  // a new lock starts a new clock
        usleep(1_200_000)
        XCTAssertEqual(m.status()["state"] as? String, "locked", "1.2 s into the second lock (2.1 s since the first)")
        XCTAssertEqual(try readFile(m.path("c/f")).get(), bytes("data of completeUntilFirstUserAuthentication"))
        XCTAssertTrue(waitUntil(10) { m.status()["state"] as? String == "beforeFirstUnlock" })
    }

    func testWithoutTheOptionALockNeverEnds() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        m.lock()
        let st = m.status()
        XCTAssertTrue(st["inactivityRelock"] is NSNull, "\(st)")
        XCTAssertTrue(st["relockIn"] is NSNull, "\(st)")
        let bad = MountFixture.run(
            MountFixture.binDir + "/keybagfs", ["mount", m.store, m.root, "--inactivity-relock", "0"])
        XCTAssertEqual(bad.code, 2, bad.stderr)
    }
}
