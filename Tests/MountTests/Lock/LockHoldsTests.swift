import CSodium
import CTestSupport
import Foundation
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization
import XCTest

/// The lock as an attacker tries it: class changes, creates and writes racing a lock,
/// dirty mappings at the lock, a header with a damaged newest slot, and the daemon's
/// memory after a lock.
final class LockHoldsTests: XCTestCase {
    /// A mount with one directory per class given (its default class), unlocked.
    func unlockedMount(_ dirs: [String: String] = [:], environment: [String: String] = [:], cipher: String? = nil)
        throws -> MountFixture
    {
        let m = try MountFixture(cipher: cipher, mount: false)
        addTeardownBlock { m.close() }
        try m.mount(environment: environment)
        m.unlock()
        for (dir, cls) in dirs {
            XCTAssertEqual(mkdir(m.path(dir), 0o755), 0)
            XCTAssertEqual(setXattr(m.path(dir), cls), 0)
        }
        return m
    }

    /// The daemon's pid.
    func daemonPID(_ m: MountFixture) throws -> pid_t { pid_t(try XCTUnwrap(m.daemon?.processIdentifier)) }

    /// The one-letter process state in /proc/PID/stat ("T" when stopped).
    func processState(_ pid: pid_t) -> String {
        guard let s = ProcFile.read("/proc/\(pid)/stat"), let close = s.lastIndex(of: ")") else { return "?" }
        return String(s[s.index(close, offsetBy: 2)])
    }

    // Item 3: a class change needs the current class's key, not a key cached for a handle.
    func testClassBDowngradeWhileLockedIsRefusedDespiteAnOpenHandle() throws {
        let m = try unlockedMount(["b": "completeUnlessOpen"])
        XCTAssertEqual(writeFile(m.path("b/f"), bytes("class B secret")), 0)
        var held = sysOpen(m.path("b/f"), O_RDONLY)  // someone else's handle keeps the file key
        XCTAssertGreaterThanOrEqual(held, 0)
        defer { if held >= 0 { close(held) } }
        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked")
        XCTAssertEqual(setXattr(m.path("b/f"), "none"), EACCES, "a downgrade needs the class B private key")
        XCTAssertEqual(setXattr(m.path("b/f"), "completeUntilFirstUserAuthentication"), EACCES)
        XCTAssertEqual(try getXattr(m.path("b/f")).get(), "completeUnlessOpen")
        XCTAssertEqual(sysOpen(m.path("b/f"), O_RDONLY), -EACCES)
        XCTAssertEqual(try sysPread(held, 100, 0).get(), bytes("class B secret"), "the open handle keeps working")
        close(held); held = -1
        try m.restart()
        XCTAssertEqual(try getXattr(m.path("b/f")).get(), "completeUnlessOpen")
        XCTAssertEqual(sysOpen(m.path("b/f"), O_RDONLY), -EACCES, "still sealed for class B after a restart")
    }

