import CFuse
import Foundation
import Glibc
import XCTest

/// The xattr user.protection: values, aliases, errors, inheritance and rewrapping.
final class ProtectionXattrTests: XCTestCase {
    func testAClassChangeMovesTheStoredModificationTimeForward() throws {
        // Sync engines and backups see a changed file by its time and size: the rewritten
        // header must leave the backing file newer than before, even after the kernel (which
        // owns the times with the write-back cache) writes its own back.
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("f"), bytes("content")), 0)
        func backingMTime() -> timespec {
            var st = stat()
            XCTAssertEqual(stat(m.backing("f"), &st), 0)
            return st.st_mtim
        }
        let before = backingMTime()
        XCTAssertEqual(setXattr(m.path("f"), "complete"), 0)
        let fd = open(m.path("f"), O_RDONLY)
        XCTAssertEqual(fsync(fd), 0)  // the kernel writes its times back
        close(fd)
        let after = backingMTime()
        XCTAssertTrue(
            (after.tv_sec, after.tv_nsec) > (before.tv_sec, before.tv_nsec),
            "stored time \(after) not after \(before)")
        XCTAssertEqual(try readFile(m.path("f")).get(), bytes("content"))
        // A later write moves it on as usual.
        XCTAssertEqual(writeFile(m.path("f"), bytes("more")), 0)
        let later = backingMTime()
        XCTAssertTrue((later.tv_sec, later.tv_nsec) >= (after.tv_sec, after.tv_nsec))
    }

    func testValuesAliasesInheritanceAndErrors() throws {
        let m = try MountFixture(defaultClass: "none")
        addTeardownBlock { m.close() }
        m.unlock()
        // The mount's --default-class applies where no ancestor sets one.
        XCTAssertEqual(writeFile(m.path("top"), bytes("t")), 0)
        XCTAssertEqual(try getXattr(m.path("top")).get(), "none")
        XCTAssertEqual(errnoOf(getXattr(m.mnt)), ENODATA, "root has no stored default")

        // Nearest ancestor wins, through several levels.
        XCTAssertEqual(mkdir(m.path("a"), 0o755), 0)
        XCTAssertEqual(mkdir(m.path("a/b"), 0o755), 0)
        XCTAssertEqual(mkdir(m.path("a/b/c"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("a"), "NSFileProtectionComplete"), 0, "Apple alias accepted")
        XCTAssertEqual(try getXattr(m.path("a")).get(), "complete")
        XCTAssertEqual(errnoOf(getXattr(m.path("a/b"))), ENODATA, "a directory that inherits has no value")
        XCTAssertEqual(writeFile(m.path("a/b/c/f"), bytes("x")), 0)
        XCTAssertEqual(try getXattr(m.path("a/b/c/f")).get(), "complete")
        XCTAssertEqual(setXattr(m.path("a/b"), "completeUnlessOpen"), 0)
        XCTAssertEqual(writeFile(m.path("a/b/c/g"), bytes("x")), 0)
        XCTAssertEqual(try getXattr(m.path("a/b/c/g")).get(), "completeUnlessOpen")
        XCTAssertEqual(removexattr(m.path("a/b"), "user.protection"), 0)
        XCTAssertEqual(writeFile(m.path("a/b/c/h"), bytes("x")), 0)
        XCTAssertEqual(try getXattr(m.path("a/b/c/h")).get(), "complete")
        XCTAssertFalse(
            try FileManager.default.contentsOfDirectory(atPath: m.path("a")).contains { $0.hasPrefix(".kbfs") },
            "metadata file is hidden")
        XCTAssertEqual(rmdir(m.path("a/b/c")) == 0 ? 0 : errno, ENOTEMPTY)

        // Bad values: EINVAL and nothing changes.
        for bad in ["", "Complete", "classA", "complete2", "NSFileProtectionCompleteUntilFirstUserAuthenticationX"] {
            XCTAssertEqual(setXattr(m.path("top"), bad), EINVAL, "value \(bad)")
        }
        XCTAssertEqual(try getXattr(m.path("top")).get(), "none")
        XCTAssertEqual(
            removexattr(m.path("top"), "user.protection") == 0 ? 0 : errno, EPERM, "a file always has a class")

        // Size probing and ERANGE, and listing.
        XCTAssertEqual(getxattr(m.path("top"), "user.protection", nil, 0), 4)
        var small = [UInt8](repeating: 0, count: 2)
        XCTAssertEqual(getxattr(m.path("top"), "user.protection", &small, 2), -1)
        XCTAssertEqual(errno, ERANGE)
        var list = [CChar](repeating: 0, count: 256)
        let n = listxattr(m.path("top"), &list, 256)
        XCTAssertEqual(n, 16)
        XCTAssertEqual(
            String(decoding: list.prefix(15).map { UInt8(bitPattern: $0) }, as: UTF8.self), "user.protection")

        // A directory with a stored default can still be removed when empty.
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("d"), "complete"), 0)
        XCTAssertEqual(rmdir(m.path("d")), 0)
    }

    func testClassChangeRewrapsAndNeedsKeys() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        var rng = SeededBytes(seed: 7)
        let data = rng.bytes(50_000)
        XCTAssertEqual(writeFile(m.path("f"), data), 0)
        var before = [UInt8](repeating: 0, count: 0)
        let backing = m.backing("f")
        before = Array(try Data(contentsOf: URL(fileURLWithPath: backing)))
        // Walk through all classes: content unchanged, only the header changes.
        for c in [
            "complete", "completeUnlessOpen", "none", "completeUntilFirstUserAuthentication",
            "NSFileProtectionCompleteUnlessOpen",
        ] {
            XCTAssertEqual(setXattr(m.path("f"), c), 0, c)
            XCTAssertEqual(try readFile(m.path("f")).get(), data)
        }
        XCTAssertEqual(try getXattr(m.path("f")).get(), "completeUnlessOpen")
        let after = Array(try Data(contentsOf: URL(fileURLWithPath: backing)))
        XCTAssertEqual(Array(after[320...]), Array(before[320...]), "no re-encryption of data")

        // An open handle sees the new class: B → A, then lock → EACCES on that handle.
        let fd = sysOpen(m.path("f"), O_RDONLY)
        XCTAssertEqual(setXattr(m.path("f"), "complete"), 0)
        m.lock(grace: 0)
        XCTAssertEqual(errnoOf(sysPread(fd, 10, 0)), EACCES)
        close(fd)
        // While locked: moving a class A file needs its key (EACCES); a class C file may
        // become class B (public key suffices) but not class A.
        XCTAssertEqual(setXattr(m.path("f"), "none"), EACCES)
        XCTAssertEqual(writeFile(m.path("c"), bytes("c data")), 0)
        XCTAssertEqual(setXattr(m.path("c"), "complete"), EACCES)
        XCTAssertEqual(try getXattr(m.path("c")).get(), "completeUntilFirstUserAuthentication")
        XCTAssertEqual(setXattr(m.path("c"), "completeUnlessOpen"), 0)
        XCTAssertEqual(sysOpen(m.path("c"), O_RDONLY), -EACCES, "now class B, closed, locked")
        m.unlock()
        XCTAssertEqual(try readFile(m.path("c")).get(), bytes("c data"))
        // Survives a restart.
        try m.restart()
        m.unlock()
        XCTAssertEqual(try getXattr(m.path("f")).get(), "complete")
        XCTAssertEqual(try readFile(m.path("f")).get(), data)
    }
}

