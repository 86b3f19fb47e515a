import CSystem
import Foundation
import Glibc
import KeybagProtocol
import XCTest

/// Failures xfstests (`./check -g quick`) found in keybagfs, each as a short test in the form
/// the xfstests case uses (docs/TESTING.md tells how to run xfstests itself). The set-ID
/// cases (generic/355, 633, 683-685) are in `PosixTests`.
final class XfstestsRegressionTests: XCTestCase {
    /// A name longer than the store keeps in a directory entry (hashed, with a side file).
    let long = String(repeating: "l", count: 200)

    /// Whether `path` is a whiteout: a character device 0:0.
    func isWhiteout(_ path: String) -> Bool {
        var st = stat()
        return lstat(path, &st) == 0 && st.st_mode & S_IFMT == S_IFCHR && st.st_rdev == 0
    }

    /// generic/013, generic/078: renameat2 with each flag, on short and long names, over
    /// files with xattrs and over empty directories, leaves a store fsck finds clean.
    func testRenameWithEveryFlagKeepsTheStoreWhole() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        // RENAME_WHITEOUT of a long name to another long name: the whiteout keeps the old name.
        XCTAssertEqual(writeFile(m.path("d/" + long), bytes("one")), 0)
        XCTAssertEqual(
            kbfs_renameat2(AT_FDCWD, m.path("d/" + long), AT_FDCWD, m.path("d/" + long + "2"), kbfs_RENAME_WHITEOUT), 0,
            "errno \(errno)")
        XCTAssertTrue(isWhiteout(m.path("d/" + long)), "a whiteout under the old name")
        XCTAssertEqual(try readFile(m.path("d/" + long + "2")).get(), bytes("one"))
        XCTAssertTrue(
            try FileManager.default.contentsOfDirectory(atPath: m.path("d")).sorted() == [long, long + "2"].sorted())
        // RENAME_WHITEOUT over a file with a user xattr: that file's xattr set goes with it.
        XCTAssertEqual(writeFile(m.path("d/target"), bytes("old")), 0)
        XCTAssertEqual(setXattr(m.path("d/target"), "kept?", "user.note"), 0)
        XCTAssertEqual(writeFile(m.path("d/src"), bytes("new")), 0)
        XCTAssertEqual(kbfs_renameat2(AT_FDCWD, m.path("d/src"), AT_FDCWD, m.path("d/target"), kbfs_RENAME_WHITEOUT), 0)
        XCTAssertEqual(try readFile(m.path("d/target")).get(), bytes("new"))
        XCTAssertEqual(errnoOf(getXattr(m.path("d/target"), "user.note")), ENODATA)
        XCTAssertTrue(isWhiteout(m.path("d/src")))
        // RENAME_WHITEOUT of a directory over an empty directory.
        XCTAssertEqual(mkdir(m.path("d/e1"), 0o755), 0)
        XCTAssertEqual(writeFile(m.path("d/e1/inside"), bytes("in")), 0)
        XCTAssertEqual(mkdir(m.path("d/e2"), 0o755), 0)
        XCTAssertEqual(
            kbfs_renameat2(AT_FDCWD, m.path("d/e1"), AT_FDCWD, m.path("d/e2"), kbfs_RENAME_WHITEOUT), 0,
            "errno \(errno)")
        XCTAssertEqual(try readFile(m.path("d/e2/inside")).get(), bytes("in"))
        XCTAssertTrue(isWhiteout(m.path("d/e1")))
        // RENAME_EXCHANGE and RENAME_NOREPLACE on long names, and plain rename over a file
        // with an xattr set.
        XCTAssertEqual(writeFile(m.path("d/" + long + "x"), bytes("x")), 0)
        XCTAssertEqual(writeFile(m.path("d/" + long + "y"), bytes("y")), 0)
        XCTAssertEqual(
            kbfs_renameat2(
                AT_FDCWD, m.path("d/" + long + "x"), AT_FDCWD, m.path("d/" + long + "y"), kbfs_RENAME_EXCHANGE), 0)
        XCTAssertEqual(try readFile(m.path("d/" + long + "x")).get(), bytes("y"))
        XCTAssertEqual(
            kbfs_renameat2(
                AT_FDCWD, m.path("d/" + long + "x"), AT_FDCWD, m.path("d/" + long + "y"), kbfs_RENAME_NOREPLACE), -1)
        XCTAssertEqual(errno, EEXIST)
        XCTAssertEqual(
            kbfs_renameat2(
                AT_FDCWD, m.path("d/" + long + "x"), AT_FDCWD, m.path("d/" + long + "z"), kbfs_RENAME_NOREPLACE), 0)
        XCTAssertEqual(setXattr(m.path("d/" + long + "y"), "v", "user.note"), 0)
        XCTAssertEqual(rename(m.path("d/" + long + "z"), m.path("d/" + long + "y")), 0)
        XCTAssertEqual(try readFile(m.path("d/" + long + "y")).get(), bytes("y"))
        m.unmount()
        let check = m.fsck()
        XCTAssertEqual(check.code, 0, "fsck after the renames: \(check.problems)")
        XCTAssertEqual(check.problems.map(\.kind), [])
        // The whiteouts go like any entry, and the directory is then empty.
        try m.mount()
        for name in try FileManager.default.contentsOfDirectory(atPath: m.path("d")) {
            var st = stat()
            XCTAssertEqual(lstat(m.path("d/" + name), &st), 0)
            if st.st_mode & S_IFMT == S_IFDIR {
                XCTAssertEqual(MountFixture.run("/bin/rm", ["-rf", m.path("d/" + name)]).code, 0)
            } else {
                XCTAssertEqual(unlink(m.path("d/" + name)), 0, name)
            }
        }
        XCTAssertEqual(rmdir(m.path("d")), 0, "errno \(errno)")
    }

    /// The store left by the old rename code (a whiteout under a long name, without its side
    /// file, and the replaced file's xattr set) is repaired by `fsck --repair`.
    func testFsckRepairsWhatTheOldWhiteoutRenameLeft() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        XCTAssertEqual(writeFile(m.path("d/" + long), bytes("gone")), 0)
        XCTAssertEqual(setXattr(m.path("d/" + long), "v", "user.note"), 0)
        let entry = m.backing("d/" + long)
        XCTAssertTrue(FileManager.default.fileExists(atPath: entry + ".name"), entry)
        m.unmount()
        // What the old code left: the entry replaced by a whiteout, its side file removed
        // (and with it the file and its xattr set gone from the tree).
        XCTAssertEqual(unlink(entry + ".name"), 0)
        XCTAssertEqual(unlink(entry), 0)
        XCTAssertEqual(mknod(entry, S_IFCHR | 0o000, 0), 0)
        let before = m.fsck()
        XCTAssertEqual(before.code, 1)
        XCTAssertEqual(before.problems.map(\.kind), ["whiteout-without-name", "xattr-orphan"])
        let repaired = m.fsck(["--repair"])
        XCTAssertEqual(repaired.problems.map(\.repair), ["repaired", "repaired"], "\(repaired.problems)")
        let after = m.fsck()
        XCTAssertEqual(after.code, 0, "clean after the repair: \(after.problems)")
        try m.mount()
        XCTAssertEqual(rmdir(m.path("d")), 0, "the directory is empty again: errno \(errno)")
    }

    /// generic/423: a symlink's size is its target's length.
    func testSymlinkSizeIsTheTargetLength() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let short = "/some/target/of/thirty-seven/bytes.x"
        let longTarget = String(repeating: "t/", count: 2000) + "end"
        XCTAssertEqual(symlink(short, m.path("s")), 0)
        XCTAssertEqual(symlink(longTarget, m.path("l")), 0)
        for (name, target) in [("s", short), ("l", longTarget)] {
            var st = stat()
            XCTAssertEqual(lstat(m.path(name), &st), 0)
            XCTAssertEqual(Int(st.st_size), target.utf8.count, name)
            var buf = [UInt8](repeating: 0, count: 8192)
            let n = readlink(m.path(name), &buf, buf.count)
            XCTAssertEqual(n, target.utf8.count, name)
            XCTAssertEqual(String(decoding: buf[0..<max(n, 0)], as: UTF8.self), target, name)
        }
        try m.restart()  // sizes from the store, not from what the daemon remembers
        var st = stat()
        XCTAssertEqual(lstat(m.path("s"), &st), 0)
        XCTAssertEqual(Int(st.st_size), short.utf8.count)
    }

    /// Names of a directory stream from the start.
    func names(_ dir: OpaquePointer) -> [String] {
        var out: [String] = []
        while let e = readdir(dir) {
            out.append(
                withUnsafePointer(to: &e.pointee.d_name) {
                    $0.withMemoryRebound(to: CChar.self, capacity: 256) { String(cString: $0) }
                })
        }
        return out
    }

    /// generic/471 and generic/736: `rewinddir` shows names created since `opendir`, and a
    /// listing holds `.` and `..`.
    func testRewinddirSeesNewNamesAndListingsHoldDotDot() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        XCTAssertEqual(writeFile(m.path("d/first"), []), 0)
        guard let dir = opendir(m.path("d")) else { return XCTFail("opendir: errno \(errno)") }
        defer { closedir(dir) }
        XCTAssertEqual(names(dir).sorted(), [".", "..", "first"])
        XCTAssertEqual(writeFile(m.path("d/second"), []), 0)
        XCTAssertEqual(unlink(m.path("d/first")), 0)
        rewinddir(dir)
        XCTAssertEqual(names(dir).sorted(), [".", "..", "second"], "after rewinddir")
        // generic/471's order: opendir, create, rewinddir with no read before it.
        XCTAssertEqual(mkdir(m.path("e"), 0o755), 0)
        guard let fresh = opendir(m.path("e")) else { return XCTFail("opendir: errno \(errno)") }
        defer { closedir(fresh) }
        for i in 1...50 { XCTAssertEqual(writeFile(m.path("e/\(i)"), []), 0) }
        rewinddir(fresh)
        XCTAssertEqual(names(fresh).count, 52, "., .. and the 50 names made since opendir")
        guard let root = opendir(m.mnt) else { return XCTFail("opendir") }
        defer { closedir(root) }
        XCTAssertEqual(names(root).sorted(), [".", "..", "d", "e"], "the mount root lists .. too")
    }

    /// generic/696: mknod of a regular file makes an empty file of the inherited class.
    func testMknodOfARegularFile() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("docs"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("docs"), "complete"), 0)
        XCTAssertEqual(mknod(m.path("docs/node"), S_IFREG | 0o640, 0), 0, "errno \(errno)")
        var st = stat()
        XCTAssertEqual(lstat(m.path("docs/node"), &st), 0)
        XCTAssertEqual(st.st_mode, S_IFREG | 0o640)
        XCTAssertEqual(st.st_size, 0)
        XCTAssertEqual(try getXattr(m.path("docs/node")).get(), "complete")
        XCTAssertEqual(mknod(m.path("docs/node"), S_IFREG | 0o640, 0), -1)
        XCTAssertEqual(errno, EEXIST)
        let fd = sysOpen(m.path("docs/node"), O_RDWR)
        XCTAssertGreaterThanOrEqual(fd, 0)
        XCTAssertEqual(try sysPwrite(fd, bytes("made by mknod"), 0).get(), 13)
        close(fd)
        XCTAssertEqual(m.status()["openFiles"] as? Int, 0, "mknod leaves no handle open")
        try m.restart()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("docs/node")).get(), bytes("made by mknod"))
    }

    /// generic/015: with the kernel's write-back cache on, a program filling the store gets
    /// ENOSPC from write(2) itself, and what write(2) accepted is stored (it used to write on
    /// for gigabytes, the error coming only from fsync and close); once space is freed,
    /// writes work again.
    func testWriteIntoAFullStoreFailsWithENOSPC() throws {
        try writeIntoAFullStore(try mountedSmallStore("16m"))
    }

    /// The same with write(2) calls that leave the kernel holding as many dirty pages as the
    /// tight mount lets it when the next check comes: a 16 MiB store promises write(2) calls
    /// of up to 1 MiB (size/16), and its refusal threshold left no room for the cipher's
    /// per-block overhead nor for the kernel going over its dirty limit (CI lost the tail
    /// of a 1 MiB write once in a full run, fsync ENOSPC, 15 of 16 MiB read back).
    func testWritesOfThePromisedSizeAfterTheDirtyLimitIsReachedAreNeverLost() throws {
        for chunks in [[1 << 20, 480 << 10], [1 << 20, 500 << 10, 12 << 10], [64 << 10]] {
            let m = try mountedSmallStore("16m")
            try writeIntoAFullStore(m, "write(2) sizes \(chunks)", chunks: chunks)
            m.unmount()
        }
    }

    /// The same where the kernel lets the mount hold only 1-4 MB of dirty pages (1% of its
    /// dirty limit: a machine with 1-2 GB of memory, or `vm.dirty_bytes` set), set here for this
    /// mount alone (its bdi's `max_bytes`). The mount stays loose longer then, and the daemon
    /// looked at the free space at most every 10 ms: write-back took the whole margin between
    /// two looks, and fsync lost 1 MiB of what write(2) had accepted (1 run in 2 at 2 MB).
    func testWritesOfThePromisedSizeUnderASmallDirtyLimitAreNeverLost() throws {
        for limit in [1_000_000, 2_000_000, 4_000_000] {
            for chunks in [[1 << 20], [1 << 20, 480 << 10]] {
                let m = try mountedSmallStore("16m")
                XCTAssertNoThrow(try setBDI(m, "max_bytes", "\(limit)"))
                try writeIntoAFullStore(m, "max_bytes \(limit), write(2) sizes \(chunks)", chunks: chunks)
                m.unmount()
            }
        }
    }

    /// Writes `value` to the sysfs file `name` of the kernel's bdi for the mount of `m` (its
    /// dirty limit: this mount's alone).
    func setBDI(_ m: MountFixture, _ name: String, _ value: String) throws {
        var st = stat()
        guard stat(m.mnt, &st) == 0 else { throw Errno(errno) }
        let dev = UInt64(st.st_dev)  // glibc's major() and minor(), which Swift does not import
        let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & ~0xfff), minor = (dev & 0xff) | ((dev >> 12) & ~0xff)
        try value.write(toFile: "/sys/class/bdi/\(major):\(minor)/\(name)", atomically: false, encoding: .utf8)
    }

    /// The same on ext4, which keeps blocks for its metadata that even root cannot write into
    /// (statvfs counts them in f_bfree, not in f_bavail).
    func testWriteIntoAFullExt4StoreFailsWithENOSPC() throws {
        try writeIntoAFullStore(try mountedSmallStore("256m", ext4: true))
    }

    /// The same with the mount options users pass, on ext4 as mkfs makes it (a root reserve).
    /// The daemon found its own mount as the last `fuse.keybagfs` line of mountinfo: with any
    /// other subtype it found none, never lowered the kernel's dirty limit for the mount, and
    /// the write-back lost what write(2) had accepted (dd: "error writing", then "closing").
    func testWriteIntoAFullStoreFailsWithENOSPCWithTheMountOptionsUsersPass() throws {
        let cases: [(options: String, mountCommand: Bool)] = [
            ("subtype=kbxfs", false), ("fsname=kbx-store,subtype=kbxfs,suid,dev", false), ("fsname=other", false),
            ("", true), ("subtype=kbxfs,suid,dev", true),
        ]
        for c in cases {
            let m = try mountedSmallStore(
                "256m", ext4: true, rootReserve: true, mountOptions: c.options.isEmpty ? [] : ["-o", c.options],
                mountCommandOptions: c.mountCommand ? c.options : nil)
            try writeIntoAFullStore(
                m, "\(c.mountCommand ? "mount -t fuse.keybagfs" : "keybagfs mount") -o \(c.options)")
            m.unmount()
        }
    }

    /// Fills the store of `m` through one descriptor with write(2) calls of the sizes in
    /// `chunks` (in turn), then frees it and writes again.
    func writeIntoAFullStore(_ m: MountFixture, _ label: String = "", chunks: [Int] = [1 << 20]) throws {
        XCTAssertEqual(m.status()["writebackCache"] as? Bool, true, "the case needs the write-back cache")
        let fd = sysOpen(m.path("fill"), O_WRONLY | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(fd, 0)
        let chunk = [UInt8](repeating: 0x5a, count: 1 << 20)
        var accepted = 0, calls = 0, refusal: Int32 = 0
        while accepted < 1 << 30 {
            let size = chunks[calls % chunks.count]
            let n = write(fd, chunk, size)
            if n < 0 { refusal = errno; break }
            XCTAssertEqual(n, size, "\(label): a whole write(2) or an error")
            accepted += n
            calls += 1
        }
        let got = "\(label): after \(calls) writes, \(accepted) bytes"
        XCTAssertEqual(refusal, ENOSPC, "\(got): write(2) reports the full store")
        XCTAssertLessThan(accepted, 1 << 30)
        // What write(2) accepted is stored: fsync and close find no lost write-back (as on
        // ext4, where dd reports the full disk once, not again at close).
        XCTAssertEqual(fsync(fd), 0, "\(got): fsync lost accepted writes: errno \(errno)")
        XCTAssertEqual(close(fd), 0, "\(got): close: errno \(errno)")
        let rfd = sysOpen(m.path("fill"), O_RDONLY)
        var buf = [UInt8](repeating: 0, count: chunk.count)
        var matching = 0
        while true {
            let n = read(rfd, &buf, buf.count)
            guard n > 0, memcmp(buf, chunk, n) == 0 else { XCTAssertEqual(n, 0, "\(got): read: errno \(errno)"); break }
            matching += n
        }
        close(rfd)
        XCTAssertEqual(matching, accepted, "\(got): every accepted byte reads back as written, and nothing else")
        XCTAssertEqual(unlink(m.path("fill")), 0)
        let after = sysOpen(m.path("after"), O_WRONLY | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(after, 0)
        for i in 0..<8 {
            XCTAssertEqual(try sysPwrite(after, chunk, i << 20).get(), chunk.count, "space freed: write \(i)")
        }
        XCTAssertEqual(fsync(after), 0, "errno \(errno)")
        close(after)
        XCTAssertEqual(try readFile(m.path("after")).get().count, 8 << 20)
    }

    /// generic/355, in its own steps: the owner's direct-I/O writes clear set-user-ID, and
    /// set-group-ID where group-executable, as `stat` shows right after each write.
    func testDirectWriteClearsSetIDBitsAsStatShowsAtOnce() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(extra: ["-o", "allow_other"])
        m.unlock()
        XCTAssertEqual(chmod(m.mnt, 0o777), 0)
        let f = m.path("355.test")
        let write =
            "setpriv --reuid=65534 --regid=65534 --clear-groups dd if=/dev/zero of=\(f) bs=4k count=1 oflag=direct conv=notrunc status=none"
        let script = """
            echo "this is a test" >> \(f); chmod 644 \(f); chown 65534:65534 \(f)
            chmod ug+s \(f); stat -c %A \(f); \(write); stat -c %A \(f)
            chmod ug+s \(f); chmod u+x \(f); stat -c %A \(f); \(write); stat -c %A \(f)
            chmod ug+s \(f); chmod g+x \(f); chmod u-x \(f); stat -c %A \(f); \(write); stat -c %A \(f)
            chmod ug+s \(f); chmod u+x \(f); stat -c %A \(f); \(write); stat -c %A \(f)
            """
        let r = MountFixture.run("/bin/sh", ["-c", script])
        XCTAssertEqual(r.code, 0, r.stderr)
        XCTAssertEqual(
            r.stdout.split(separator: "\n"),
            [
                "-rwSr-Sr--", "-rw-r-Sr--", "-rwsr-Sr--", "-rwxr-Sr--",
                "-rwSr-sr--", "-rw-r-xr--", "-rwsr-sr--", "-rwxr-xr--",
            ])
    }

    /// generic/103: statfs counts in plaintext, so a file of all that df calls available, but
    /// 512 KiB, can be allocated (the store's own overhead per block is not the program's).
    func testFallocateOfTheAvailableSpaceFits() throws {
        let m = try mountedSmallStore("128m", ext4: true)
        var s = statvfs()
        XCTAssertEqual(statvfs(m.mnt, &s), 0)
        let available = Int(s.f_bavail) * Int(s.f_frsize)
        let fd = sysOpen(m.path("spc"), O_RDWR | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(fd, 0)
        defer { close(fd) }
        XCTAssertEqual(
            kbfs_fallocate(fd, 0, 0, Int64(available - (512 << 10))), 0, "errno \(errno), \(available) bytes available")
        var st = stat()
        XCTAssertEqual(fstat(fd, &st), 0)
        XCTAssertEqual(Int(st.st_size), available - (512 << 10))
    }

    /// generic/004, 389, 509, 530: `open(2)` with O_TMPFILE gives a file of the directory's
    /// class without a name; `linkat(2)` names it (the same inode); O_EXCL forbids that; the
    /// class rules hold for it; an unnamed file leaves nothing in the store.
    func testOTmpfileFollowsTheClassAndLinkatNamesIt() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("docs"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("docs"), "complete"), 0)
        let fd = open(m.path("docs"), kbfs_O_TMPFILE | O_RDWR, 0o640)
        XCTAssertGreaterThanOrEqual(fd, 0, "O_TMPFILE: errno \(errno)")
        guard fd >= 0 else { return }
        var rng = SeededBytes(seed: 4)
        let data = rng.bytes(70_000)
        XCTAssertEqual(try sysPwrite(fd, data, 0).get(), data.count)
        XCTAssertEqual(try sysPread(fd, data.count, 0).get(), data)
        var st = stat()
        XCTAssertEqual(fstat(fd, &st), 0)
        XCTAssertEqual(st.st_size, off_t(data.count))
        XCTAssertEqual(st.st_nlink, 0)
        XCTAssertEqual(st.st_mode & 0o7777, 0o640)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.path("docs")), [])
        var value = [UInt8](repeating: 0, count: 64)
        let n = fgetxattr(fd, "user.protection", &value, value.count)
        XCTAssertEqual(n > 0 ? String(decoding: value[0..<n], as: UTF8.self) : "errno \(errno)", "complete")
        // Named by linkat: the same inode, content and class under the new name.
        XCTAssertEqual(
            linkat(AT_FDCWD, "/proc/self/fd/\(fd)", AT_FDCWD, m.path("docs/named"), AT_SYMLINK_FOLLOW), 0,
            "errno \(errno)")
        var named = stat()
        XCTAssertEqual(stat(m.path("docs/named"), &named), 0)
        XCTAssertEqual(named.st_ino, st.st_ino)
        XCTAssertEqual(named.st_nlink, 1)
        XCTAssertEqual(try sysPwrite(fd, bytes("tail"), data.count).get(), 4)
        XCTAssertEqual(try readFile(m.path("docs/named")).get(), data + bytes("tail"))
        XCTAssertEqual(try getXattr(m.path("docs/named")).get(), "complete")
        // Through the page cache (class C, write-back): what the descriptor wrote and the kernel
        // still holds is what the new name reads, so the name leads to the same inode.
        XCTAssertEqual(mkdir(m.path("cached"), 0o755), 0)
        let cfd = open(m.path("cached"), kbfs_O_TMPFILE | O_RDWR, 0o600)
        XCTAssertGreaterThanOrEqual(cfd, 0, "errno \(errno)")
        XCTAssertEqual(try sysPwrite(cfd, data, 0).get(), data.count)
        XCTAssertEqual(linkat(AT_FDCWD, "/proc/self/fd/\(cfd)", AT_FDCWD, m.path("cached/named"), AT_SYMLINK_FOLLOW), 0)
        XCTAssertEqual(try sysPwrite(cfd, bytes("more"), data.count).get(), 4)
        let seen = try readFile(m.path("cached/named")).get()
        XCTAssertTrue(seen == data + bytes("more"), "the name reads \(seen.count) bytes, not what the descriptor wrote")
        close(cfd)
        // Class A: the open descriptor answers EACCES once locked, and no new one is made.
        m.lock()
        XCTAssertEqual(errnoOf(sysPread(fd, 10, 0)), EACCES)
        let locked = open(m.path("docs"), kbfs_O_TMPFILE | O_RDWR, 0o600)
        XCTAssertEqual(locked, -1)
        XCTAssertEqual(errno, EACCES)
        if locked >= 0 { close(locked) }
        close(fd)
        m.unlock()
        // O_EXCL: the file can never get a name; closed, it leaves nothing behind.
        let before = try FileManager.default.contentsOfDirectory(atPath: m.backing("docs")).sorted()
        let excl = open(m.path("docs"), kbfs_O_TMPFILE | O_EXCL | O_WRONLY, 0o600)
        XCTAssertGreaterThanOrEqual(excl, 0, "errno \(errno)")
        XCTAssertEqual(try sysPwrite(excl, bytes("gone"), 0).get(), 4)
        XCTAssertEqual(linkat(AT_FDCWD, "/proc/self/fd/\(excl)", AT_FDCWD, m.path("docs/never"), AT_SYMLINK_FOLLOW), -1)
        XCTAssertEqual(errno, ENOENT)
        close(excl)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.backing("docs")).sorted(), before)
        // What linkat kept survives a remount; the store checks clean.
        m.unmount()
        let check = m.fsck()
        XCTAssertEqual(check.code, 0, "fsck: \(check.problems)")
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("docs/named")).get(), data + bytes("tail"))
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.path("docs")), ["named"])
    }

    /// generic/184, 434, 633: `-o suid,dev` mounts without nosuid,nodev (root's choice, as on
    /// ext4), so device nodes in the mount open; without them the mount stays nosuid,nodev.
    func testSuidAndDevOptionsReachTheMount() throws {
        func flags(_ m: MountFixture) -> [Substring] {
            let info = ProcFile.read("/proc/self/mountinfo") ?? ""
            let line = info.split(separator: "\n").first {
                $0.split(separator: " ").count > 5 && $0.split(separator: " ")[4] == Substring(m.mnt)
            }
            return line.map { $0.split(separator: " ")[5].split(separator: ",") } ?? []
        }
        let plain = try MountFixture()
        addTeardownBlock { plain.close() }
        XCTAssertTrue(flags(plain).contains("nosuid") && flags(plain).contains("nodev"), "\(flags(plain))")
        plain.close()
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(extra: ["-o", "suid,dev"])
        m.unlock()
        XCTAssertFalse(flags(m).contains("nosuid") || flags(m).contains("nodev"), "\(flags(m))")
        XCTAssertEqual(mknod(m.path("null"), S_IFCHR | 0o666, dev_t((1 << 8) | 3)), 0, "errno \(errno)")
        let fd = open(m.path("null"), O_RDWR)
        XCTAssertGreaterThanOrEqual(fd, 0, "open of a device node: errno \(errno)")
        if fd >= 0 {
            XCTAssertEqual(Glibc.write(fd, "x", 1), 1)
            close(fd)
        }
    }

    /// A lock on a full store finishes at once: the kernel's write-back of class A pages at the
    /// lock meets ENOSPC, and no request waits for space then (a file deleted while open, whose
    /// release the daemon would otherwise wait for, is held throughout by this test). Class A
    /// pages are cached where the kernel cannot map direct-I/O handles (before Linux 6.6),
    /// which the failpoint makes this mount believe. Some of the pages must still be dirty when
    /// the store fills (checked): CI once saw all 8 MiB written back before (fsync 0), and a full
    /// store refuses new ones at write(2) (FORMAT.md, "The end of the space").
    func testALockOnAFullStoreDoesNotWaitForSpace() throws {
        let m = try mountedSmallStore(
            "64m", environment: ["KEYBAGFS_TEST_FAILPOINTS": "kernel-without-direct-io-mmap=on"])
        XCTAssertEqual(mkdir(m.path("a"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("a"), "complete"), 0)
        let chunk = [UInt8](repeating: 0x42, count: 1 << 20)
        // A file deleted while open: its blocks come back only when this test closes it.
        let held = sysOpen(m.path("held"), O_RDWR | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(held, 0)
        for i in 0..<2 { XCTAssertEqual(try sysPwrite(held, chunk, i << 20).get(), chunk.count) }
        XCTAssertEqual(fsync(held), 0)
        XCTAssertEqual(unlink(m.path("held")), 0)
        // Dirty pages of an open class A file, still in the kernel's cache. The mount is tight
        // since the writes above (a 64 MiB store always is): the daemon has lowered the kernel's
        // dirty limit for it to 2 MiB, under which the kernel wrote all 8 MiB back before the
        // store filled (4 runs in 5). The test lifts it for this mount (up to the machine's own
        // limit, which may be lower).
        XCTAssertNoThrow(try setBDI(m, "strict_limit", "0"))
        _ = try? setBDI(m, "max_bytes", "\(64 << 20)")
        let dirty = sysOpen(m.path("a/dirty"), O_WRONLY | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(dirty, 0)
        for i in 0..<8 { XCTAssertEqual(try sysPwrite(dirty, chunk, i << 20).get(), chunk.count) }
        // The store's filesystem fills up behind the mount (another writer of the disk).
        let filler = open(m.store + "/.kbfs-test-filler", O_WRONLY | O_CREAT | O_EXCL, 0o600)
        XCTAssertGreaterThanOrEqual(filler, 0)
        while write(filler, chunk, chunk.count) > 0 {}
        close(filler)
        var st = stat()
        XCTAssertEqual(stat(m.backing("a/dirty"), &st), 0)
        XCTAssertLessThan(
            st.st_size, 8 << 20, "some of the pages are still in the kernel's cache when the store is full")
        // The lock goes straight to the socket: a child process would close its copy of the
        // descriptor at exec, and that close writes the dirty pages back before the lock.
        let ctl = try ControlClient.connect(path: m.socket)
        defer { Glibc.close(ctl) }
        let started = Date()
        try ControlClient.sendLine(ctl, #"{"op":"lock","grace":0}"#)
        var buffer: [UInt8] = []
        let reply = ControlClient.readLine(ctl, buffer: &buffer) ?? ""
        let took = Date().timeIntervalSince(started)
        XCTAssertTrue(reply.contains(#""ok":true"#), reply)
        XCTAssertTrue(waitUntil { m.state == "locked" })
        XCTAssertLessThan(took, 2, "the lock waited for space (\(took) s)")
        XCTAssertEqual(fsync(dirty), -1, "the pages met the full store")
        XCTAssertEqual(errno, ENOSPC)
        close(dirty)
        close(held)
    }

    /// generic/371: one loop writes an 80 MB file and deletes it, another fallocates 80 MB and
    /// deletes it, 100 times each, on a 256 MiB store: never more than two files live, so no
    /// call may meet a full store. (A deleted file's blocks come back with its release, which
    /// the kernel queues behind the other file's write-back; 1-4 calls of 200 failed.)
    func testParallelWriteAndFallocateNeverMeetAFullStore() throws {
        let m = try mountedSmallStore("256m", ext4: true)
        let one = m.path("one"), two = m.path("two")
        let script = """
            ( for i in $(seq 100); do dd if=/dev/zero of=\(one) bs=1M count=80 status=none || echo "write $i failed"; rm -f \(one); done ) &
            ( for i in $(seq 100); do fallocate -l 80M \(two) || echo "fallocate $i failed"; rm -f \(two); done ) &
            wait
            """
        let r = MountFixture.run("/bin/sh", ["-c", script], timeout: 600)
        XCTAssertEqual(r.code, 0)
        XCTAssertEqual(r.stdout + r.stderr, "", "calls that met a full store")
    }

    /// An inode number can belong to a new file while the kernel still knows the deleted file
    /// that had it (here kept by an O_PATH descriptor, which opens nothing in the daemon): the
    /// unlink of the new file drops its own xattr set, not the old file's, and fsck finds no
    /// orphan.
    func testUnlinkDropsTheRightXattrSetWhenAnInodeNumberIsReused() throws {
        let m = try mountedSmallStore("64m", ext4: true)  // ext4 hands a freed inode number out again at once
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        XCTAssertEqual(writeFile(m.path("d/old"), bytes("old")), 0)
        XCTAssertEqual(setXattr(m.path("d/old"), "old note", "user.note"), 0)
        var st = stat()
        XCTAssertEqual(stat(m.path("d/old"), &st), 0)
        let pin = open(m.path("d/old"), kbfs_O_PATH)
        XCTAssertGreaterThanOrEqual(pin, 0)
        XCTAssertEqual(unlink(m.path("d/old")), 0)
        var reused: String?
        for i in 0..<20 where reused == nil {
            let name = "d/new\(i)"
            XCTAssertEqual(writeFile(m.path(name), bytes("new")), 0)
            var n = stat()
            if stat(m.path(name), &n) == 0 && n.st_ino == st.st_ino { reused = name }
        }
        guard let reused else {
            close(pin); return XCTFail("ext4 gave no new file the freed inode number \(st.st_ino)")
        }
        XCTAssertEqual(setXattr(m.path(reused), "new note", "user.note"), 0)
        XCTAssertEqual(unlink(m.path(reused)), 0)
        close(pin)
        m.unmount()
        let check = m.fsck()
        XCTAssertEqual(check.problems.map(\.kind), [], "fsck: \(check.problems)")
    }
}
