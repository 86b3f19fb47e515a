import Foundation
import Glibc
import KeybagProtocol
import XCTest

/// Issue 11, item 5: a lock never stalls suspend. The kernel freezes every task before
/// sleeping and cannot freeze one waiting for a FUSE reply, so once `locked` no request may
/// be parked in the daemon: readers hammering class A and B files are frozen (cgroup
/// freezer, as systemd freezes sessions) right after the lock, and nothing waits in FUSE.
final class SleepFreezeTests: XCTestCase {
    /// A freezer cgroup for the readers: v1 `freezer.state` or v2 `cgroup.freeze`.
    struct Freezer {
        let dir: String
        let v2: Bool

        /// Creates a fresh cgroup; throws (the test fails) when neither freezer exists.
        static func make() throws -> Freezer {
            let name = "kbfs-test-\(getpid())"
            if FileManager.default.fileExists(atPath: "/sys/fs/cgroup/freezer/freezer.state")
                || FileManager.default.fileExists(atPath: "/sys/fs/cgroup/freezer/tasks")
            {
                let d = "/sys/fs/cgroup/freezer/" + name
                guard mkdir(d, 0o755) == 0 || errno == EEXIST else {
                    throw NSError(domain: "mkdir \(d): \(errno)", code: 1)
                }
                return Freezer(dir: d, v2: false)
            }
            let mounts = ProcFile.read("/proc/self/mountinfo") ?? ""
            for line in mounts.split(separator: "\n") where line.contains(" - cgroup2 ") {
                let d = String(line.split(separator: " ")[4]) + "/" + name
                guard mkdir(d, 0o755) == 0 || errno == EEXIST else { continue }
                return Freezer(dir: d, v2: true)
            }
            throw NSError(
                domain: "no cgroup freezer (v1 /sys/fs/cgroup/freezer or a cgroup2 mount): this test cannot run",
                code: 1)
        }

        /// Moves a process into the cgroup.
        func add(_ pid: pid_t) -> Bool { write(v2 ? "cgroup.procs" : "tasks", "\(pid)") }
        /// Asks the kernel to freeze (or thaw) the cgroup.
        func freeze(_ on: Bool) -> Bool {
            v2 ? write("cgroup.freeze", on ? "1" : "0") : write("freezer.state", on ? "FROZEN" : "THAWED")
        }
        /// Whether every task in the cgroup is frozen.
        var frozen: Bool {
            if v2 { return (ProcFile.read(dir + "/cgroup.events") ?? "").contains("frozen 1") }
            return (ProcFile.read(dir + "/freezer.state") ?? "").hasPrefix("FROZEN")
        }
        /// Thaws and removes the cgroup (its tasks must be gone).
        func remove() { _ = freeze(false); rmdir(dir) }

        private func write(_ file: String, _ text: String) -> Bool {
            let fd = open(dir + "/" + file, O_WRONLY | O_CLOEXEC)
            guard fd >= 0 else { return false }
            defer { close(fd) }
            return Glibc.write(fd, text, text.utf8.count) == text.utf8.count
        }
    }

    /// A reader: opens its file once and preads it in a loop, and also reopens it each
    /// round; notes "ready" in its log once its descriptor is open, and "eacces" once a read or
    /// open was refused.
    static let readerScript = """
        import os, sys, errno
        path, log = sys.argv[1], sys.argv[2]
        fd = os.open(path, os.O_RDONLY)
        os.pread(fd, 65536, 0)
        open(log, "a").write("ready\\n")
        seen = False
        while True:
            for attempt in (lambda: os.pread(fd, 65536, 0), lambda: os.close(os.open(path, os.O_RDONLY))):
                try:
                    attempt()
                except OSError as e:
                    if e.errno == errno.EACCES and not seen:
                        seen = True
                        open(log, "a").write("eacces\\n")
        """

    func testReadersFreezeRightAfterLocked() throws {
        let freezer = try Freezer.make()
        addTeardownBlock { freezer.remove() }
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(
            environment: ProcessInfo.processInfo.environment["KEYBAGFS_TEST_FAILPOINTS"].map {
                ["KEYBAGFS_TEST_FAILPOINTS": $0]
            } ?? [:])
        m.unlock()
        var files: [String] = []
        for (dir, cls) in [("a", "complete"), ("b", "completeUnlessOpen")] {
            XCTAssertEqual(mkdir(m.path(dir), 0o755), 0)
            XCTAssertEqual(setXattr(m.path(dir), cls), 0)
            for i in 0..<3 {
                let f = m.path("\(dir)/f\(i)")
                XCTAssertEqual(writeFile(f, [UInt8](repeating: UInt8(i), count: 256 * 1024)), 0)
                files.append(f)
            }
        }
        let script = m.root + "/reader.py"
        XCTAssertTrue(FileManager.default.createFile(atPath: script, contents: Data(Self.readerScript.utf8)))
        var readers: [Process] = []
        addTeardownBlock {
            _ = freezer.freeze(false)
            for r in readers where r.isRunning { kill(r.processIdentifier, SIGKILL); r.waitUntilExit() }
        }
        for (i, f) in files.enumerated() {
            let p = Process()
            p.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
            p.arguments = [script, f, m.root + "/reader-\(i).log"]
            p.standardInput = Foundation.FileHandle.nullDevice
            try p.run()
            readers.append(p)
            XCTAssertTrue(freezer.add(p.processIdentifier), "move reader \(p.processIdentifier) into \(freezer.dir)")
        }
        // The readers are in full swing (a slow start must not meet the lock before its open).
        XCTAssertTrue(
            waitUntil(30) {
                files.indices.allSatisfy { (ProcFile.read(m.root + "/reader-\($0).log") ?? "").contains("ready") }
            },
            "the readers did not open their files within 30 s")
        usleep(100_000)
        XCTAssertTrue(readers.allSatisfy(\.isRunning), "every reader runs while unlocked")

        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked")
        let t0 = Date()
        XCTAssertTrue(freezer.freeze(true))
        let frozen = waitUntil(5) { freezer.frozen }
        let ms = Date().timeIntervalSince(t0) * 1000
        print(String(format: "readers frozen %.1f ms after locked (%@ freezer)", ms, freezer.v2 ? "v2" : "v1"))
        XCTAssertTrue(frozen, "the readers did not freeze within 5 s of locked: a request is parked in the daemon")
        // Frozen tasks are not inside a FUSE request.
        for r in readers {
            let wchan = ProcFile.read("/proc/\(r.processIdentifier)/wchan") ?? ""
            XCTAssertFalse(
                wchan.contains("fuse") || wchan.contains("request_wait"),
                "reader \(r.processIdentifier) waits in \(wchan)")
        }
        XCTAssertTrue(freezer.freeze(false))
        XCTAssertTrue(waitUntil(5) { !freezer.frozen })
        // Every reader of class A saw the lock as EACCES; the B readers hold their handles
        // (reopening B is refused too).
        for i in files.indices {
            XCTAssertTrue(
                waitUntil(5) { (ProcFile.read(m.root + "/reader-\(i).log") ?? "").contains("eacces") },
                "reader of \(files[i]) was never refused after the lock")
        }
        XCTAssertTrue(readers.allSatisfy(\.isRunning), "the readers were refused, not killed")
    }
}