    // Item 4: a create that took the class A key before a lock must not keep it after.
    func testCreateRacingALockKeepsNoClassAKey() throws {
        let m = try unlockedMount(
            ["a": "complete"], environment: ["KEYBAGFS_TEST_FAILPOINTS": "create-before-key-joins-inode=sleep:600"])
        let result = Locked<(fd: Int32, err: Int32)>((-1, 0))
        let done = DispatchSemaphore(value: 0)
        let path = m.path("a/racer")
        Thread.detachNewThread {
            let fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0o644)
            let e = errno
            result.withLock { $0 = (fd, fd < 0 ? e : 0) }
            done.signal()
        }
        usleep(150_000)  // the create is now inside the daemon, holding the class key
        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked")
        done.wait()
        let (fd, err) = result.withLock { $0 }
        if fd >= 0 {
            defer { close(fd) }
            XCTAssertEqual(
                errnoOf(sysPwrite(fd, bytes("after the lock"), 0)), EACCES,
                "the creator's handle still writes class A after `locked`")
            XCTAssertEqual(
                errnoOf(sysPread(fd, 10, 0)), EACCES, "the creator's handle still reads class A after `locked`")
        } else {
            XCTAssertEqual(err, EACCES, "a create that lost the race answers EACCES")
            var st = stat()
            XCTAssertEqual(lstat(path, &st), -1, "and leaves no file behind")
        }
    }

    // Item 7: a refused write must never become readable through another descriptor.
    func testRefusedWritesAreNeverReadBackWhileLocked() throws {
        let m = try unlockedMount(["a": "complete"])
        let original = [UInt8](repeating: 0x41, count: 16 * 4096)
        XCTAssertEqual(writeFile(m.path("a/f"), original), 0)
        let writer = sysOpen(m.path("a/f"), O_RDWR), reader = sysOpen(m.path("a/f"), O_RDONLY)
        XCTAssertGreaterThanOrEqual(writer, 0); XCTAssertGreaterThanOrEqual(reader, 0)
        defer { close(writer); close(reader) }
        XCTAssertEqual(try sysPread(reader, 4096, 0).get(), Array(original[0..<4096]))
        m.lock(grace: 0)
        let stop = Atomic<Bool>(false)
        let writes = Atomic<Int>(0), writesAccepted = Atomic<Int>(0)
        let finished = DispatchSemaphore(value: 0)
        Thread.detachNewThread {
            let page = [UInt8](repeating: 0x5A, count: 4096)
            while !stop.load(ordering: .relaxed) {
                if pwrite(writer, page, 4096, 0) >= 0 { writesAccepted.add(1, ordering: .relaxed) }
                writes.add(1, ordering: .relaxed)
            }
            finished.signal()
        }
        var reads = 0, leaked = 0, otherErrors = 0
        let deadline = Date().addingTimeInterval(2)
        var buf = [UInt8](repeating: 0, count: 4096)
        while Date() < deadline {
            let n = pread(reader, &buf, 4096, 0)
            if n >= 0 { leaked += 1 } else if errno != EACCES { otherErrors += 1 }
            reads += 1
        }
        stop.store(true, ordering: .relaxed)
        finished.wait()
        print(
            "refused-write race: \(writes.load(ordering: .relaxed)) writes, \(reads) reads, \(leaked) reads returned data"
        )
        XCTAssertGreaterThan(writes.load(ordering: .relaxed), 100)
        XCTAssertEqual(writesAccepted.load(ordering: .relaxed), 0, "class A writes while locked")
        XCTAssertEqual(leaked, 0, "reads that returned data while locked")
        XCTAssertEqual(otherErrors, 0)
        m.unlock()
        XCTAssertEqual(
            try sysPread(reader, original.count, 0).get(), original, "the store and what readers see agree after unlock"
        )
    }

    // Write-back cache: bytes written (not synced) before a lock are sealed while the keys
    // exist, whatever the class; class A is refused through the same descriptor afterwards.
    func testUnsyncedWritesOfEveryClassSurviveALockAndARestart() throws {
        let classes = [
            "d": "none", "c": "completeUntilFirstUserAuthentication", "b": "completeUnlessOpen", "a": "complete",
        ]
        let m = try unlockedMount(classes)
        var rng = SeededBytes(seed: 11)
        var written: [String: [UInt8]] = [:]
        var fds: [String: Int32] = [:]
        for dir in classes.keys.sorted() {
            let fd = sysOpen(m.path("\(dir)/f"), O_RDWR | O_CREAT | O_EXCL)
            XCTAssertGreaterThanOrEqual(fd, 0)
            let data = rng.bytes(3 * 4096 + 17)
            XCTAssertEqual(try sysPwrite(fd, data, 0).get(), data.count)
            XCTAssertEqual(
                try sysPwrite(fd, Array(data[100..<200]), 5000).get(), 100, "a second write inside the first")
            var expect = data
            expect.replaceSubrange(5000..<5100, with: data[100..<200])
            written[dir] = expect
            fds[dir] = fd
        }
        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked")
        for (dir, fd) in fds.sorted(by: { $0.key < $1.key }) {
            let r = sysPread(fd, written[dir]!.count, 0)
            if dir == "a" {
                XCTAssertEqual(errnoOf(r), EACCES, "class A through a descriptor opened before the lock")
            } else {
                XCTAssertEqual(try r.get(), written[dir], "class \(classes[dir]!) while locked")
            }
            close(fd)
        }
        try m.restart()
        m.unlock()
        for dir in classes.keys.sorted() {
            XCTAssertEqual(
                try readFile(m.path("\(dir)/f")).get(), written[dir],
                "class \(classes[dir]!) after a lock and a restart")
        }
    }

    /// The page cache in MiB (`Cached:` of /proc/meminfo): FUSE pages are counted there.
    func cachedMiB() -> Int {
        let line = (ProcFile.read("/proc/meminfo") ?? "").split(separator: "\n").first { $0.hasPrefix("Cached:") } ?? ""
        return (Int(line.split(separator: " ").dropFirst().first ?? "") ?? 0) / 1024
    }

    // The last close of a class B file while locked takes its plaintext out of the kernel's
    // page cache too, not only its key out of the daemon: for a file open through the lock,
    // and for one created while locked. (A root memory dump after the close finds neither.)
    func testLastCloseOfClassBFileWhileLockedDropsItsPageCache() throws {
        let m = try unlockedMount(["b": "completeUnlessOpen"])
        let size = 64 << 20
        let data = [UInt8](repeating: 0x5a, count: size)
        func dropAfterClose(_ fd: Int32, _ what: String) {
            XCTAssertEqual(try sysPwrite(fd, data, 0).get(), size, what)
            XCTAssertEqual(fsync(fd), 0, what)
            XCTAssertEqual(try sysPread(fd, size, 0).get().count, size, "\(what): read back while locked")
            let before = cachedMiB()
            close(fd)
            let dropped = waitUntil(5) { before - self.cachedMiB() >= 48 }
            XCTAssertTrue(dropped, "\(what): page cache \(before) MiB before the last close, \(cachedMiB()) MiB after")
            XCTAssertEqual(sysOpen(m.path("b/\(what)"), O_RDONLY), -EACCES, "\(what): open while locked")
        }
        let open = sysOpen(m.path("b/open"), O_RDWR | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(open, 0)
        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked")
        dropAfterClose(open, "open")
        let created = sysOpen(m.path("b/created"), O_RDWR | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(created, 0, "class B create while locked")
        dropAfterClose(created, "created")
        m.unlock()
        for name in ["open", "created"] {
            XCTAssertEqual(try readFile(m.path("b/\(name)")).get(), data, "\(name) after unlock")
        }
    }

    /// Opens `path` read-write (a cached handle unless the file is class A), writes one full
    /// page at 0 and syncs; after `lock`, a full-page write through it must be refused and
    /// never appear, and the file must read as before once unlocked.
    func assertFullPageWriteRefusedAfterLock(
        _ m: MountFixture, _ path: String, makeComplete: Bool,
        file: StaticString = #filePath, line: UInt = #line
    ) {
        let original = [UInt8](repeating: 0x41, count: 4 * 4096)
        XCTAssertEqual(writeFile(path, original), 0, file: file, line: line)
        let fd = sysOpen(path, O_RDWR)
        XCTAssertGreaterThanOrEqual(fd, 0, file: file, line: line)
        defer { close(fd) }
        XCTAssertEqual(try sysPread(fd, 4096, 0).get(), Array(original[0..<4096]), file: file, line: line)
        if makeComplete {
            XCTAssertEqual(setXattr(path, "complete"), 0, "class change with the handle open", file: file, line: line)
        }
        XCTAssertEqual(try getXattr(path).get(), "complete", file: file, line: line)
        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked", file: file, line: line)
        for round in 0..<3 {
            // A stat by anyone refreshes the kernel's attributes between the writes.
            var st = stat()
            XCTAssertEqual(stat(path, &st), 0, file: file, line: line)
            let w = sysPwrite(fd, [UInt8](repeating: 0x5a, count: 4096), 8192)
            XCTAssertEqual(
                errnoOf(w), EACCES,
                "round \(round): a full-page write to a class A file through an old descriptor after the lock (returned \(w))",
                file: file, line: line)
            XCTAssertEqual(errnoOf(sysPread(fd, 4096, 8192)), EACCES, file: file, line: line)
        }
        m.unlock()
        XCTAssertEqual(try readFile(path).get(), original, "the file after unlock", file: file, line: line)
    }

    // A handle opened while the file was class C uses the page cache; when the file becomes
    // `complete` while it is open, a full page written through it after the lock must still
    // be refused (the kernel would otherwise keep it, as plaintext, without asking us).
    func testFileMadeCompleteWhileOpenRefusesPageCacheWritesAfterALock() throws {
        let m = try unlockedMount()
        assertFullPageWriteRefusedAfterLock(m, m.path("f"), makeComplete: true)
    }

    // On a kernel that cannot map direct-I/O handles (before 6.6, Debian 12's 6.1), class A
    // handles use the page cache; a full-page write through one after the lock must be
    // refused all the same (seen accepted before: 4096 bytes, read back while locked).
    func testClassAOnAKernelWithoutDirectIOMmapRefusesWritesAfterALock() throws {
        let m = try unlockedMount(
            ["a": "complete"], environment: ["KEYBAGFS_TEST_FAILPOINTS": "kernel-without-direct-io-mmap=on"])
        XCTAssertEqual(m.status()["classADirectIO"] as? Bool, false, "the switch takes effect")
        XCTAssertEqual(m.status()["writebackCache"] as? Bool, true)
        assertFullPageWriteRefusedAfterLock(m, m.path("a/f"), makeComplete: false)
    }

    // Item 2: dirty pages of a shared mapping are written back by the lock, not dropped.
    func testDirtySharedMappingOfClassAFileSurvivesALock() throws {
        let m = try unlockedMount(["a": "complete"])
        for round in 0..<3 {
            let name = "a/mapped\(round)"
            XCTAssertEqual(writeFile(m.path(name), [UInt8](repeating: 0x41, count: 4 * 4096)), 0)
            let script = """
                import mmap, os, sys, time
                fd = os.open(sys.argv[1], os.O_RDWR)
                mm = mmap.mmap(fd, 4 * 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                mm[:] = b'B' * (4 * 4096)
                print('dirty', flush=True)
                while not os.path.exists(sys.argv[2]): time.sleep(0.01)
                os._exit(0)
                """
            let p = Process()
            p.executableURL = URL(fileURLWithPath: "/usr/bin/env")
            p.arguments = ["python3", "-c", script, m.path(name), m.root + "/go\(round)"]
            let out = Pipe()
            p.standardOutput = out
            try p.run()
            var seen = Data()
            while !String(decoding: seen, as: UTF8.self).contains("dirty") {
                let d = out.fileHandleForReading.availableData
                if d.isEmpty { break }
                seen += d
            }
            m.lock(grace: 0)
            XCTAssertEqual(m.state, "locked")
            _ = FileManager.default.createFile(atPath: m.root + "/go\(round)", contents: nil)
            p.waitUntilExit()
            m.unlock()
            XCTAssertEqual(
                try readFile(m.path(name)).get(), [UInt8](repeating: 0x42, count: 4 * 4096),
                "round \(round): bytes written through the mapping before the lock")
        }
    }

    // Item 1: a class change leaves no older wrap behind, and a bad newest slot is EIO.
    func testClassChangeKilledBetweenSlotWritesNeverFallsBack() throws {
        let m = try unlockedMount(
            ["d": "none"], environment: ["KEYBAGFS_TEST_FAILPOINTS": "class-change-between-slots=stop"])
        let data = Array("was class D, is now complete".utf8)
        XCTAssertEqual(writeFile(m.path("d/f"), data), 0)
        let backing = m.backing("d/f")
        let pid = try daemonPID(m)
        // The change to `complete` stops the daemon once the new slot is durable; kill it there.
        let setter = Process()
        setter.executableURL = URL(fileURLWithPath: "/usr/bin/setfattr")
        setter.arguments = ["-n", "user.protection", "-v", "complete", m.path("d/f")]
        setter.standardError = Foundation.FileHandle.nullDevice
        try setter.run()
        XCTAssertTrue(waitUntil(10) { self.processState(pid) == "T" }, "the daemon reached the failpoint")
        kill(pid, SIGKILL)
        m.daemon?.waitUntilExit()
        setter.waitUntilExit()
        m.unmount()
        var header = Array(try Data(contentsOf: URL(fileURLWithPath: backing)).prefix(FileHeader.size))
        let parsed = try FileHeader.parseSlots(header)
        XCTAssertEqual(parsed.current.protectionClass, .complete, "the new slot is durable")
        let staleSlot = try XCTUnwrap(parsed.superseded, "killed before the old slot was erased")

        // A damaged newest slot is EIO, never the older class's wrap.
        let newest = parsed.current.slotOffset
        header[newest + 140] ^= 0x01
        try writeBytes(backing, header, at: 0)
        try m.mount()
        XCTAssertEqual(sysOpen(m.path("d/f"), O_RDONLY), -EIO, "no fallback to the class D wrap")
        m.unmount()
        header[newest + 140] ^= 0x01
        try writeBytes(backing, header, at: 0)

        // Intact: the file is class A (sealed before the first unlock), and the first look
        // at its header finishes the interrupted change by erasing the old slot.
        try m.mount()
        XCTAssertEqual(try getXattr(m.path("d/f")).get(), "complete")
        XCTAssertEqual(sysOpen(m.path("d/f"), O_RDONLY), -EACCES)
        let after = Array(try Data(contentsOf: URL(fileURLWithPath: backing)).prefix(FileHeader.size))
        let old = staleSlot * FileHeader.slotSize
        XCTAssertEqual(
            Array(after[old..<(old + FileHeader.slotSize)]), [UInt8](repeating: 0, count: FileHeader.slotSize),
            "the class D wrap is gone")
        m.unlock()
        XCTAssertEqual(try readFile(m.path("d/f")).get(), data)

        // A change that completes leaves one valid slot and an erased one.
        XCTAssertEqual(setXattr(m.path("d/f"), "none"), 0)
        let done = Array(try Data(contentsOf: URL(fileURLWithPath: backing)).prefix(FileHeader.size))
        let final = try FileHeader.parseSlots(done)
        XCTAssertEqual(final.current.protectionClass, ProtectionClass.none)
        XCTAssertNil(final.superseded)
        let other = (1 - final.current.slot) * FileHeader.slotSize
        XCTAssertEqual(
            Array(done[other..<(other + FileHeader.slotSize)]), [UInt8](repeating: 0, count: FileHeader.slotSize),
            "the class A wrap is gone")
    }

    // Item 6: after a lock, the daemon's memory holds no class A plaintext, key or passcode.
    func testNoClassAPlaintextKeyOrPasscodeInDaemonMemoryAfterALock() throws {
        try checkDaemonMemoryAfterALock(cipher: "xaes256gcm")
    }

    /// The same for stores made before XAES-256-GCM: AES-256-GCM (whose round keys
    /// libsodium's AES-NI code once left on worker stacks) and XChaCha20-Poly1305.
    func testNoClassAKeyAfterALockInAES256GCMAndXChaChaStores() throws {
        try checkDaemonMemoryAfterALock(cipher: "aes256gcm")
        try checkDaemonMemoryAfterALock(cipher: "xchacha20poly1305")
    }

    /// Writes and reads class A files (one held open across the lock, two made `complete`
    /// after class C traffic), passes passcodes through every request that carries one,
    /// locks, and scans the daemon's memory for plaintext, passcodes and 16-byte pieces of
    /// every file key, its AES round keys and per-block derived keys.
    func checkDaemonMemoryAfterALock(cipher: String) throws {
        let m = try unlockedMount(["a": "complete"], cipher: cipher)
        defer { m.close() }
        var rng = SeededBytes(seed: 4242)
        let read = rng.bytes(192 * 1024), held = rng.bytes(64 * 1024 + 123)
        XCTAssertEqual(writeFile(m.path("a/read"), read), 0)
        XCTAssertEqual(try readFile(m.path("a/read")).get(), read)
        // A descriptor that stays open across the lock, written and read through.
        let fd = sysOpen(m.path("a/held"), O_RDWR | O_CREAT)
        XCTAssertGreaterThanOrEqual(fd, 0)
        defer { close(fd) }
        XCTAssertEqual(try sysPwrite(fd, held, 0).get(), held.count)
        XCTAssertEqual(try sysPread(fd, held.count, 0).get(), held)
        // Written and read while class C, then made `complete`: buffers of that earlier
        // traffic must not hold it either.
        let changed = rng.bytes(64 * 1024), changedRead = rng.bytes(64 * 1024)
        XCTAssertEqual(writeFile(m.path("was-c-written"), changed), 0)
        XCTAssertEqual(writeFile(m.path("was-c-read"), changedRead), 0)
        XCTAssertEqual(try readFile(m.path("was-c-read")).get(), changedRead)
        for f in ["was-c-written", "was-c-read"] { XCTAssertEqual(setXattr(m.path(f), "complete"), 0) }
        XCTAssertEqual(try sysPread(fd, held.count, 0).get(), held)
        XCTAssertEqual(fsync(fd), 0)
        sync()  // every block's nonce is in the store before the needles are computed
        let files = ["a/read", "a/held", "was-c-written", "was-c-read"].map { m.backing($0) }
        let pid = try daemonPID(m)
        let needles = try KeyNeedles(store: m.store, passcode: m.passcode, deviceKey: m.deviceKey, files: files)
        XCTAssertGreaterThan(needles.all.count, 4 * 2, "\(cipher): key pieces to look for")
        // Positive control: before the lock the daemon holds the open file's key.
        let before = MemoryScan.find(pid: pid, pieces: needles.fileKeys)
        XCTAssertFalse(before.isEmpty, "\(cipher): the scanner finds the held file's key while unlocked")
        if cipher != "xchacha20poly1305" {
            // The key schedule of the last file read sits in an idle OpenSSL context until the lock.
            XCTAssertEqual(try readFile(m.path("a/read")).get(), read)
            XCTAssertFalse(
                MemoryScan.find(pid: pid, pieces: needles.fileKeySchedules).isEmpty,
                "\(cipher): the scanner finds a round key or GHASH key while unlocked")
        }
        // Passcodes through every request that carries one: a wrong unlock, passwd, unlock.
        let wrong = "not the passcode 4242", second = "second passcode 4242"
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: wrong + "\n").code, 1)
        XCTAssertEqual(m.ctl(["passwd", "--passcode-stdin"], stdin: m.passcode + "\n" + second + "\n").code, 0)
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: second + "\n").code, 0)
        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked")
        let scan = try MemoryScan(pid: pid, secrets: [read, held, changed, changedRead])
        print(
            "memory scan (\(cipher)): \(scan.bytesScanned) bytes in \(scan.regions) regions, \(needles.all.count) key pieces"
        )
        // Mappings to the end of maps are considered (the scan once saw only
        // the first 4 KiB of /proc/PID/maps: 30 of 68 regions).
        let stackLine = MountFixture.run("/bin/grep", ["-F", "[stack]", "/proc/\(pid)/maps"]).stdout
        let stackStart = Int(stackLine.prefix { $0 != "-" }, radix: 16) ?? -1
        XCTAssertTrue(
            MemoryScan.regions(pid).contains { $0.0 == stackStart },
            "the main thread's stack, near the end of maps, is scanned: \(stackLine)")
        XCTAssertGreaterThan(scan.bytesScanned, 1 << 20)
        XCTAssertEqual(scan.plaintextHits, [], "\(cipher): 32-byte pieces of class A plaintext (file offset, address)")
        XCTAssertEqual(
            MemoryScan.find(pid: pid, pieces: needles.all), [], "\(cipher): pieces of class A keys after the lock")
        // A core dump (gcore) holds the memory and every thread's registers, vector ones included.
        let core = m.root + "/daemon.core"
        let dump = MountFixture.run("/usr/bin/gcore", ["-o", core, String(pid)], timeout: 120)
        XCTAssertEqual(dump.code, 0, "gcore: \(dump.stderr.suffix(300))")
        XCTAssertEqual(
            MemoryScan.find(file: core + ".\(pid)", pieces: needles.all), [],
            "\(cipher): pieces of class A keys in a core dump after the lock")
        unlink(core + ".\(pid)")
        // Positive control: the same scanner finds the secrets in this process, which holds them.
        let control = try MemoryScan(pid: getpid(), secrets: [held])
        XCTAssertFalse(control.plaintextHits.isEmpty, "the scanner finds plaintext where it is")
        XCTAssertGreaterThan(control.count(of: Array(wrong.utf8)), 0, "the scanner finds a passcode where it is")
        XCTAssertFalse(
            MemoryScan.find(pid: getpid(), pieces: needles.all).isEmpty, "the scanner finds key pieces where they are")
        for p in [m.passcode, wrong, second] {
            XCTAssertEqual(scan.count(of: Array(p.utf8)), 0, "copies of \(p)")
            XCTAssertEqual(scan.count(of: p.utf8.flatMap { [$0, 0] }), 0, "UTF-16 copies of \(p)")
        }
    }

    /// Overwrites bytes of a file at an offset.
    func writeBytes(_ path: String, _ b: [UInt8], at offset: Int) throws {
        let fd = open(path, O_WRONLY | O_CLOEXEC)
        guard fd >= 0 else { throw Errno(errno) }
        defer { close(fd) }
        guard pwrite(fd, b, b.count, off_t(offset)) == b.count, fsync(fd) == 0 else { throw Errno(errno) }
    }
}

