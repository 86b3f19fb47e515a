import Foundation
import Glibc
import XCTest

/// The access matrix of SPEC §2: every class in every state, through the real mount.
final class ClassMatrixTests: XCTestCase {
    static let classes = ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"]

    /// Makes one directory per class (its default) with one file in it.
    func makeClassDirs(_ m: MountFixture) {
        for c in Self.classes {
            XCTAssertEqual(mkdir(m.path(c), 0o755), 0)
            XCTAssertEqual(setXattr(m.path(c), c), 0, "set default \(c)")
            XCTAssertEqual(writeFile(m.path("\(c)/f"), bytes("content of \(c)")), 0, "create in \(c)")
            XCTAssertEqual(try getXattr(m.path("\(c)/f")).get(), c, "inherited class")
        }
    }

    func testLockedMatrixAndHandlesOpenedBeforeLock() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(m.state, "unlocked")
        makeClassDirs(m)

        // Descriptors opened (and read, so the page cache is warm) before the lock.
        var fds: [String: Int32] = [:]
        for c in Self.classes {
            let fd = sysOpen(m.path("\(c)/f"), O_RDWR)
            XCTAssertGreaterThanOrEqual(fd, 0)
            XCTAssertEqual(try sysPread(fd, 100, 0).get(), bytes("content of \(c)"))
            fds[c] = fd
        }
        defer { fds.values.forEach { close($0) } }

        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked")
        XCTAssertEqual(m.status()["protectedDataAvailable"] as? Bool, false)

        // complete: EACCES through the old fd (no page-cache plaintext), on open and on create.
        XCTAssertEqual(errnoOf(sysPread(fds["complete"]!, 100, 0)), EACCES)
        XCTAssertEqual(errnoOf(sysPwrite(fds["complete"]!, bytes("x"), 0)), EACCES)
        XCTAssertEqual(sysOpen(m.path("complete/f"), O_RDONLY), -EACCES)
        XCTAssertEqual(sysOpen(m.path("complete/new"), O_WRONLY | O_CREAT), -EACCES)
        XCTAssertEqual(truncate(m.path("complete/f"), 0) == 0 ? 0 : errno, EACCES)

        // completeUnlessOpen: old handle keeps reading and writing; new opens refused;
        // new files can still be created (public key only).
        let b = fds["completeUnlessOpen"]!
        XCTAssertEqual(try sysPread(b, 100, 0).get(), bytes("content of completeUnlessOpen"))
        XCTAssertEqual(try sysPwrite(b, bytes("CONTENT"), 0).get(), 7)
        XCTAssertEqual(try sysPread(b, 7, 0).get(), bytes("CONTENT"))
        XCTAssertEqual(sysOpen(m.path("completeUnlessOpen/f"), O_RDONLY), -EACCES)
        let nb = sysOpen(m.path("completeUnlessOpen/created-while-locked"), O_RDWR | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(nb, 0, "class B create while locked")
        XCTAssertEqual(try sysPwrite(nb, bytes("written while locked"), 0).get(), 20)
        XCTAssertEqual(try sysPread(nb, 100, 0).get(), bytes("written while locked"))
        close(nb)
        XCTAssertEqual(
            sysOpen(m.path("completeUnlessOpen/created-while-locked"), O_RDONLY), -EACCES,
            "after close, reopen needs unlock")

        // completeUntilFirstUserAuthentication and none: everything works while locked.
        for c in ["completeUntilFirstUserAuthentication", "none"] {
            XCTAssertEqual(try sysPread(fds[c]!, 100, 0).get(), bytes("content of \(c)"))
            XCTAssertEqual(try readFile(m.path("\(c)/f")).get(), bytes("content of \(c)"))
            XCTAssertEqual(writeFile(m.path("\(c)/new"), bytes("new \(c)")), 0)
            XCTAssertEqual(try readFile(m.path("\(c)/new")).get(), bytes("new \(c)"))
        }

        // Metadata works in every state.
        var st = stat()
        XCTAssertEqual(stat(m.path("complete/f"), &st), 0)
        XCTAssertEqual(st.st_size, off_t("content of complete".utf8.count))
        XCTAssertEqual(try getXattr(m.path("complete/f")).get(), "complete")
        XCTAssertEqual(Set(try FileManager.default.contentsOfDirectory(atPath: m.path("complete"))), ["f"])
        XCTAssertEqual(rename(m.path("complete/f"), m.path("complete/g")), 0)
        XCTAssertEqual(link(m.path("complete/g"), m.path("complete/h")), 0)
        XCTAssertEqual(chmod(m.path("complete/g"), 0o600), 0)
        XCTAssertEqual(mkdir(m.path("complete/sub"), 0o755), 0)
        XCTAssertEqual(symlink("g", m.path("complete/sym")), 0)
        XCTAssertEqual(unlink(m.path("complete/h")), 0)
        XCTAssertEqual(rmdir(m.path("complete/sub")), 0)

        // Unlock: the old class A descriptor works again; the class B file made while locked reads back.
        m.unlock()
        XCTAssertEqual(try sysPread(fds["complete"]!, 100, 0).get(), bytes("content of complete"))
        XCTAssertEqual(try readFile(m.path("complete/g")).get(), bytes("content of complete"))
        XCTAssertEqual(
            try readFile(m.path("completeUnlessOpen/created-while-locked")).get(), bytes("written while locked"))
        XCTAssertEqual(try readFile(m.path("completeUnlessOpen/f")).get(), bytes("CONTENT of completeUnlessOpen"))
    }

