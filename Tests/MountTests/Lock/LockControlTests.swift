import Foundation
import Glibc
import XCTest

/// Lines printed by a long-running `keybagctl watch --json`, collected on a thread.
final class WatchCollector: @unchecked Sendable {  // lines guarded by `lock`
    let process = Process()
    private let lock = NSLock()
    private var lines: [String] = []

    /// Starts `keybagctl watch --json` and returns once the daemon counts it as a subscriber.
    init(_ m: MountFixture) throws {
        let before = m.status()["subscribers"] as? Int ?? 0
        process.executableURL = URL(fileURLWithPath: MountFixture.binDir + "/keybagctl")
        process.arguments = ["--socket", m.socket, "watch", "--json"]
        let pipe = Pipe()
        process.standardOutput = pipe
        try process.run()
        let h = pipe.fileHandleForReading
        Thread.detachNewThread { [self] in
            var buffer = Data()
            while true {
                let d = h.availableData
                if d.isEmpty { return }
                buffer += d
                while let nl = buffer.firstIndex(of: 0x0A) {
                    let line = String(decoding: buffer[buffer.startIndex..<nl], as: UTF8.self)
                    buffer = Data(buffer[(nl + 1)...])
                    lock.lock(); lines.append(line); lock.unlock()
                }
            }
        }
        guard waitUntil(10, { (m.status()["subscribers"] as? Int ?? 0) > before }) else {
            process.terminate()
            throw NSError(domain: "keybagctl watch did not subscribe", code: 1)
        }
    }

    /// Event names seen so far.
    var events: [String] {
        lock.lock(); defer { lock.unlock() }
        return lines.compactMap { l in
            (try? JSONSerialization.jsonObject(with: Data(l.utf8)) as? [String: Any])?["event"] as? String
        }
    }

    /// Raw lines seen so far.
    var raw: [String] { lock.lock(); defer { lock.unlock() }; return lines }

    /// Waits until `n` events arrived (or 10 s).
    func wait(for n: Int) {
        let deadline = Date().addingTimeInterval(10)
        while events.count < n && Date() < deadline { usleep(20_000) }
    }

    func stop() { process.terminate(); process.waitUntilExit() }
}