/// 16-byte pieces of the key material of class A files, computed from the store with the
/// passcode and device key: each file key's halves; for AES, every round key of its
/// schedule and its GHASH key; for XAES-256-GCM also the CMAC subkeys and, for each block
/// in the file, the derived key, its round keys and GHASH key; for XChaCha20-Poly1305 each
/// block's HChaCha20 subkey.
struct KeyNeedles {
    /// Every piece, labelled.
    private(set) var all: [(String, [UInt8])] = []
    /// The halves of the file keys only.
    private(set) var fileKeys: [(String, [UInt8])] = []
    /// The AES schedules and GHASH keys of the file keys themselves (AES ciphers).
    private(set) var fileKeySchedules: [(String, [UInt8])] = []

    init(store: String, passcode: String, deviceKey: String, files: [String]) throws {
        let kb = try Keybag.load(storePath: store)
        let dk = try DeviceKeyFile.load(from: deviceKey)
        let pc = SecureKey(count: passcode.utf8.count) { b in b.copyBytes(from: Array(passcode.utf8)) }
        let keys = try kb.unlock(passcode: pc, deviceKey: dk)
        defer { keys.wipe(); pc.wipe(); dk.wipe() }
        let classA = try keys.classA.withBytes { Array($0) }
        all += [("class A key[0..<16]", Array(classA[0..<16])), ("class A key[16..<32]", Array(classA[16..<32]))]
        for path in files {
            let name = (path as NSString).lastPathComponent.prefix(8)
            let data = [UInt8](try Data(contentsOf: URL(fileURLWithPath: path)))
            let h = try FileHeader.parse(Array(data.prefix(FileHeader.size)))
            let raw = try h.unwrap(using: .symmetric(keys.classA))
            defer { raw.wipe() }
            var wrapSubkey = [UInt8](repeating: 0, count: 32)  // XChaCha20's subkey of the file key's wrap
            crypto_core_hchacha20(&wrapSubkey, Array(h.wrappedKey[0..<16]), classA, nil)
            all += [
                ("\(name) wrap subkey[0..<16]", Array(wrapSubkey[0..<16])),
                ("\(name) wrap subkey[16..<32]", Array(wrapSubkey[16..<32])),
            ]
            let k = try raw.withBytes { Array($0) }
            fileKeys += [("\(name) key[0..<16]", Array(k[0..<16])), ("\(name) key[16..<32]", Array(k[16..<32]))]
            all += fileKeys.suffix(2)
            let layout = BlockLayout(cipher: h.cipher)
            let blocks = (data.count - FileHeader.size + layout.cipherBlockSize - 1) / layout.cipherBlockSize
            switch h.cipher {
            case .aes256gcm:
                fileKeySchedules += Self.aesPieces(k, "\(name)")
                all += Self.aesPieces(k, "\(name)")
            case .xaes256gcm:
                fileKeySchedules += Self.aesPieces(k, "\(name)")
                all += Self.aesPieces(k, "\(name)")
                let l = Self.block(k, [UInt8](repeating: 0, count: 16))
                var k1 = (0..<16).map { i in UInt8(truncatingIfNeeded: (l[i] << 1) | (i < 15 ? l[i + 1] >> 7 : 0)) }
                if l[0] & 0x80 != 0 { k1[15] ^= 0x87 }
                all += [("\(name) L", l), ("\(name) K1", k1)]
                for b in 0..<blocks {
                    let n = Array(data[layout.cipherOffset(ofBlock: b)..<(layout.cipherOffset(ofBlock: b) + 12)])
                    let kx =
                        Self.block(k, zip([0, 1, 0x58, 0] + n, k1).map { $0 ^ $1 })
                        + Self.block(k, zip([0, 2, 0x58, 0] + n, k1).map { $0 ^ $1 })
                    all += [
                        ("\(name) block \(b) derived[0..<16]", Array(kx[0..<16])),
                        ("\(name) block \(b) derived[16..<32]", Array(kx[16..<32])),
                    ]
                    all += Self.aesPieces(kx, "\(name) block \(b) derived")
                }
            case .xchacha20poly1305:
                for b in 0..<blocks {
                    let n = Array(data[layout.cipherOffset(ofBlock: b)..<(layout.cipherOffset(ofBlock: b) + 16)])
                    var sub = [UInt8](repeating: 0, count: 32)
                    crypto_core_hchacha20(&sub, n, k, nil)
                    all += [
                        ("\(name) block \(b) subkey[0..<16]", Array(sub[0..<16])),
                        ("\(name) block \(b) subkey[16..<32]", Array(sub[16..<32])),
                    ]
                }
            }
        }
    }

