import CSystem
import CTestSupport
import Foundation
import Glibc
import KeybagProtocol
import XCTest

/// POSIX behaviour a program relies on: modes at creation, symlink times, several users.
final class PosixTests: XCTestCase {
    func testModesAtCreationAndSymlinkTimes() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("odd"), 0o151), 0)
        var st = stat()
        XCTAssertEqual(lstat(m.path("odd"), &st), 0)
        XCTAssertEqual(st.st_mode & 0o7777, 0o151, "mode right at creation")
        XCTAssertEqual(symlink("target", m.path("sym")), 0)
        var times = [timespec(tv_sec: 1_000_000_000, tv_nsec: 5), timespec(tv_sec: 1_100_000_000, tv_nsec: 7)]
        XCTAssertEqual(utimensat(AT_FDCWD, m.path("sym"), &times, AT_SYMLINK_NOFOLLOW), 0)
        XCTAssertEqual(lstat(m.path("sym"), &st), 0)
        XCTAssertEqual(st.st_atim.tv_sec, 1_000_000_000)
        XCTAssertEqual(st.st_mtim.tv_sec, 1_100_000_000)
        // mkfifo works (no ENOSYS); O_TMPFILE: XfstestsRegressionTests.
        XCTAssertEqual(mkfifo(m.path("fifo"), 0o600), 0)
        XCTAssertEqual(lstat(m.path("fifo"), &st), 0)
        XCTAssertEqual(st.st_mode & S_IFMT, S_IFIFO)
        // RENAME_EXCHANGE and RENAME_NOREPLACE.
        XCTAssertEqual(writeFile(m.path("x"), bytes("X")), 0)
        XCTAssertEqual(writeFile(m.path("y"), bytes("Y")), 0)
        XCTAssertEqual(kbfs_renameat2(AT_FDCWD, m.path("x"), AT_FDCWD, m.path("y"), kbfs_RENAME_NOREPLACE), -1)
        XCTAssertEqual(errno, EEXIST)
        XCTAssertEqual(kbfs_renameat2(AT_FDCWD, m.path("x"), AT_FDCWD, m.path("y"), kbfs_RENAME_EXCHANGE), 0)
        XCTAssertEqual(try readFile(m.path("x")).get(), bytes("Y"))
        XCTAssertEqual(try readFile(m.path("y")).get(), bytes("X"))
    }

    /// Super-block options of the mount at `path` from /proc/self/mountinfo.
    func superOptions(_ path: String) -> String {
        let info = ProcFile.read("/proc/self/mountinfo") ?? ""
        for line in info.split(separator: "\n")
        where line.split(separator: " ").count > 4 && line.split(separator: " ")[4] == path {
            return String(line.split(separator: " ").last ?? "")
        }
        return ""
    }

    /// Root's private mount goes without kernel permission checks (root passes them anyway);
    /// access(2) must still answer as it would with them.
    /// A name looked up while absent is remembered by the kernel (a negative entry, as long
    /// as an entry); every way of making that name through the mount shows it at once, to
    /// this process and to a listing, and it goes again when removed.
    func testNamesLookedUpWhileAbsentShowAsSoonAsTheyAreMade() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("source"), bytes("source")), 0)
        XCTAssertEqual(mkdir(m.path("dir"), 0o755), 0)
        let tmpfile: (String) -> Int32 = { path in
            let fd = open(m.path("dir"), kbfs_O_TMPFILE | O_RDWR, 0o600)
            guard fd >= 0 else { return -1 }
            defer { close(fd) }
            return linkat(AT_FDCWD, "/proc/self/fd/\(fd)", AT_FDCWD, path, AT_SYMLINK_FOLLOW)
        }
        let makers: [(String, (String) -> Int32)] = [
            ("create", { writeFile($0, bytes("made")) }),
            ("mkdir", { mkdir($0, 0o755) }),
            ("symlink", { symlink("source", $0) }),
            ("link", { link(m.path("source"), $0) }),
            (
                "rename",
                { p in writeFile(m.path("dir/moving"), bytes("moved")) == 0 ? rename(m.path("dir/moving"), p) : -1 }
            ),
            ("mknod", { mknod($0, S_IFREG | 0o644, 0) }),
            ("O_TMPFILE + linkat", tmpfile),
        ]
        for (i, (how, make)) in makers.enumerated() {
            let name = "absent-\(i)", path = m.path("dir/" + name)
            var st = stat()
            for _ in 0..<2 { XCTAssertEqual(lstat(path, &st), -1); XCTAssertEqual(errno, ENOENT, how) }
            XCTAssertEqual(make(path), 0, "\(how): errno \(errno)")
            XCTAssertEqual(lstat(path, &st), 0, "\(how): the new name shows at once: errno \(errno)")
            XCTAssertTrue(
                ((try? FileManager.default.contentsOfDirectory(atPath: m.path("dir"))) ?? []).contains(name), how)
            XCTAssertEqual(how == "mkdir" ? rmdir(path) : unlink(path), 0, how)
            XCTAssertEqual(lstat(path, &st), -1, "\(how): and goes when removed")
        }
        // Made by another process through the mount (the kernel's cache is shared).
        var st = stat()
        XCTAssertEqual(lstat(m.path("dir/by-shell"), &st), -1)
        XCTAssertEqual(MountFixture.run("/bin/sh", ["-c", "echo x > '\(m.path("dir/by-shell"))'"]).code, 0)
        XCTAssertEqual(lstat(m.path("dir/by-shell"), &st), 0)
        // And after a restart of the daemon, nothing stale (the kernel's entries went with the mount).
        try m.restart()
        m.unlock()
        XCTAssertEqual(lstat(m.path("dir/by-shell"), &st), 0)
        XCTAssertEqual(lstat(m.path("dir/absent-0"), &st), -1)
    }

    func testRootPrivateMountAnswersAccessLikeTheKernel() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertFalse(superOptions(m.mnt).contains("default_permissions"), superOptions(m.mnt))
        XCTAssertEqual(writeFile(m.path("plain.txt"), bytes("data")), 0)
        XCTAssertEqual(chmod(m.path("plain.txt"), 0o644), 0)
        XCTAssertEqual(writeFile(m.path("tool.sh"), bytes("#!/bin/sh\nexit 0\n")), 0)
        XCTAssertEqual(chmod(m.path("tool.sh"), 0o744), 0)
        XCTAssertEqual(writeFile(m.path("locked.txt"), bytes("secret")), 0)
        XCTAssertEqual(chmod(m.path("locked.txt"), 0o000), 0)
        XCTAssertEqual(mkdir(m.path("closed"), 0o000), 0)
        XCTAssertEqual(Glibc.access(m.path("plain.txt"), X_OK), -1, "no x bit: not executable, even for root")
        XCTAssertEqual(errno, EACCES)
        XCTAssertEqual(Glibc.access(m.path("tool.sh"), X_OK), 0)
        XCTAssertEqual(Glibc.access(m.path("locked.txt"), R_OK | W_OK), 0, "root reads and writes mode 000")
        XCTAssertEqual(Glibc.access(m.path("closed"), R_OK | X_OK), 0, "root searches mode 000 directories")
        XCTAssertEqual(try readFile(m.path("locked.txt")).get(), bytes("secret"))
        XCTAssertEqual(MountFixture.run(m.path("tool.sh"), []).code, 0, "executes")
        XCTAssertNotEqual(MountFixture.run(m.path("plain.txt"), []).code, 0, "does not execute")
    }

    func testSeveralUsersOwnershipAndKernelPermissions() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(extra: ["-o", "allow_other"])
        m.unlock()
        XCTAssertTrue(superOptions(m.mnt).contains("default_permissions"), superOptions(m.mnt))
        XCTAssertEqual(mkdir(m.path("shared"), 0o1777), 0)
        XCTAssertEqual(chmod(m.path("shared"), 0o1777), 0)
        var r = asUser(65534, "echo mine > \(m.path("shared/nobody.txt")) && mkdir \(m.path("shared/nobody.d"))")
        XCTAssertEqual(r.code, 0, r.stderr)
        var st = stat()
        XCTAssertEqual(stat(m.path("shared/nobody.txt"), &st), 0)
        XCTAssertEqual(st.st_uid, 65534, "owned by the creating user")
        XCTAssertEqual(st.st_gid, 65534)
        XCTAssertEqual(stat(m.path("shared/nobody.d"), &st), 0)
        XCTAssertEqual(st.st_uid, 65534)
        // Another user may read (0644) but not write, and not delete in a sticky directory.
        r = asUser(65533, "cat \(m.path("shared/nobody.txt"))")
        XCTAssertEqual(r.stdout, "mine\n")
        XCTAssertNotEqual(asUser(65533, "echo x >> \(m.path("shared/nobody.txt"))").code, 0)
        XCTAssertNotEqual(asUser(65533, "rm -f \(m.path("shared/nobody.txt"))").code, 0)
        XCTAssertEqual(stat(m.path("shared/nobody.txt"), &st), 0, "sticky directory kept it")
        // Setgid directories pass their group on.
        XCTAssertEqual(mkdir(m.path("team"), 0o2777), 0)
        XCTAssertEqual(chown(m.path("team"), 0, 4242), 0)
        XCTAssertEqual(chmod(m.path("team"), 0o2777), 0)
        XCTAssertEqual(asUser(65534, "echo t > \(m.path("team/f")) && mkdir \(m.path("team/sub"))").code, 0)
        XCTAssertEqual(stat(m.path("team/f"), &st), 0)
        XCTAssertEqual(st.st_uid, 65534)
        XCTAssertEqual(st.st_gid, 4242, "group of the setgid directory")
        XCTAssertEqual(stat(m.path("team/sub"), &st), 0)
        XCTAssertEqual(st.st_gid, 4242)
        XCTAssertNotEqual(st.st_mode & S_ISGID, 0, "setgid inherited by subdirectories")
    }

    /// Setuid and setgid bits after writes, truncates, fallocate and chowns by the owner, by
    /// another user and by root, and those root gives a new file in a set-group-ID
    /// directory, end up as on a local file system (the kernel's rules: a modification by a
    /// caller without CAP_FSETID clears set-user-ID, and set-group-ID when group-executable
    /// or when the caller is not in the file's group; chown clears both), same steps in the
    /// mount and in a plain folder. xfstests generic/355 (direct I/O), 683-685 (fallocate
    /// modes) and 633 (setgid directory) are among them.
    func testSetuidAndSetgidBitsLikeALocalFileSystem() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(extra: ["-o", "allow_other"])
        m.unlock()
        let direct = "dd if=/dev/zero of=F bs=4096 count=1 oflag=direct conv=notrunc status=none"
        // (file, owner, mode, who acts, what it does)
        let steps: [(String, uid_t, mode_t, Int, String)] = [
            ("w-ug", 65534, 0o6775, 65534, "echo x >> F"),
            ("w-g-noexec", 65534, 0o2664, 65534, "echo x >> F"),
            ("w-u-root", 65534, 0o4755, 0, "echo x >> F"),
            ("w-u-pwrite", 65534, 0o4777, 65534, "dd if=/dev/zero of=F bs=1 count=1 seek=2 conv=notrunc status=none"),
            ("t-u", 65534, 0o4755, 65534, "truncate -s 1 F"),
            ("t-ug-root", 65534, 0o6775, 0, "truncate -s 1 F"),
            ("o-trunc", 65534, 0o4775, 65534, ": > F"),
            ("chown-root", 65534, 0o6755, 0, "chown 65533 F"),
            ("chgrp-owner", 65534, 0o6755, 65534, "chgrp 65534 F"),
            ("chmod-keeps", 65534, 0o6755, 65534, "chmod 6750 F"),
            ("direct-ug", 0, 0o6777, 65534, direct),
            ("direct-g-noexec-other", 0, 0o2666, 65534, direct),
            ("direct-u-root", 0, 0o4777, 0, direct),
            ("falloc-ug", 0, 0o6777, 65534, "fallocate -l 65536 F"),
            ("falloc-keep-u", 0, 0o4777, 65534, "fallocate -n -l 65536 F"),
            ("punch-ug", 0, 0o6777, 65534, "fallocate -p -o 0 -l 4096 F"),
            ("zero-ug", 0, 0o6777, 65534, "fallocate -z -o 0 -l 4096 F"),
            ("zero-g-noexec-other", 0, 0o2666, 65534, "fallocate -z -o 0 -l 4096 F"),
            ("falloc-ug-root", 0, 0o6777, 0, "fallocate -l 65536 F"),
        ]
        func run(_ dir: String) -> [String: mode_t] {
            XCTAssertEqual(mkdir(dir, 0o777), 0)
            XCTAssertEqual(chmod(dir, 0o777), 0)
            var out: [String: mode_t] = [:]
            for (name, owner, mode, uid, cmd) in steps {
                let f = dir + "/" + name
                XCTAssertEqual(writeFile(f, [UInt8](repeating: 7, count: 8192)), 0)
                XCTAssertEqual(chown(f, owner, owner), 0)
                XCTAssertEqual(chmod(f, mode), 0)
                let script = cmd.replacingOccurrences(of: "F", with: f)
                let r = uid == 0 ? MountFixture.run("/bin/sh", ["-c", script]) : asUser(uid, script)
                XCTAssertEqual(r.code, 0, "\(name): \(r.stderr)")
                var st = stat()
                XCTAssertEqual(stat(f, &st), 0)
                out[name] = st.st_mode & 0o7777
            }
            // Root creates a group-executable set-group-ID file (and a directory) in a
            // set-group-ID directory of a group it is not in.
            let sg = dir + "/sg"
            XCTAssertEqual(mkdir(sg, 0o777), 0)
            XCTAssertEqual(chown(sg, 0, 4242), 0)
            XCTAssertEqual(chmod(sg, 0o2777), 0)
            let old = umask(0)
            let fd = open(sg + "/file", O_CREAT | O_EXCL | O_WRONLY, 0o2010)
            XCTAssertGreaterThanOrEqual(fd, 0)
            close(fd)
            XCTAssertEqual(mkdir(sg + "/sub", 0o2755), 0)
            XCTAssertEqual(mknod(sg + "/chr", S_IFCHR | 0o2010, (5 << 8) | 1), 0, "errno \(errno)")
            XCTAssertEqual(mknod(sg + "/node", S_IFREG | 0o2010, 0), 0, "errno \(errno)")
            umask(old)
            // A hard link keeps the set-ID bits of its file.
            XCTAssertEqual(writeFile(sg + "/suid", []), 0)
            XCTAssertEqual(chmod(sg + "/suid", 0o4755), 0)
            XCTAssertEqual(link(sg + "/suid", sg + "/suid-link"), 0)
            for n in ["file", "sub", "chr", "node", "suid-link"] {
                var st = stat()
                XCTAssertEqual(stat(sg + "/" + n, &st), 0)
                out["sg/" + n] = st.st_mode & 0o7777
                out["sg/" + n + " gid"] = mode_t(st.st_gid)
            }
            return out
        }
        let expected = run(m.root + "/plain")
        let got = run(m.path("d"))
        for key in expected.keys.sorted() {
            XCTAssertEqual(String(got[key] ?? 0, radix: 8), String(expected[key] ?? 0, radix: 8), key)
        }
        XCTAssertEqual(expected["w-ug"], 0o775, "the reference folder clears both bits on an owner's write")
        XCTAssertEqual(expected["direct-ug"], 0o777, "and on another user's direct write")
        XCTAssertEqual(expected["sg/file"], 0o2010, "it keeps root's set-group-ID")
    }

    /// A file removed while open keeps its attributes changeable through its descriptors,
    /// as on a local filesystem (programs do open, unlink, fchmod for private scratch files),
    /// also after the descriptor it was opened with first is closed.
    func testAttributesOfAnUnlinkedOpenFileChangeThroughItsDescriptors() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("scratch"), bytes("kept while open")), 0)
        let rw = sysOpen(m.path("scratch"), O_RDWR), ro = sysOpen(m.path("scratch"), O_RDONLY)
        defer { close(ro) }
        XCTAssertEqual(unlink(m.path("scratch")), 0)
        XCTAssertEqual(fchmod(rw, 0o600), 0, "fchmod after unlink: errno \(errno)")
        XCTAssertEqual(fchown(rw, 1234, 4321), 0, "fchown after unlink: errno \(errno)")
        var times = [timespec(tv_sec: 1_000_000_000, tv_nsec: 0), timespec(tv_sec: 1_200_000_000, tv_nsec: 0)]
        XCTAssertEqual(futimens(rw, &times), 0, "futimens after unlink: errno \(errno)")
        var st = stat()
        XCTAssertEqual(fstat(rw, &st), 0)
        XCTAssertEqual(st.st_mode & 0o7777, 0o600)
        XCTAssertEqual(st.st_uid, 1234)
        XCTAssertEqual(st.st_gid, 4321)
        XCTAssertEqual(st.st_mtim.tv_sec, 1_200_000_000)
        XCTAssertEqual(st.st_nlink, 0)
        close(rw)
        // Only the read-only descriptor is left.
        XCTAssertEqual(fchmod(ro, 0o640), 0, "fchmod through the read-only descriptor: errno \(errno)")
        XCTAssertEqual(fstat(ro, &st), 0)
        XCTAssertEqual(st.st_mode & 0o7777, 0o640)
        var buf = [UInt8](repeating: 0, count: 64)
        XCTAssertEqual(pread(ro, &buf, 64, 0), 15)
        XCTAssertEqual(Array(buf[0..<15]), bytes("kept while open"))
        // A linked file: attributes change by path while open and after its last close.
        XCTAssertEqual(writeFile(m.path("linked"), bytes("x")), 0)
        let fd = sysOpen(m.path("linked"), O_RDONLY)
        XCTAssertEqual(chmod(m.path("linked"), 0o604), 0)
        close(fd)
        XCTAssertEqual(chmod(m.path("linked"), 0o614), 0)
        XCTAssertEqual(stat(m.path("linked"), &st), 0)
        XCTAssertEqual(st.st_mode & 0o7777, 0o614)
    }

    func testMoreFilesThanTheDaemonHasDescriptors() throws {
        // The daemon may hold 256 descriptors; the kernel keeps 3,000 inodes cached.
        let m = try MountFixture(defaultClass: "none", mount: false)
        addTeardownBlock { m.close() }
        try m.mount(launcher: ["/usr/bin/prlimit", "--nofile=256:256", "--"])
        XCTAssertEqual(mkdir(m.path("many"), 0o755), 0)
        for i in 0..<3000 { XCTAssertEqual(writeFile(m.path("many/f\(i)"), bytes("\(i)")), 0, "create \(i)") }
        var st = stat()
        for i in stride(from: 0, to: 3000, by: 7) {
            XCTAssertEqual(stat(m.path("many/f\(i)"), &st), 0)
            XCTAssertEqual(try readFile(m.path("many/f\(i)")).get(), bytes("\(i)"))
        }
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.path("many")).count, 3000)
    }

    func testLocksSeekCopyDirectIOAndStatfs() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        var rng = SeededBytes(seed: 3)
        let data = rng.bytes(50_000)
        XCTAssertEqual(writeFile(m.path("f"), data), 0)
        // flock and POSIX record locks (the kernel arbitrates them for the mount).
        let a = sysOpen(m.path("f"), O_RDWR), b = sysOpen(m.path("f"), O_RDWR)
        defer { close(a); close(b) }
        XCTAssertEqual(flock(a, LOCK_EX | LOCK_NB), 0)
        XCTAssertEqual(flock(b, LOCK_EX | LOCK_NB), -1)
        XCTAssertEqual(errno, EWOULDBLOCK)
        XCTAssertEqual(flock(a, LOCK_UN), 0)
        XCTAssertEqual(flock(b, LOCK_EX | LOCK_NB), 0)
        // A POSIX record lock held here is seen by another process (locks are per process,
        // so only a second process can test them).
        var lk = flock()
        lk.l_type = Int16(F_WRLCK); lk.l_whence = Int16(SEEK_SET); lk.l_start = 0; lk.l_len = 100
        XCTAssertEqual(fcntl(a, F_SETLK, &lk), 0)
        let tryLock = """
            import fcntl, os, sys
            fd = os.open(sys.argv[1], os.O_RDWR)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, int(sys.argv[3]), int(sys.argv[2]))
                print('got')
            except OSError as e:
                print('busy')
            """
        func otherProcessLocks(_ start: Int, _ len: Int) -> String {
            MountFixture.run("/usr/bin/env", ["python3", "-c", tryLock, m.path("f"), String(start), String(len)]).stdout
                .trimmingCharacters(in: .whitespacesAndNewlines)
        }
        XCTAssertEqual(otherProcessLocks(50, 10), "busy", "overlapping range held by this process")
        XCTAssertEqual(otherProcessLocks(200, 10), "got", "a range nobody holds")
        lk.l_type = Int16(F_UNLCK)
        XCTAssertEqual(fcntl(a, F_SETLK, &lk), 0)
        XCTAssertEqual(otherProcessLocks(50, 10), "got", "released")
        lk.l_type = Int16(F_WRLCK)
        XCTAssertEqual(fcntl(a, F_SETLK, &lk), 0)
        // SEEK_DATA / SEEK_HOLE answer consistently with the size.
        XCTAssertEqual(lseek(a, 0, kbfs_SEEK_DATA), 0)
        XCTAssertEqual(lseek(a, 0, kbfs_SEEK_HOLE), 50_000)
        XCTAssertEqual(lseek(a, 60_000, kbfs_SEEK_DATA), -1)
        XCTAssertEqual(errno, ENXIO)
        // copy_file_range (or its fallback) copies plaintext.
        let out = sysOpen(m.path("copy"), O_RDWR | O_CREAT)
        defer { close(out) }
        var inOff: Int64 = 0, outOff: Int64 = 0
        var copied = 0
        var copyErrno: Int32 = 0
        while copied < data.count {
            let n = kbfs_copy_file_range(a, &inOff, out, &outOff, UInt(data.count - copied))
            if n < 0 { copyErrno = errno }
            if n <= 0 { break }
            copied += n
        }
        XCTAssertEqual(copied, data.count, "copy_file_range stopped early (errno \(copyErrno))")
        XCTAssertEqual(try readFile(m.path("copy")).get(), data)
        // O_DIRECT opens and reads aligned buffers, or is refused cleanly.
        let d = open(m.path("f"), O_RDONLY | kbfs_O_DIRECT | O_CLOEXEC)
        if d >= 0 {
            let p = UnsafeMutableRawPointer.allocate(byteCount: 8192, alignment: 4096)
            defer { p.deallocate(); close(d) }
            XCTAssertEqual(pread(d, p, 8192, 0), 8192)
            XCTAssertEqual(Array(UnsafeRawBufferPointer(start: p, count: 8192)), Array(data[0..<8192]))
        } else {
            XCTAssertEqual(errno, EINVAL)
        }
        // statfs answers with the store's figures.
        var sv = statvfs()
        XCTAssertEqual(statvfs(m.mnt, &sv), 0)
        XCTAssertGreaterThan(sv.f_blocks, 0)
        XCTAssertEqual(sv.f_namemax, 255)
    }

    /// POSIX ACLs on a multi-user mount (allow_other, as xfstests' acl group and setfacl on a
    /// shared folder use them): an ACL lets a user in where the mode does not, getfacl and
    /// `ls -l` show it, chmod changes its mask, a default ACL is inherited (the umask ignored
    /// there and applied elsewhere), ACLs survive a remount, and a lock still shuts class A
    /// to the user the ACL lets in.
    func testPosixACLs() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(extra: ["-o", "allow_other"])
        m.unlock()
        XCTAssertEqual(m.status()["posixACLs"] as? Bool, true)
        func sh(_ script: String) -> ToolResult { MountFixture.run("/bin/sh", ["-c", script]) }
        func acl(_ rel: String) -> String { sh("getfacl --omit-header --numeric \(m.path(rel))").stdout }
        func mode(_ rel: String) -> mode_t {
            var st = stat(); return stat(m.path(rel), &st) == 0 ? st.st_mode & 0o7777 : 0o7777
        }
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        XCTAssertEqual(chmod(m.path("d"), 0o755), 0)
        XCTAssertEqual(writeFile(m.path("d/f"), bytes("shared")), 0)
        XCTAssertEqual(chmod(m.path("d/f"), 0o600), 0)
        XCTAssertNotEqual(asUser(65534, "cat \(m.path("d/f"))").code, 0, "the mode keeps nobody out")
        XCTAssertEqual(sh("setfacl -m u:65534:r \(m.path("d/f"))").code, 0)
        XCTAssertEqual(asUser(65534, "cat \(m.path("d/f"))").stdout, "shared", "the ACL lets nobody in")
        XCTAssertTrue(acl("d/f").contains("user:65534:r--"), acl("d/f"))
        XCTAssertEqual(mode("d/f"), 0o640, "the group bits show the mask")
        XCTAssertTrue(sh("ls -l \(m.path("d/f"))").stdout.hasPrefix("-rw-r-----+"))
        XCTAssertEqual(chmod(m.path("d/f"), 0o600), 0)
        XCTAssertTrue(acl("d/f").contains("mask::---"), acl("d/f"))
        XCTAssertNotEqual(asUser(65534, "cat \(m.path("d/f"))").code, 0, "chmod took the mask away")
        XCTAssertEqual(chmod(m.path("d/f"), 0o640), 0)
        // A default ACL is inherited, and the creator's umask does not cut it down.
        XCTAssertEqual(sh("setfacl -d -m u:65534:rw \(m.path("d"))").code, 0)
        XCTAssertEqual(sh("umask 077; echo new > \(m.path("d/inherited")); mkdir \(m.path("d/sub"))").code, 0)
        XCTAssertTrue(acl("d/inherited").contains("user:65534:rw-"), acl("d/inherited"))
        XCTAssertTrue(acl("d/sub").contains("default:user:65534:rw-"), acl("d/sub"))
        XCTAssertEqual(asUser(65534, "echo more >> \(m.path("d/inherited"))").code, 0)
        // Without a default ACL the umask applies.
        XCTAssertEqual(mkdir(m.path("plain"), 0o755), 0)
        XCTAssertEqual(sh("umask 027; touch \(m.path("plain/f")); mkdir \(m.path("plain/sub"))").code, 0)
        XCTAssertEqual(mode("plain/f"), 0o640)
        XCTAssertEqual(mode("plain/sub"), 0o750)
        // An ACL opens no door a lock shuts.
        XCTAssertEqual(mkdir(m.path("a"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("a"), "complete"), 0)
        XCTAssertEqual(writeFile(m.path("a/doc"), bytes("class A")), 0)
        XCTAssertEqual(chmod(m.path("a/doc"), 0o600), 0)
        XCTAssertEqual(sh("setfacl -m u:65534:r \(m.path("a/doc"))").code, 0)
        XCTAssertEqual(asUser(65534, "cat \(m.path("a/doc"))").stdout, "class A")
        m.lock()
        let locked = asUser(65534, "cat \(m.path("a/doc"))")
        XCTAssertNotEqual(locked.code, 0)
        XCTAssertTrue(locked.stderr.contains("Permission denied"), locked.stderr)
        // After a remount the ACLs are still there, and the store checks clean.
        m.unmount()
        XCTAssertEqual(m.fsck().code, 0)
        try m.mount(extra: ["-o", "allow_other"])
        m.unlock()
        XCTAssertEqual(asUser(65534, "cat \(m.path("d/f"))").stdout, "shared")
        XCTAssertTrue(acl("d").contains("default:user:65534:rw-"), acl("d"))
        XCTAssertEqual(asUser(65534, "cat \(m.path("a/doc"))").stdout, "class A")
    }

    /// A mount only root uses has no kernel permission checks and so no ACLs (setfacl says
    /// they are not supported) unless `-o acl` asks for them; `-o noacl` turns them off.
    func testPosixACLsFollowTheMountOptions() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("f"), bytes("x")), 0)
        XCTAssertEqual(m.status()["posixACLs"] as? Bool, false)
        let off = MountFixture.run("/usr/bin/setfacl", ["-m", "u:65534:r", m.path("f")])
        XCTAssertNotEqual(off.code, 0)
        XCTAssertTrue(off.stderr.contains("Operation not supported"), off.stderr)
        m.unmount()
        try m.mount(extra: ["-o", "acl"])
        XCTAssertEqual(m.status()["posixACLs"] as? Bool, true)
        XCTAssertEqual(MountFixture.run("/usr/bin/setfacl", ["-m", "u:65534:r", m.path("f")]).code, 0)
        m.unmount()
        try m.mount(extra: ["-o", "allow_other,noacl"])
        XCTAssertEqual(m.status()["posixACLs"] as? Bool, false)
        XCTAssertFalse(
            MountFixture.run("/usr/bin/getfacl", ["--omit-header", m.path("f")]).stdout.contains("65534"),
            "noacl: the stored ACL is not in force")
    }

    /// Capabilities a process has in a user namespace of its own count there only: an access
    /// ACL that a caller outside the file's group sets from such a namespace still clears the
    /// file's set-group-ID bit, as the kernel's own rule does (libfuse 3.14 cannot pass the
    /// kernel's decision on, so the daemon makes it).
    func testAnACLSetFromAUserNamespaceClearsSetGroupID() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(extra: ["-o", "allow_other"])
        m.unlock()
        XCTAssertEqual(mkdir(m.path("shared"), 0o777), 0)
        XCTAssertEqual(chown(m.path("shared"), 0, 4321), 0)
        XCTAssertEqual(chmod(m.path("shared"), 0o2777), 0)
        let file = m.path("shared/f")
        let made = asUser(
            65534,
            "python3 -c 'import os; os.umask(0); os.close(os.open(\"\(file)\", os.O_CREAT | os.O_WRONLY, 0o2644))'")
        XCTAssertEqual(made.code, 0, made.stderr)
        var st = stat()
        XCTAssertEqual(stat(file, &st), 0)
        XCTAssertEqual(st.st_gid, 4321)
        XCTAssertEqual(st.st_mode & 0o7777, 0o2644, "set-group-ID without group execute is kept at create")
        let set = asUser(65534, "unshare -Ur setfacl -m g::rx,m::rx \(file)")
        XCTAssertEqual(set.code, 0, set.stderr)
        XCTAssertEqual(stat(file, &st), 0)
        XCTAssertEqual(st.st_mode & 0o7777, 0o654, "the ACL made it group-executable: set-group-ID must go")
    }

    /// Where the store refuses to give a new file to its creator (root's chown on an NFS store
    /// with root_squash), the file stays root's and gets no set-ID bit: a user must never end
    /// up with a set-user-ID root file by creating one.
    func testANewFileLeftAsRootsGetsNoSetIDBits() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(extra: ["-o", "allow_other"], environment: ["KEYBAGFS_TEST_FAILPOINTS": "chown-refused=on"])
        m.unlock()
        XCTAssertEqual(mkdir(m.path("open"), 0o777), 0)
        XCTAssertEqual(chmod(m.path("open"), 0o777), 0)
        let script =
            "import os; os.umask(0); os.close(os.open('\(m.path("open/tool"))', os.O_CREAT | os.O_WRONLY, 0o4755)); "
            + "os.mknod('\(m.path("open/fifo"))', 0o4644 | 0o010000)"
        let made = asUser(65534, "python3 -c \"\(script)\"")
        XCTAssertEqual(made.code, 0, made.stderr)
        for name in ["tool", "fifo"] {
            var st = stat()
            XCTAssertEqual(lstat(m.path("open/" + name), &st), 0)
            XCTAssertEqual(st.st_uid, 0, "\(name): the chown failed")
            XCTAssertEqual(st.st_mode & (S_ISUID | S_ISGID), 0, "\(name): set-ID bits on a file left as root's")
        }
    }

    /// On a store whose own filesystem keeps no ACLs (btrfs -o noacl), ACLs answer "not
    /// supported" to setfacl, and the kernel's lookups of them find none, so plain mode
    /// checks work for every user (they failed: the lookup's error denied all but the owner).
    func testACLsOnAStoreWithoutThemFallBackToTheMode() throws {
        let m = try mountedSmallStore("128m", btrfsWithoutACLs: true, mountOptions: ["-o", "allow_other"])
        XCTAssertEqual(m.status()["posixACLs"] as? Bool, true)
        XCTAssertEqual(writeFile(m.path("readable"), bytes("for all")), 0)
        XCTAssertEqual(chmod(m.path("readable"), 0o644), 0)
        let r = asUser(65534, "cat \(m.path("readable"))")
        XCTAssertEqual(r.stdout, "for all", r.stderr)
        let set = MountFixture.run("/usr/bin/setfacl", ["-m", "u:65534:rw", m.path("readable")])
        XCTAssertNotEqual(set.code, 0)
        XCTAssertTrue(set.stderr.contains("Operation not supported"), set.stderr)
    }
}