    func testMmapOfCompleteFileFaultsAfterLock() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("a"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("a"), "complete"), 0)
        let data = [UInt8](repeating: 0x41, count: 3 * 4096)
        XCTAssertEqual(writeFile(m.path("a/f"), data), 0)
        // A child process maps and reads the file, waits for the lock, then touches the
        // mapping again: it must die of SIGBUS rather than read plaintext.
        let script = """
            import mmap, os, sys, time
            f = open(sys.argv[1], 'rb'); mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            assert mm[0:4] == b'AAAA'; print('mapped', flush=True)
            while not os.path.exists(sys.argv[2]): time.sleep(0.02)
            print('read', mm[4096:4100], flush=True)
            """
        let p = Process()
        p.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        p.arguments = ["python3", "-c", script, m.path("a/f"), m.root + "/locked"]
        let out = Pipe()
        p.standardOutput = out
        try p.run()
        var seen = Data()
        while !String(decoding: seen, as: UTF8.self).contains("mapped") {
            let d = out.fileHandleForReading.availableData
            if d.isEmpty { break }
            seen += d
        }
        XCTAssertTrue(String(decoding: seen, as: UTF8.self).contains("mapped"))
        m.lock(grace: 0)
        _ = FileManager.default.createFile(atPath: m.root + "/locked", contents: nil)
        p.waitUntilExit()
        let rest = String(decoding: out.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        XCTAssertFalse(rest.contains("AAAA"), "mapping served plaintext after lock")
        XCTAssertEqual(p.terminationReason, .uncaughtSignal)
        XCTAssertEqual(p.terminationStatus, SIGBUS)
    }

    func testBeforeFirstUnlockAndRestartSemantics() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        makeClassDirs(m)
        try m.restart()
        XCTAssertEqual(m.state, "beforeFirstUnlock")
        // Class D is readable right after a restart; every other class is not.
        XCTAssertEqual(try readFile(m.path("none/f")).get(), bytes("content of none"))
        XCTAssertEqual(writeFile(m.path("none/g"), bytes("d")), 0)
        for c in ["completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"] {
            XCTAssertEqual(sysOpen(m.path("\(c)/f"), O_RDONLY), -EACCES, c)
            XCTAssertEqual(sysOpen(m.path("\(c)/new"), O_WRONLY | O_CREAT), -EACCES, "create \(c) before first unlock")
            XCTAssertEqual(try getXattr(m.path("\(c)/f")).get(), c, "class readable as metadata")
        }
        // Lock before the first unlock changes nothing.
        m.lock(grace: 0)
        XCTAssertEqual(m.state, "beforeFirstUnlock")
        m.unlock()
        m.lock(grace: 0)
        // Class C survives a lock once unlocked since start...
        XCTAssertEqual(
            try readFile(m.path("completeUntilFirstUserAuthentication/f")).get(),
            bytes("content of completeUntilFirstUserAuthentication"))
        // ...but not a restart.
        try m.restart()
        XCTAssertEqual(sysOpen(m.path("completeUntilFirstUserAuthentication/f"), O_RDONLY), -EACCES)
        m.unlock()
        for c in Self.classes { XCTAssertEqual(try readFile(m.path("\(c)/f")).get(), bytes("content of \(c)")) }
    }
}