    /// AES-256 round keys 2...14 of `key` (0 and 1 are the key) and the GHASH key AES_K(0),
    /// each also in the other byte orders implementations keep them in (32-bit words
    /// reversed; GHASH's two 64-bit halves reversed, as OpenSSL's GCM context holds H).
    static func aesPieces(_ key: [UInt8], _ label: String) -> [(String, [UInt8])] {
        var rk = [UInt8](repeating: 0, count: 240)
        precondition(kbfs_test_aes256_round_keys(key, &rk) == 0)
        func words(_ b: [UInt8]) -> [UInt8] { stride(from: 0, to: 16, by: 4).flatMap { b[$0..<($0 + 4)].reversed() } }
        func halves(_ b: [UInt8]) -> [UInt8] { Array(b[0..<8].reversed()) + Array(b[8..<16].reversed()) }
        let h = block(key, [UInt8](repeating: 0, count: 16))
        return (2..<15).flatMap { i -> [(String, [UInt8])] in
            let r = Array(rk[(16 * i)..<(16 * i + 16)])
            return [("\(label) round key \(i)", r), ("\(label) round key \(i) (words reversed)", words(r))]
        } + [("\(label) GHASH key", h), ("\(label) GHASH key (halves reversed)", halves(h))]
    }

    /// One AES-256 block.
    static func block(_ key: [UInt8], _ input: [UInt8]) -> [UInt8] {
        var out = [UInt8](repeating: 0, count: 16)
        precondition(kbfs_test_aes256_block(key, input, &out) == 0)
        return out
    }
}