/// Other user.* xattrs: stored encrypted, with ext4's semantics.
final class UserXattrTests: XCTestCase {
    func testUserXattrsBehaveAsOnExt4AndAreEncrypted() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("f"), bytes("data")), 0)
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        for p in [m.path("f"), m.path("d")] {
            XCTAssertEqual(errnoOf(getXattr(p, "user.missing")), ENODATA)
            XCTAssertEqual(setXattr(p, "SECRET-XATTR-VALUE", "user.comment"), 0)
            XCTAssertEqual(try getXattr(p, "user.comment").get(), "SECRET-XATTR-VALUE")
            XCTAssertEqual(setXattr(p, "x", "user.comment", flags: kbfs_XATTR_CREATE), EEXIST)
            XCTAssertEqual(setXattr(p, "x", "user.other", flags: kbfs_XATTR_REPLACE), ENODATA)
            XCTAssertEqual(setXattr(p, "replaced", "user.comment", flags: kbfs_XATTR_REPLACE), 0)
            XCTAssertEqual(setXattr(p, "", "user.empty"), 0)
            XCTAssertEqual(try getXattr(p, "user.empty").get(), "")
            XCTAssertEqual(getxattr(p, "user.comment", nil, 0), 8, "size probe")
            var small = [UInt8](repeating: 0, count: 3)
            XCTAssertEqual(getxattr(p, "user.comment", &small, 3), -1)
            XCTAssertEqual(errno, ERANGE)
            var list = [CChar](repeating: 0, count: 1024)
            let n = listxattr(p, &list, list.count)
            let names = String(decoding: list[0..<max(n, 0)].map { UInt8(bitPattern: $0) }, as: UTF8.self).split(
                separator: "\0"
            ).map(String.init)
            XCTAssertTrue(Set(names).isSuperset(of: ["user.comment", "user.empty"]), "\(names)")
            XCTAssertEqual(listxattr(p, nil, 0), n)
            XCTAssertEqual(removexattr(p, "user.empty"), 0)
            XCTAssertEqual(removexattr(p, "user.empty") == 0 ? 0 : errno, ENODATA)
            XCTAssertEqual(setXattr(p, "v", "trusted.x") == 0 ? 0 : 1, 1, "other namespaces are not stored")
            // Unsupported namespaces say so (ls -l then stops asking for labels and ACLs).
            XCTAssertEqual(errnoOf(getXattr(p, "security.selinux")), EOPNOTSUPP)
            XCTAssertEqual(errnoOf(getXattr(p, "system.posix_acl_access")), EOPNOTSUPP)
        }
        // Values follow the file through rename and hard link, and survive a remount.
        XCTAssertEqual(rename(m.path("f"), m.path("g")), 0)
        XCTAssertEqual(link(m.path("g"), m.path("h")), 0)
        XCTAssertEqual(try getXattr(m.path("h"), "user.comment").get(), "replaced")
        let big = String(repeating: "v", count: 60_000)
        XCTAssertEqual(setXattr(m.path("g"), big, "user.big"), 0)
        try m.restart()
        XCTAssertEqual(
            try getXattr(m.path("g"), "user.comment").get(), "replaced", "metadata: readable before the first unlock")
        XCTAssertEqual(try getXattr(m.path("g"), "user.big").get(), big)
        XCTAssertEqual(try getXattr(m.path("d"), "user.comment").get(), "replaced")
        m.unmount()
        let e = FileManager.default.enumerator(atPath: m.store)!
        while let rel = e.nextObject() as? String {
            XCTAssertFalse(rel.contains("comment"))
            if let d = FileManager.default.contents(atPath: m.store + "/" + rel) {
                XCTAssertNil(d.range(of: Data("user.comment".utf8)), rel)
                XCTAssertNil(d.range(of: Data("replaced".utf8)), rel)
            }
        }
    }

    /// Sets of deleted objects do not stay behind in the store; an open file keeps its set.
    func testXattrsGoWithTheirObject() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let stored = {
            (try? FileManager.default.contentsOfDirectory(atPath: m.store + "/xattrs"))?.filter { !$0.hasPrefix(".") }
                .count ?? -1
        }
        XCTAssertEqual(stored(), 0)
        for name in ["unlinked", "linked", "replaced", "mover", "open"] {
            XCTAssertEqual(writeFile(m.path(name), bytes(name)), 0)
            XCTAssertEqual(setXattr(m.path(name), "v-" + name, "user.tag"), 0)
        }
        XCTAssertEqual(mkdir(m.path("dir"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("dir"), "v-dir", "user.tag"), 0)
        XCTAssertEqual(stored(), 6)
        XCTAssertEqual(unlink(m.path("unlinked")), 0)
        XCTAssertEqual(stored(), 5, "unlink of the last link drops the set")
        XCTAssertEqual(link(m.path("linked"), m.path("linked2")), 0)
        XCTAssertEqual(unlink(m.path("linked")), 0)
        XCTAssertEqual(try getXattr(m.path("linked2"), "user.tag").get(), "v-linked", "another link keeps it")
        XCTAssertEqual(rename(m.path("mover"), m.path("replaced")), 0)
        XCTAssertEqual(try getXattr(m.path("replaced"), "user.tag").get(), "v-mover")
        XCTAssertEqual(stored(), 4, "rename over a file drops the replaced file's set")
        XCTAssertEqual(rmdir(m.path("dir")), 0)
        XCTAssertEqual(stored(), 3, "rmdir drops the directory's set")
        let fd = open(m.path("open"), O_RDONLY)
        XCTAssertGreaterThanOrEqual(fd, 0)
        XCTAssertEqual(unlink(m.path("open")), 0)
        var buf = [UInt8](repeating: 0, count: 64)
        XCTAssertEqual(fgetxattr(fd, "user.tag", &buf, buf.count), 6, "an open, unlinked file still has its set")
        XCTAssertEqual(stored(), 3, "kept while open")
        close(fd)
        XCTAssertTrue(waitUntil { stored() == 2 }, "dropped at the last close (release is asynchronous)")
        XCTAssertEqual(unlink(m.path("linked2")), 0)
        try m.restart()
        m.unlock()
        XCTAssertEqual(writeFile(m.path("later"), bytes("x")), 0)
        XCTAssertEqual(setXattr(m.path("later"), "v", "user.tag"), 0)
        XCTAssertEqual(stored(), 2, "counted across a restart")
        XCTAssertEqual(unlink(m.path("later")), 0)
        XCTAssertEqual(unlink(m.path("replaced")), 0)
        XCTAssertEqual(stored(), 0)
    }
}