/// Lock and unlock through the socket: events, grace period, throttling, passwd, bad input.
final class LockControlTests: XCTestCase {
    func testGracePeriodEventsAndCancelByUnlock() throws {
        let m = try MountFixture(grace: 1.5)
        addTeardownBlock { m.close() }
        let watch = try WatchCollector(m)
        defer { watch.stop() }
        m.unlock()
        watch.wait(for: 1)
        XCTAssertEqual(watch.events, ["protectedDataDidBecomeAvailable"])
        XCTAssertEqual(mkdir(m.path("a"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("a"), "complete"), 0)
        XCTAssertEqual(writeFile(m.path("a/f"), bytes("secret")), 0)

        // Lock with the mount's grace: locking now, locked after the grace period.
        let r = m.ctl(["lock"])
        XCTAssertEqual(r.code, 0, r.stderr)
        XCTAssertEqual(m.state, "locking")
        XCTAssertEqual(m.status()["protectedDataAvailable"] as? Bool, false)
        XCTAssertEqual(try readFile(m.path("a/f")).get(), bytes("secret"), "keys stay during the grace period")
        watch.wait(for: 3)
        XCTAssertEqual(
            watch.events,
            [
                "protectedDataDidBecomeAvailable", "protectedDataWillBecomeUnavailable",
                "protectedDataDidBecomeUnavailable",
            ])
        XCTAssertEqual(m.state, "locked")
        XCTAssertEqual(errnoOf(readFile(m.path("a/f"))), EACCES)
        for line in watch.raw.dropFirst() {
            let o = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any])
            XCTAssertNotNil(o["state"])
            let time = try XCTUnwrap(o["time"] as? String)
            XCTAssertNotNil(
                ISO8601DateFormatter().date(
                    from: time.replacingOccurrences(of: #"\.\d+"#, with: "", options: .regularExpression)), time)
        }

        // Unlock during `locking` cancels the lock. The events prove the unlock really came
        // during the grace period (no `didBecomeUnavailable` between `will` and `available`),
        // so a slow KDF cannot turn this into a test of something else; then the timer's own
        // deadline passes without an eviction.
        m.unlock()
        watch.wait(for: 4)
        let before = watch.events.count
        let grace = 3.0
        let sent = Date()
        XCTAssertEqual(m.ctl(["lock", "--grace", String(grace)]).code, 0)
        XCTAssertEqual(m.state, "locking")
        m.unlock()
        watch.wait(for: before + 2)
        XCTAssertEqual(
            Array(watch.events.dropFirst(before)),
            ["protectedDataWillBecomeUnavailable", "protectedDataDidBecomeAvailable"],
            "the unlock must land inside the grace period and cancel the lock")
        XCTAssertLessThan(Date().timeIntervalSince(sent), grace, "the unlock took longer than the grace period")
        let deadline = sent.addingTimeInterval(grace + 0.5)
        while Date() < deadline { usleep(50_000) }
        XCTAssertEqual(watch.events.count, before + 2, "the cancelled lock fired: \(watch.events)")
        XCTAssertEqual(m.state, "unlocked", "the cancelled lock must not fire")
        XCTAssertEqual(try readFile(m.path("a/f")).get(), bytes("secret"))

        // lock --wait returns once locked.
        let w = m.ctl(["lock", "--grace", "0.3", "--wait"])
        XCTAssertEqual(w.code, 0)
        XCTAssertTrue(w.stdout.contains("locked"), w.stdout)
        XCTAssertEqual(m.state, "locked")
    }

    func testWrongPasscodeThrottlingPersistsAcrossRestart() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        for i in 1...4 {
            let r = m.ctl(["unlock", "--passcode-stdin"], stdin: "wrong \(i)\n")
            XCTAssertEqual(r.code, 1, "wrong passcode is a refusal")
            XCTAssertTrue(r.stderr.contains("badPasscode"), r.stderr)
            XCTAssertFalse(r.stderr.contains("wrong \(i)"), "the passcode must not be echoed")
        }
        let fifth = m.ctl(["unlock", "--passcode-stdin"], stdin: "wrong 5\n")
        XCTAssertEqual(fifth.code, 1)
        XCTAssertTrue(fifth.stderr.contains("retry in"), fifth.stderr)
        // Even the right passcode is throttled now, with a delay of about a minute.
        let r = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 1)
        XCTAssertTrue(r.stderr.contains("throttled"), r.stderr)
        let retry = m.status()["retryAfter"] as? Int ?? 0
        XCTAssertGreaterThan(retry, 50)
        XCTAssertLessThanOrEqual(retry, 60)
        XCTAssertEqual(m.state, "beforeFirstUnlock")
        // A restart does not reset the counter.
        try m.restart()
        let again = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(again.code, 1)
        XCTAssertTrue(again.stderr.contains("throttled"), again.stderr)
        XCTAssertEqual(m.status()["failedAttempts"] as? Int, 5)
    }