/// A scan of another process's writable and anonymous memory (`/proc/PID/maps` and
/// `/proc/PID/mem`, as root) for 32-byte pieces of known secrets.
struct MemoryScan {
    /// Bytes read, and regions that could be read.
    private(set) var bytesScanned = 0
    private(set) var regions = 0
    /// Pieces found: (offset of the piece in its secret, address).
    private(set) var plaintextHits: [String] = []
    private let pid: pid_t
    private let memFD: Int32

    /// Scans `pid` for every 32-byte piece (at 32-byte offsets) of each secret.
    init(pid: pid_t, secrets: [[UInt8]]) throws {
        self.pid = pid
        memFD = open("/proc/\(pid)/mem", O_RDONLY | O_CLOEXEC)
        guard memFD >= 0 else { throw Errno(errno) }
        var pieces: [UInt64: [(Int, Int)]] = [:]
        var filter = [UInt64](repeating: 0, count: 1 << 14)  // 2^20 bits keyed by a hash of the first 8 bytes
        for (si, s) in secrets.enumerated() {
            for off in stride(from: 0, through: s.count - 32, by: 32) {
                let w = s.withUnsafeBytes { $0.loadUnaligned(fromByteOffset: off, as: UInt64.self) }
                pieces[w, default: []].append((si, off))
                let h = PieceIndex.bit(w)
                filter[h >> 6] |= 1 << UInt64(h & 63)
            }
        }
        guard !secrets.isEmpty else { return }  // a scan for key pieces (`find`) only needs `memFD`
        var found: [String] = []
        (bytesScanned, regions) = forEachChunk(overlap: 31) { b, addr in
            Self.filterHits(b, width: 32, filter) { j in
                guard let cands = pieces[b.loadUnaligned(fromByteOffset: j, as: UInt64.self)] else { return }
                for (si, off) in cands
                where memcmp(b.baseAddress! + j, secrets[si].withUnsafeBytes { $0.baseAddress! + off }, 32) == 0 {
                    found.append("secret \(si) offset \(off) at 0x\(String(addr + j, radix: 16))")
                }
            }
        }
        plaintextHits = found
    }

