import Foundation
import Glibc
import KeybagProtocol
import XCTest

/// The commands as a user runs them: `keybagfs mount` returning once live, the default
/// socket path, `keybagctl --mount` and discovery, init refusing to overwrite.
final class CommandLineTests: XCTestCase {
    func testBackgroundMountDefaultSocketAndDiscovery() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let bin = MountFixture.binDir
        let r = MountFixture.run(
            bin + "/keybagfs", ["mount", m.store, m.mnt, "--device-key", m.deviceKey, "--grace", "0"])
        XCTAssertEqual(r.code, 0, r.stderr)
        XCTAssertTrue(m.isMounted, "mount returns only once the mount is usable")
        let expectedSocket =
            "/run/keybagfs/"
            + m.mnt.dropFirst().replacingOccurrences(of: "/", with: "-").replacingOccurrences(of: ".", with: ".")
            + ".sock"
        XCTAssertTrue(
            FileManager.default.fileExists(
                atPath: expectedSocket.replacingOccurrences(of: "kbfs-test", with: "kbfs\\x2dtest")),
            "default socket \(expectedSocket)")
        let byMount = MountFixture.run(bin + "/keybagctl", ["--mount", m.mnt, "status", "--json"])
        XCTAssertEqual(byMount.code, 0, byMount.stderr)
        let pid =
            (try? JSONSerialization.jsonObject(with: Data(byMount.stdout.utf8)) as? [String: Any])?["pid"] as? Int ?? 0
        XCTAssertGreaterThan(pid, 0)
        // The only keybagfs mount is found without --socket or --mount.
        let auto = MountFixture.runAlone(
            mount: m.mnt, bin + "/keybagctl", ["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(auto.code, 0, auto.stderr)
        XCTAssertEqual(writeFile(m.path("f"), bytes("hello")), 0)
        XCTAssertEqual(try readFile(m.path("f")).get(), bytes("hello"))
        // A second mount of the same mount point is refused with a clear error.
        let again = MountFixture.run(bin + "/keybagfs", ["mount", m.store, m.mnt, "--device-key", m.deviceKey])
        XCTAssertNotEqual(again.code, 0)
        XCTAssertFalse(again.stderr.isEmpty)
        // Unmounting ends the daemon.
        XCTAssertEqual(MountFixture.run("/bin/fusermount3", ["-u", m.mnt]).code, 0)
        _ = waitUntil(10) { kill(pid_t(pid), 0) != 0 }
        XCTAssertNotEqual(kill(pid_t(pid), 0), 0, "daemon exited after unmount")
        XCTAssertFalse(
            FileManager.default.fileExists(
                atPath: expectedSocket.replacingOccurrences(of: "kbfs-test", with: "kbfs\\x2dtest")), "socket removed")
        if kill(pid_t(pid), 0) == 0 { kill(pid_t(pid), SIGKILL) }
    }

    /// On a machine with many mounts (every systemd host) /proc/self/mountinfo is longer
    /// than one read; the tools must still find the keybagfs mount at its end. Also
    /// `keybagctl pam-unlock` as pam_exec runs it: the owner's password unlocks, a wrong
    /// one leaves the mount locked, and neither fails (exit 0).
    func testToolsFindTheMountBehindManyOtherMountsAndPamUnlock() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let bin = MountFixture.binDir
        var extra: [String] = []
        addTeardownBlock { for d in extra.reversed() { umount2(d, Int32(MNT_DETACH)) } }
        for i in 0..<100 {
            let d = m.root + "/other-mount-\(i)"
            XCTAssertEqual(mkdir(d, 0o755), 0)
            guard Glibc.mount("kbfs-test-tmpfs", d, "tmpfs", 0, "size=64k") == 0 else {
                return XCTFail("mount tmpfs: \(errno)")
            }
            extra.append(d)
        }
        XCTAssertGreaterThan(ProcFile.read("/proc/self/mountinfo")?.utf8.count ?? 0, 8192)
        let r = MountFixture.run(
            bin + "/keybagfs",
            ["mount", m.store, m.mnt, "--device-key", m.deviceKey, "--grace", "0", "--owner", "nobody"])
        XCTAssertEqual(r.code, 0, r.stderr)
        let st = MountFixture.run(bin + "/keybagctl", ["--mount", m.mnt, "status", "--json"])
        let pid = (try? JSONSerialization.jsonObject(with: Data(st.stdout.utf8)) as? [String: Any])?["pid"] as? Int ?? 0
        addTeardownBlock {
            _ = MountFixture.run("/bin/fusermount3", ["-u", m.mnt])
            _ = waitUntil(10) { kill(pid_t(pid), 0) != 0 }
            if pid > 0 && kill(pid_t(pid), 0) == 0 { kill(pid_t(pid), SIGKILL) }
        }
        XCTAssertGreaterThan(pid, 0, st.stderr)
        // report finds the daemon by the path alone.
        let report = MountFixture.run(bin + "/keybagctl", ["report", m.mnt, "--json"])
        XCTAssertEqual(report.code, 0, report.stderr)
        let o = try? JSONSerialization.jsonObject(with: Data(report.stdout.utf8)) as? [String: Any]
        XCTAssertEqual(o?["state"] as? String, "beforeFirstUnlock", report.stdout)
        // pam-unlock: the wrong password, then the right one.
        let pam = ["PAM_TYPE": "auth", "PAM_USER": "nobody"]
        let wrong = MountFixture.runAlone(
            mount: m.mnt, bin + "/keybagctl", ["pam-unlock"], stdin: "not the passcode\u{0}", environment: pam)
        XCTAssertEqual(wrong.code, 0, "a wrong password never fails the login")
        XCTAssertTrue(wrong.stderr.contains("not unlocked"), wrong.stderr)
        XCTAssertFalse(wrong.stderr.contains("not the passcode"), "the password stays out of the log")
        XCTAssertEqual(
            MountFixture.run(bin + "/keybagctl", ["--mount", m.mnt, "status", "--json"]).stdout.contains(
                "\"beforeFirstUnlock\""), true)
        let other = MountFixture.runAlone(
            mount: m.mnt, bin + "/keybagctl", ["pam-unlock"], stdin: m.passcode + "\n",
            environment: ["PAM_TYPE": "auth", "PAM_USER": "root"])
        XCTAssertEqual(other.code, 0)
        XCTAssertTrue(other.stderr.contains("no keybagfs mount belongs to root"), other.stderr)
        // After a failure pam-unlock leaves the mount alone (a login password that differs
        // from the passcode costs one attempt, never a lockout).
        let after = MountFixture.runAlone(
            mount: m.mnt, bin + "/keybagctl", ["pam-unlock"], stdin: m.passcode + "\u{0}", environment: pam)
        XCTAssertEqual(after.code, 0)
        XCTAssertTrue(after.stderr.contains("1 failed attempt(s) since the last unlock; not tried"), after.stderr)
        XCTAssertEqual(
            MountFixture.run(bin + "/keybagctl", ["--mount", m.mnt, "status", "--json"]).stdout.contains(
                "\"failedAttempts\":1"), true)
        // A deliberate unlock resets the count; after a lock the login password unlocks again.
        XCTAssertEqual(
            MountFixture.run(
                bin + "/keybagctl", ["--mount", m.mnt, "unlock", "--passcode-stdin"], stdin: m.passcode + "\n"
            ).code, 0)
        XCTAssertEqual(MountFixture.run(bin + "/keybagctl", ["--mount", m.mnt, "lock", "--grace", "0"]).code, 0)
        let right = MountFixture.runAlone(
            mount: m.mnt, bin + "/keybagctl", ["pam-unlock"], stdin: m.passcode + "\u{0}", environment: pam)
        XCTAssertEqual(right.code, 0, right.stderr)
        XCTAssertTrue(right.stderr.contains("unlocked \(m.mnt) for nobody"), right.stderr)
        XCTAssertEqual(
            MountFixture.run(bin + "/keybagctl", ["--mount", m.mnt, "status", "--json"]).stdout.contains(
                "\"unlocked\""), true)
        // A daemon that does not answer (stopped) delays a login by seconds, not forever.
        XCTAssertEqual(MountFixture.run(bin + "/keybagctl", ["--mount", m.mnt, "lock", "--grace", "0"]).code, 0)
        XCTAssertEqual(kill(pid_t(pid), SIGSTOP), 0)
        let t0 = Date()
        let stuck = MountFixture.runAlone(
            mount: m.mnt, bin + "/keybagctl", ["pam-unlock"], stdin: m.passcode + "\u{0}", environment: pam)
        let waited = Date().timeIntervalSince(t0)
        kill(pid_t(pid), SIGCONT)
        XCTAssertEqual(stuck.code, 0, stuck.stderr)
        XCTAssertLessThan(waited, 11, "pam-unlock waited \(waited) s for a stopped daemon")
        XCTAssertTrue(stuck.stderr.contains("status failed"), stuck.stderr)
    }

