import Foundation
import Glibc
import KeybagCore
import XCTest

/// Encrypted names, long names, symlink targets; the store reveals no name.
final class NameTests: XCTestCase {
    static let long255 = String(repeating: "L", count: 250) + ".long"
    static let utf8Long = String(repeating: "é", count: 127) + "x"  // 255 bytes
    static let names = ["plain.txt", ".hidden", "Ünïcödé 名前.md", long255, utf8Long, "kbl.x", ".kbfs-dir", "a b;c'd\"e"]

    func testStoreRevealsNoKnownNameAndNamesRoundTrip() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(Self.long255.utf8.count, 255)
        XCTAssertEqual(Self.utf8Long.utf8.count, 255)
        XCTAssertEqual(mkdir(m.path("SecretFolderName"), 0o755), 0)
        for n in Self.names {
            XCTAssertEqual(writeFile(m.path("SecretFolderName/" + n), bytes("content of \(n)")), 0, n)
        }
        XCTAssertEqual(mkdir(m.path(Self.long255 + "d"), 0o755) == 0 ? 0 : errno, ENAMETOOLONG)
        XCTAssertEqual(writeFile(m.path(String(repeating: "z", count: 256)), bytes("x")), ENAMETOOLONG)
        let listed = Set(try FileManager.default.contentsOfDirectory(atPath: m.path("SecretFolderName")))
        XCTAssertEqual(listed, Set(Self.names))
        for n in Self.names {
            XCTAssertEqual(try readFile(m.path("SecretFolderName/" + n)).get(), bytes("content of \(n)"), n)
        }
        // Same plaintext name in two directories: different stored names.
        XCTAssertEqual(mkdir(m.path("other"), 0o755), 0)
        XCTAssertEqual(writeFile(m.path("other/plain.txt"), bytes("x")), 0)
        XCTAssertNotEqual(
            (m.backing("other/plain.txt") as NSString).lastPathComponent,
            (m.backing("SecretFolderName/plain.txt") as NSString).lastPathComponent)
        m.unmount()
        var leaks: [String] = []
        let e = FileManager.default.enumerator(atPath: m.store)!
        while let rel = e.nextObject() as? String {
            for n in Self.names + ["SecretFolderName", "other", "content of"] where n != ".kbfs-dir" && n != "kbl.x" {
                let probe = n.count > 20 ? String(n.prefix(20)) : n
                if rel.contains(probe) { leaks.append(rel) }
            }
            if let d = FileManager.default.contents(atPath: m.store + "/" + rel),
                d.range(of: Data("SecretFolderName".utf8)) != nil || d.range(of: Data("content of".utf8)) != nil
            {
                leaks.append(rel + " (contents)")
            }
        }
        XCTAssertEqual(leaks, [])
        // Every backing name fits NAME_MAX.
        let e2 = FileManager.default.enumerator(atPath: m.store)!
        while let rel = e2.nextObject() as? String {
            XCTAssertLessThanOrEqual((rel as NSString).lastPathComponent.utf8.count, 255)
        }
    }

    func testNamesThatAreNotUTF8AreRefusedNotMangled() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        var raw = Array((m.mnt + "/caf").utf8) + [0xE9, 0]  // Latin-1 "café"
        let fd = raw.withUnsafeMutableBufferPointer { b in
            b.baseAddress!.withMemoryRebound(to: CChar.self, capacity: b.count) {
                open($0, O_WRONLY | O_CREAT | O_CLOEXEC, 0o644)
            }
        }
        XCTAssertEqual(fd, -1)
        XCTAssertEqual(errno, EILSEQ)
        XCTAssertEqual(
            try FileManager.default.contentsOfDirectory(atPath: m.mnt), [], "nothing created under another name")
    }

    func testLongNamesInEveryOperation() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let a = Self.long255, b = Self.utf8Long
        let c = String(repeating: "c", count: 200)
        XCTAssertEqual(mkdir(m.path(c), 0o755), 0, "mkdir long")
        XCTAssertEqual(writeFile(m.path(c + "/" + a), bytes("A")), 0, "create long")
        var st = stat()
        XCTAssertEqual(stat(m.path(c + "/" + a), &st), 0, "lookup long")
        XCTAssertEqual(rename(m.path(c + "/" + a), m.path(c + "/" + b)), 0, "rename long → long")
        XCTAssertEqual(stat(m.path(c + "/" + a), &st), -1)
        XCTAssertEqual(try readFile(m.path(c + "/" + b)).get(), bytes("A"))
        XCTAssertEqual(link(m.path(c + "/" + b), m.path(a)), 0, "link long across directories")
        XCTAssertEqual(try readFile(m.path(a)).get(), bytes("A"))
        XCTAssertEqual(symlink(c + "/" + b, m.path("s" + String(a.dropFirst()))), 0, "symlink long")
        XCTAssertEqual(try readFile(m.path("s" + String(a.dropFirst()))).get(), bytes("A"))
        XCTAssertEqual(
            Set(try FileManager.default.contentsOfDirectory(atPath: m.mnt)), Set([c, a, "s" + String(a.dropFirst())]))
        XCTAssertEqual(rename(m.path(c + "/" + b), m.path(c + "/short")), 0, "rename long → short")
        XCTAssertEqual(Set(try FileManager.default.contentsOfDirectory(atPath: m.path(c))), ["short"])
        XCTAssertEqual(unlink(m.path(c + "/short")), 0)
        XCTAssertEqual(unlink(m.path(a)), 0, "unlink long")
        XCTAssertEqual(unlink(m.path("s" + String(a.dropFirst()))), 0)
        XCTAssertEqual(rmdir(m.path(c)), 0, "rmdir long (side files gone with their entries)")
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.mnt), [])
        // Long-name side data survives a remount.
        XCTAssertEqual(writeFile(m.path(a), bytes("again")), 0)
        try m.restart()
        m.unlock()
        XCTAssertEqual(try readFile(m.path(a)).get(), bytes("again"))
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.mnt), [a])
    }

    func testSymlinkTargetsUpTo4095BytesEncrypted() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        let short = "../target/file.txt"
        let long = String(repeating: "d/", count: 2047) + "x"  // 4095 bytes
        XCTAssertEqual(long.utf8.count, 4095)
        XCTAssertEqual(symlink(short, m.path("short")), 0)
        XCTAssertEqual(symlink(long, m.path("long")), 0)
        func target(_ p: String) -> String {
            var buf = [CChar](repeating: 0, count: 8192)
            let n = readlink(p, &buf, buf.count)
            return n < 0 ? "errno \(errno)" : String(decoding: buf[0..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self)
        }
        XCTAssertEqual(target(m.path("short")), short)
        XCTAssertEqual(target(m.path("long")), long)
        var st = stat()
        XCTAssertEqual(lstat(m.path("long"), &st), 0)
        XCTAssertEqual(st.st_mode & S_IFMT, S_IFLNK)
        XCTAssertEqual(rename(m.path("long"), m.path("long2")), 0)
        XCTAssertEqual(target(m.path("long2")), long)
        try m.restart()  // targets are metadata: readable before the first unlock
        XCTAssertEqual(target(m.path("long2")), long)
        XCTAssertEqual(target(m.path("short")), short)
        m.unmount()
        let all = (FileManager.default.enumerator(atPath: m.store)?.allObjects as? [String]) ?? []
        for rel in all {
            var b = [CChar](repeating: 0, count: 8192)
            let n = readlink(m.store + "/" + rel, &b, b.count)
            if n > 0 {
                XCTAssertFalse(
                    String(decoding: b[0..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self).contains("target/file"))
            }
        }
        try m.mount()
        XCTAssertEqual(unlink(m.path("long2")), 0)
        m.unmount()
        let targets = try FileManager.default.contentsOfDirectory(atPath: m.store + "/targets")
        XCTAssertEqual(targets, [], "a long target goes with its last link")
    }

    /// A store writer puts a FIFO where a long symlink target's file was: readlink answers EIO
    /// at once (the daemon never opens a FIFO for reading, which would block its thread).
    func testLongTargetReplacedByFIFOAnswersEIOWithoutBlocking() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(symlink(String(repeating: "t/", count: 2000), m.path("long")), 0)
        XCTAssertEqual(writeFile(m.path("other"), bytes("o")), 0)
        m.unmount()
        let ids = try FileManager.default.contentsOfDirectory(atPath: m.store + "/targets")
        XCTAssertEqual(ids.count, 1)
        for id in ids {
            XCTAssertEqual(unlink(m.store + "/targets/" + id), 0)
            XCTAssertEqual(mkfifo(m.store + "/targets/" + id, 0o600), 0)
        }
        try m.mount()
        m.unlock()
        // On a thread: a readlink the daemon never answers is released only by killing it.
        let done = DispatchSemaphore(value: 0)
        let answer = Locked<(Int, Int32)>((0, 0))
        let path = m.path("long")
        Thread {
            var buf = [CChar](repeating: 0, count: 8192)
            let n = readlink(path, &buf, buf.count)
            answer.withLock { $0 = (n, errno) }
            done.signal()
        }.start()
        guard done.wait(timeout: .now() + 5) == .success else {
            XCTFail("readlink of a long target that is a FIFO in the store blocked")
            m.close()
            _ = done.wait(timeout: .now() + 10)
            return
        }
        let (n, err) = answer.withLock { $0 }
        XCTAssertEqual(n, -1)
        XCTAssertEqual(err, EIO)
        XCTAssertEqual(try readFile(m.path("other")).get(), bytes("o"), "the daemon still serves")
    }

    func testCorruptStoredNameIsSkippedAndLogged() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("keep"), bytes("k")), 0)
        XCTAssertEqual(writeFile(m.path("victim"), bytes("v")), 0)
        let victim = m.backing("victim")
        m.unmount()
        // Alter one character of the stored name (still valid base64url).
        var chars = Array((victim as NSString).lastPathComponent)
        chars[5] = chars[5] == "A" ? "B" : "A"
        XCTAssertEqual(rename(victim, (victim as NSString).deletingLastPathComponent + "/" + String(chars)), 0)
        try m.mount()
        m.unlock()
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.mnt), ["keep"])
        var st = stat()
        XCTAssertEqual(stat(m.path("victim"), &st), -1)
        XCTAssertEqual(try readFile(m.path("keep")).get(), bytes("k"), "daemon still serving")
        let log = (try? String(contentsOfFile: m.root + "/daemon.log", encoding: .utf8)) ?? ""
        XCTAssertTrue(log.contains("does not decrypt"), log)
    }

    /// A sync engine (Syncthing) that finds a file changed on two devices keeps the losing
    /// version as `NAME.sync-conflict-DATE-TIME-DEVICE`. Placed in the store under a live
    /// mount, it shows next to the file under a readable name, both read, fsck is clean, and
    /// the user resolves the conflict through the mount.
    func testSyncConflictCopiesShowUnderReadableNamesAndBothRead() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("docs"), 0o755), 0)
        let theirs = bytes("the other device's version"), ours = bytes("this device's version, a little longer")
        XCTAssertEqual(writeFile(m.path("docs/report.txt"), theirs), 0)
        XCTAssertEqual(setXattr(m.path("docs/report.txt"), "blue", "user.tag"), 0)
        let fd = open(m.path("docs/report.txt"), O_RDONLY)
        XCTAssertEqual(fsync(fd), 0)
        close(fd)
        let backing = m.backing("docs/report.txt")
        let saved = m.root + "/theirs"
        try FileManager.default.copyItem(atPath: backing, toPath: saved)
        XCTAssertEqual(writeFile(m.path("docs/report.txt"), ours), 0)
        XCTAssertEqual(rename(saved, backing + ".sync-conflict-20261125-101010-HOSTB27"), 0)
        let shown = "report (conflict 2026-11-25 101010 HOSTB27).txt"
        XCTAssertEqual(Set(try FileManager.default.contentsOfDirectory(atPath: m.path("docs"))), ["report.txt", shown])
        XCTAssertEqual(try readFile(m.path("docs/report.txt")).get(), ours)
        XCTAssertEqual(try readFile(m.path("docs/" + shown)).get(), theirs)
        var st = stat()
        XCTAssertEqual(
            stat(m.path("docs/report (conflict 2026-11-25  101010 HOSTB27).txt"), &st), -1,
            "only the exact readable name finds the copy")
        m.unmount()
        let check = m.fsck()
        XCTAssertEqual(check.code, 0, "\(check.out)")
        XCTAssertEqual(check.problems.map(\.kind), [], "a conflict copy is not a damaged name")
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("docs/" + shown)).get(), theirs, "after a restart too")
        // Resolved by keeping the other device's version under the file's name: the xattrs
        // the two versions share stay.
        XCTAssertEqual(rename(m.path("docs/" + shown), m.path("docs/report.txt")), 0)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.path("docs")), ["report.txt"])
        XCTAssertEqual(try readFile(m.path("docs/report.txt")).get(), theirs)
        XCTAssertEqual(try getXattr(m.path("docs/report.txt"), "user.tag").get(), "blue")
        // A file really named like a conflict copy is a file of its own, and wins over a copy
        // that would show under the same name.
        XCTAssertEqual(writeFile(m.path("docs/" + shown), ours), 0)
        let docs = (backing as NSString).deletingLastPathComponent
        XCTAssertFalse(
            try FileManager.default.contentsOfDirectory(atPath: docs).contains { $0.contains(".sync-conflict-") })
        try FileManager.default.copyItem(
            atPath: m.backing("docs/report.txt"), toPath: backing + ".sync-conflict-20261125-101010-HOSTB27")
        XCTAssertEqual(
            try FileManager.default.contentsOfDirectory(atPath: m.path("docs")).sorted(),
            [shown, "report.txt"].sorted())
        XCTAssertEqual(try readFile(m.path("docs/" + shown)).get(), ours)
    }

    func testSyncConflictCopiesOfLongNamesShowAndKeepTheirName() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let long = String(repeating: "quarterly report ", count: 11) + "final.txt"  // 196 bytes: a hashed name
        let theirs = bytes("the other device's version"), ours = bytes("this device's version, a little longer")
        XCTAssertEqual(writeFile(m.path(long), theirs), 0)
        let fd = open(m.path(long), O_RDONLY)
        XCTAssertEqual(fsync(fd), 0)
        close(fd)
        let backing = m.backing(long)
        let hashed = (backing as NSString).lastPathComponent
        XCTAssertTrue(hashed.hasPrefix("kbl."), hashed)
        let saved = m.root + "/theirs"
        try FileManager.default.copyItem(atPath: backing, toPath: saved)
        XCTAssertEqual(writeFile(m.path(long), ours), 0)
        // Syncthing takes `.H` as the extension: kbl.sync-conflict-DATE-TIME-DEVICE.H
        let copy = (m.store + "/data/") + "kbl.sync-conflict-20261125-101010-HOSTB27." + hashed.dropFirst(4)
        XCTAssertEqual(rename(saved, copy), 0)
        let shown = String(repeating: "quarterly report ", count: 11) + "final (conflict 2026-11-25 101010 HOSTB27).txt"
        XCTAssertEqual(Set(try FileManager.default.contentsOfDirectory(atPath: m.mnt)), [long, shown])
        XCTAssertEqual(try readFile(m.path(long)).get(), ours)
        XCTAssertEqual(try readFile(m.path(shown)).get(), theirs)
        m.unmount()
        let check = m.fsck(["--repair", "--yes"])
        XCTAssertEqual(check.code, 0, "\(check.out)")
        XCTAssertEqual(check.problems.map(\.kind), [], "a conflict copy of a long name is not damage")
        try m.mount()
        m.unlock()
        // Resolved by keeping this device's version: deleting the file first leaves the copy
        // its name (the side file they share stays), then the copy goes too.
        XCTAssertEqual(unlink(m.path(long)), 0)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.mnt), [shown])
        XCTAssertEqual(try readFile(m.path(shown)).get(), theirs)
        XCTAssertEqual(rename(m.path(shown), m.path(long)), 0)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.mnt), [long])
        XCTAssertEqual(try readFile(m.path(long)).get(), theirs)
        m.unmount()
        XCTAssertEqual(m.fsck().code, 0)
    }

    func testCopyOfStoreWithoutXattrsRestoresEverything() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("docs"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("docs"), "complete"), 0)
        var expected: [String: [UInt8]] = [:]
        var rng = SeededBytes(seed: 5)
        for n in Self.names {
            expected["docs/" + n] = rng.bytes(rng.int(0..<20000))
            XCTAssertEqual(writeFile(m.path("docs/" + n), expected["docs/" + n]!), 0)
        }
        XCTAssertEqual(symlink("docs/plain.txt", m.path("link")), 0)
        m.unmount()
        XCTAssertEqual(rename(m.store, m.store + ".orig"), 0)
        let cp = MountFixture.run("/bin/cp", ["-a", "--no-preserve=xattr", m.store + ".orig", m.store])
        XCTAssertEqual(cp.code, 0, cp.stderr)
        try FileManager.default.removeItem(atPath: m.store + ".orig")
        try m.mount()
        m.unlock()
        for (p, want) in expected { XCTAssertEqual(try readFile(m.path(p)).get(), want, p) }
        XCTAssertEqual(try getXattr(m.path("docs")).get(), "complete")
        XCTAssertEqual(try getXattr(m.path("docs/plain.txt")).get(), "complete")
        XCTAssertEqual(try readFile(m.path("link")).get(), expected["docs/plain.txt"]!)
    }
}