    /// Reads every scanned region in 4 MiB chunks that overlap by `overlap` bytes and hands
    /// each to `body` with its address; returns the bytes read and the regions that could be read.
    func forEachChunk(overlap: Int, _ body: (UnsafeRawBufferPointer, Int) -> Void) -> (Int, Int) {
        var total = 0, readable = 0
        for (start, end) in Self.regions(pid) {
            var addr = start, regionRead = false
            while addr < end {
                let len = min(4 << 20, end - addr)
                var buf = [UInt8](repeating: 0, count: len)
                let n = pread(memFD, &buf, len, off_t(addr))
                if n <= 0 { addr += 4096; continue }
                regionRead = true
                total += n
                buf.withUnsafeBytes { body(UnsafeRawBufferPointer(rebasing: $0[0..<n]), addr) }
                addr += max(n - overlap, 1)
            }
            if regionRead { readable += 1 }
        }
        return (total, readable)
    }

    /// 16-byte pieces (label, bytes) by their first 8 bytes, with a bit filter of those words.
    struct PieceIndex {
        var byWord: [UInt64: [(String, [UInt8])]] = [:]
        /// 2^20 bits keyed by a hash of the first 8 bytes: most offsets are ruled out by one
        /// bit test instead of a dictionary lookup (the tests are built without optimisation).
        var filter = [UInt64](repeating: 0, count: 1 << 14)