    func testPasswdChangesPasscodeWithoutTouchingData() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("a"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("a"), "complete"), 0)
        XCTAssertEqual(writeFile(m.path("a/f"), bytes("kept")), 0)
        var before = stat()
        let backing = m.backing("a/f")
        XCTAssertEqual(stat(backing, &before), 0)
        let bad = m.ctl(["passwd", "--passcode-stdin"], stdin: "not it\nnew passcode\n")
        XCTAssertEqual(bad.code, 1)
        XCTAssertEqual(m.ctl(["passwd", "--passcode-stdin"], stdin: m.passcode + "\nnew passcode\n").code, 0)
        var after = stat()
        XCTAssertEqual(stat(backing, &after), 0)
        XCTAssertEqual(before.st_mtim.tv_sec, after.st_mtim.tv_sec)
        XCTAssertEqual(before.st_mtim.tv_nsec, after.st_mtim.tv_nsec, "no data re-encrypted")
        try m.restart()
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n").code, 1, "old passcode refused")
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: "new passcode\n").code, 0)
        XCTAssertEqual(try readFile(m.path("a/f")).get(), bytes("kept"))
    }

    /// Sends raw bytes on a fresh connection and returns the reply line (nil on close).
    func rawRequest(_ m: MountFixture, _ payload: [UInt8]) -> String? {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(fd) }
        var addr = sockaddr_un()
        addr.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &addr.sun_path) { p in for (i, b) in m.socket.utf8.enumerated() { p[i] = b } }
        let rc = withUnsafePointer(to: &addr) {
            connect(
                fd, UnsafeRawPointer($0).assumingMemoryBound(to: sockaddr.self),
                socklen_t(MemoryLayout<sockaddr_un>.size))
        }
        guard rc == 0 else { return nil }
        var tv = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        _ = payload.withUnsafeBytes { send(fd, $0.baseAddress!, $0.count, Int32(MSG_NOSIGNAL)) }
        var got: [UInt8] = []
        var b = [UInt8](repeating: 0, count: 4096)
        while !got.contains(0x0A) {
            let n = recv(fd, &b, b.count, 0)
            if n <= 0 { break }
            got += b[0..<n]
        }
        guard let nl = got.firstIndex(of: 0x0A) else { return nil }
        return String(decoding: got[..<nl], as: UTF8.self)
    }

    func testControlSocketRejectsBadInputAndStaysUp() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        func errorCode(_ line: String?) -> String? {
            guard let line, let o = try? JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any] else {
                return nil
            }
            XCTAssertEqual(o["ok"] as? Bool, false)
            return o["error"] as? String
        }
        XCTAssertEqual(errorCode(rawRequest(m, bytes("this is not json\n"))), "badRequest")
        XCTAssertEqual(errorCode(rawRequest(m, bytes("{\"op\":\"explode\"}\n"))), "badRequest")
        XCTAssertEqual(errorCode(rawRequest(m, bytes("[1,2,3]\n"))), "badRequest")
        XCTAssertEqual(errorCode(rawRequest(m, bytes("{\"op\":\"unlock\"}\n"))), "badRequest")
        XCTAssertEqual(errorCode(rawRequest(m, bytes("{\"op\":\"lock\",\"grace\":\"soon\"}\n"))), "badRequest")
        XCTAssertEqual(errorCode(rawRequest(m, [UInt8](repeating: 0x41, count: 70_000) + [0x0A])), "badRequest")
        XCTAssertEqual(errorCode(rawRequest(m, [0xff, 0xfe, 0x00, 0x0A])), "badRequest")
        // A silent client does not block anyone.
        let silent = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(silent) }
        var addr = sockaddr_un()
        addr.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &addr.sun_path) { p in for (i, b) in m.socket.utf8.enumerated() { p[i] = b } }
        _ = withUnsafePointer(to: &addr) {
            connect(
                silent, UnsafeRawPointer($0).assumingMemoryBound(to: sockaddr.self),
                socklen_t(MemoryLayout<sockaddr_un>.size))
        }
        _ = send(silent, "{\"op\":", 6, Int32(MSG_NOSIGNAL))
        m.unlock()
        m.lock(grace: 0)
        XCTAssertEqual(m.state, "locked")
        // The file system still answers (class C stays usable after the first unlock).
        XCTAssertEqual(writeFile(m.path("x"), bytes("y")), 0)
        XCTAssertEqual(try readFile(m.path("x")).get(), bytes("y"))
    }

    func testOnlyRootOrTheMountingUserMayLockAndUnlock() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        let asNobody = [
            "--reuid=65534", "--regid=65534", "--clear-groups", MountFixture.binDir + "/keybagctl", "--socket",
            m.socket,
        ]
        let status = MountFixture.run("/usr/bin/setpriv", asNobody + ["status", "--json"])
        XCTAssertEqual(status.code, 0, "anyone may ask status: \(status.stderr)")
        let unlock = MountFixture.run(
            "/usr/bin/setpriv", asNobody + ["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(unlock.code, 1)
        XCTAssertTrue(unlock.stderr.contains("forbidden"), unlock.stderr)
        XCTAssertEqual(m.state, "beforeFirstUnlock")
        m.unlock()
        let lock = MountFixture.run("/usr/bin/setpriv", asNobody + ["lock", "--grace", "0"])
        XCTAssertEqual(lock.code, 1)
        XCTAssertEqual(m.state, "unlocked")
    }

    func testCtlExitCodes() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        XCTAssertEqual(
            MountFixture.run(MountFixture.binDir + "/keybagctl", ["--socket", m.root + "/nothing.sock", "status"]).code,
            3)
        XCTAssertEqual(
            MountFixture.run(MountFixture.binDir + "/keybagctl", ["--socket", m.socket, "frobnicate"]).code, 2)
        XCTAssertEqual(
            MountFixture.run(MountFixture.binDir + "/keybagctl", ["--socket", m.socket, "lock", "--grace", "-1"]).code,
            2)
        XCTAssertEqual(m.ctl(["status"]).code, 0)
        let help = MountFixture.run(MountFixture.binDir + "/keybagctl", ["--help"])
        XCTAssertEqual(help.code, 0)
        XCTAssertTrue(help.stdout.contains("unlock"))
    }
}