    func testInitAndMountErrors() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let bin = MountFixture.binDir
        // init over an existing store refuses and changes nothing.
        let keybag = try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))
        let again = MountFixture.run(
            bin + "/keybagfs", ["init", m.store, "--passcode-stdin", "--device-key", m.deviceKey], stdin: "x\n")
        XCTAssertEqual(again.code, 1)
        XCTAssertEqual(try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag")), keybag)
        // A wrong device key is named as such.
        let otherKey = m.root + "/other.key"
        XCTAssertEqual(writeFile(otherKey, [UInt8](repeating: 1, count: 32), mode: 0o600), 0)
        let wrong = MountFixture.run(
            bin + "/keybagfs", ["mount", m.store, m.mnt, "--device-key", otherKey, "--socket", m.socket])
        XCTAssertEqual(wrong.code, 1)
        XCTAssertTrue(wrong.stderr.contains("device key"), wrong.stderr)
        XCTAssertFalse(m.isMounted)
        // Not a store; a missing mount point; a bad class; a bad option.
        XCTAssertEqual(MountFixture.run(bin + "/keybagfs", ["mount", m.root, m.mnt, "--socket", m.socket]).code, 1)
        XCTAssertEqual(MountFixture.run(bin + "/keybagfs", ["mount", m.store, m.root + "/nope"]).code, 2)
        XCTAssertEqual(
            MountFixture.run(bin + "/keybagfs", ["mount", m.store, m.mnt, "--default-class", "classZ"]).code, 2)
        for bad in [["--threads", "0"], ["--threads", "257"], ["-o", "threads=many"]] {
            let r = MountFixture.run(
                bin + "/keybagfs", ["mount", m.store, m.mnt, "--device-key", m.deviceKey, "--socket", m.socket] + bad)
            XCTAssertEqual(r.code, 2, "\(bad): \(r.stderr)")
            XCTAssertTrue(r.stderr.contains("threads"), r.stderr)
        }
        XCTAssertFalse(m.isMounted)
        // A corrupt keybag is reported, not crashed on.
        try Data("{ not json".utf8).write(to: URL(fileURLWithPath: m.store + "/keybag"))
        let corrupt = MountFixture.run(
            bin + "/keybagfs", ["mount", m.store, m.mnt, "--device-key", m.deviceKey, "--socket", m.socket])
        XCTAssertEqual(corrupt.code, 1)
        XCTAssertTrue(corrupt.stderr.contains("keybag"), corrupt.stderr)
        try keybag.write(to: URL(fileURLWithPath: m.store + "/keybag"))
        try m.mount(extra: ["-o", "threads=2"])
        XCTAssertEqual(m.state, "beforeFirstUnlock")
        m.unlock()
        XCTAssertEqual(writeFile(m.path("two-threads"), bytes("served")), 0)
        XCTAssertEqual(try readFile(m.path("two-threads")).get(), bytes("served"))
        // Help that a person can follow.
        let help = MountFixture.run(bin + "/keybagfs", ["mount", "--help"])
        XCTAssertEqual(help.code, 0)
        XCTAssertTrue(help.stdout.contains("--grace"))
    }

    func testDefaultDeviceKeyLocation() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let store2 = m.root + "/store2"
        let r = MountFixture.run(
            MountFixture.binDir + "/keybagfs", ["init", store2, "--passcode-stdin", "--kdf", "interactive"],
            stdin: "pw\n")
        XCTAssertEqual(r.code, 0, r.stderr)
        let kb =
            try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: store2 + "/keybag")))
            as? [String: Any]
        let id = try XCTUnwrap(kb?["storeID"] as? String)
        let keyPath = "/var/lib/keybagfs/\(id).key"
        addTeardownBlock { try? FileManager.default.removeItem(atPath: keyPath) }
        var st = stat()
        XCTAssertEqual(stat(keyPath, &st), 0, "device key at the default place")
        XCTAssertEqual(st.st_mode & 0o777, 0o600)
        XCTAssertEqual(st.st_size, 32)
        XCTAssertTrue(r.stdout.contains(keyPath))
        // The device key is outside the store, and mount finds it without --device-key.
        XCTAssertFalse(try FileManager.default.contentsOfDirectory(atPath: store2).contains { $0.hasSuffix(".key") })
        let mount = MountFixture.run(MountFixture.binDir + "/keybagfs", ["mount", store2, m.mnt, "--socket", m.socket])
        XCTAssertEqual(mount.code, 0, mount.stderr)
        let unlock = m.ctl(["unlock", "--passcode-stdin"], stdin: "pw\n")
        XCTAssertEqual(unlock.code, 0, unlock.stderr)
        XCTAssertEqual(writeFile(m.path("f"), bytes("x")), 0)
        let pid = m.status()["pid"] as? Int ?? 0
        XCTAssertEqual(MountFixture.run("/bin/fusermount3", ["-u", m.mnt]).code, 0)
        _ = waitUntil(10) { pid <= 0 || kill(pid_t(pid), 0) != 0 }
        if pid > 0 && kill(pid_t(pid), 0) == 0 { kill(pid_t(pid), SIGKILL) }
    }

    /// Paths as typed in a shell: one-letter relative names for the device key, the socket
    /// and the mount point (Foundation 6.3.1 trapped on `s` in `deletingLastPathComponent`:
    /// `init --device-key k` and the daemon's `--socket s` died with SIGILL).
    func testOneLetterRelativePaths() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let bin = MountFixture.binDir
        let initRun = MountFixture.run(
            bin + "/keybagfs", ["init", "t", "--passcode-stdin", "--device-key", "k", "--kdf", "interactive"],
            stdin: "pw\n", cwd: m.root)
        XCTAssertEqual(initRun.code, 0, initRun.stderr)
        XCTAssertEqual(mkdir(m.root + "/m", 0o755), 0)
        let mount = MountFixture.run(
            bin + "/keybagfs", ["mount", "t", "m", "--device-key", "k", "--socket", "s", "--grace", "0"], cwd: m.root)
        XCTAssertEqual(mount.code, 0, mount.stderr)
        addTeardownBlock { umount2(m.root + "/m", Int32(MNT_DETACH)) }
        let unlock = MountFixture.run(
            bin + "/keybagctl", ["unlock", "--socket", "s", "--passcode-stdin"], stdin: "pw\n", cwd: m.root)
        XCTAssertEqual(unlock.code, 0, unlock.stderr)
        XCTAssertEqual(writeFile(m.root + "/m/f", bytes("one letter")), 0)
        XCTAssertEqual(try readFile(m.root + "/m/f").get(), bytes("one letter"))
        let st = MountFixture.run(bin + "/keybagctl", ["status", "--socket", "s", "--json"], cwd: m.root)
        XCTAssertEqual(st.code, 0, st.stderr)
        let pid = (try? JSONSerialization.jsonObject(with: Data(st.stdout.utf8)) as? [String: Any])?["pid"] as? Int ?? 0
        XCTAssertEqual(MountFixture.run("/bin/fusermount3", ["-u", m.root + "/m"]).code, 0)
        _ = waitUntil(10) { pid <= 0 || kill(pid_t(pid), 0) != 0 }
        if pid > 0 && kill(pid_t(pid), 0) == 0 { kill(pid_t(pid), SIGKILL) }
    }
}