        /// The filter bit of a word.
        static func bit(_ w: UInt64) -> Int { Int((w &* 0x9E37_79B9_7F4A_7C15) >> 44) }
    }

    /// Indexes 16-byte pieces (label, bytes).
    static func pieceIndex(_ pieces: [(String, [UInt8])]) -> PieceIndex {
        var index = PieceIndex()
        for p in pieces where p.1.count == 16 {
            let w = p.1.withUnsafeBytes { $0.loadUnaligned(as: UInt64.self) }
            index.byWord[w, default: []].append(p)
            let h = PieceIndex.bit(w)
            index.filter[h >> 6] |= 1 << UInt64(h & 63)
        }
        return index
    }

    /// The pieces of `index` found in `b`, each as "label at " + `place(offset)`.
    static func matches(_ b: UnsafeRawBufferPointer, _ index: PieceIndex, place: (Int) -> String) -> [String] {
        var found: [String] = []
        filterHits(b, width: 16, index.filter) { j in
            guard let cands = index.byWord[b.loadUnaligned(fromByteOffset: j, as: UInt64.self)] else { return }
            for (label, bytes) in cands where memcmp(b.baseAddress! + j, bytes, 16) == 0 {
                found.append("\(label) at \(place(j))")
            }
        }
        return found
    }

    /// Hands `body` each offset of `b` where a `width`-byte piece may start: its first 8
    /// bytes' bit is set in `filter` (`PieceIndex.bit`). The pass over every byte runs in C
    /// (`kbfs_test_filter_hits`): in this unoptimised build a Swift loop took ~40 s per cipher.
    static func filterHits(_ b: UnsafeRawBufferPointer, width: Int, _ filter: [UInt64], _ body: (Int) -> Void) {
        guard b.count >= width else { return }
        var hits = [Int](repeating: 0, count: 4096)
        var start = 0
        while start + width <= b.count {
            let n = filter.withUnsafeBufferPointer { f in
                hits.withUnsafeMutableBufferPointer { out in
                    kbfs_test_filter_hits(
                        b.baseAddress!.assumingMemoryBound(to: UInt8.self), b.count, width, f.baseAddress!, start,
                        out.baseAddress!, out.count)
                }
            }
            for k in 0..<n { body(hits[k]) }
            guard n == hits.count else { return }
            start = hits[n - 1] + 1
        }
    }

    /// Where 16-byte `pieces` occur in `pid`'s scanned memory.
    static func find(pid: pid_t, pieces: [(String, [UInt8])]) -> [String] {
        guard let scan = try? MemoryScan(pid: pid, secrets: []) else { return ["cannot read /proc/\(pid)/mem"] }
        let index = pieceIndex(pieces)
        var found: [String] = []
        _ = scan.forEachChunk(overlap: 15) { b, addr in
            found += matches(b, index) { "0x" + String(addr + $0, radix: 16) }
        }
        return found
    }

    /// Where 16-byte `pieces` occur in a file (a core dump).
    static func find(file: String, pieces: [(String, [UInt8])]) -> [String] {
        guard let data = FileManager.default.contents(atPath: file) else { return ["cannot read \(file)"] }
        let index = pieceIndex(pieces)
        return data.withUnsafeBytes { matches($0, index) { "offset \($0)" } }
    }

    /// How many times `needle` occurs in the scanned memory.
    func count(of needle: [UInt8]) -> Int {
        var found = 0
        _ = forEachChunk(overlap: needle.count - 1) { b, _ in
            var j = 0
            while j + needle.count <= b.count, let hit = memchr(b.baseAddress! + j, Int32(needle[0]), b.count - j) {
                let at = UnsafeRawPointer(hit) - b.baseAddress!
                if at + needle.count <= b.count && memcmp(hit, needle, needle.count) == 0 { found += 1 }
                j = at + 1
            }
        }
        return found
    }

    /// Address ranges that can hold data written at run time: writable or anonymous mappings.
    static func regions(_ pid: pid_t) -> [(Int, Int)] {
        guard let maps = ProcFile.read("/proc/\(pid)/maps") else { return [] }
        return maps.split(separator: "\n").compactMap { line in
            let f = line.split(separator: " ", omittingEmptySubsequences: true)
            guard f.count >= 5 else { return nil }
            let name = f.count >= 6 ? String(f[5]) : ""
            if name == "[vvar]" || name == "[vsyscall]" || name == "[vvar_vclock]" { return nil }
            guard f[1].contains("w") || name.isEmpty || name.hasPrefix("[") else { return nil }
            let r = f[0].split(separator: "-")
            guard r.count == 2, let a = Int(r[0], radix: 16), let b = Int(r[1], radix: 16) else { return nil }
            guard b - a <= 1 << 34 else { return nil }  // sanitizer shadow reservations, not data
            return (a, b)
        }
    }
}
