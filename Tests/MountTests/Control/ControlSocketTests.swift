import Foundation
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization
import XCTest

/// The control socket under pressure from other users and idle clients: root and the
/// owner always get an answer, and `status` never waits for a KDF.
final class ControlSocketTests: XCTestCase {
    /// A python program, run as uid 65534, that opens `count` connections (sending `line`
    /// on each unless it is empty), prints how many were accepted and refused, then holds
    /// them until its stdin closes.
    static let crowd = """
        import os, resource, socket, sys
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        path, count, line = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        held, accepted, refused = [], 0, 0
        for i in range(count):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try: s.connect(path)
            except OSError:
                refused += 1
                continue
            s.settimeout(5)
            if line:
                # A refused client may find the connection closed before it even sends.
                try:
                    s.sendall(line.encode() + b'\\n')
                    reply = s.recv(4096)
                except OSError: reply = b''
                if b'"ok":true' in reply: accepted += 1
                else: refused += 1
            held.append(s)
        print('accepted %d refused %d' % (accepted, refused), flush=True)
        sys.stdin.read()
        """

    /// A python program that connects and subscribes every 2 ms for 6 s, holding its last 50.
    static let churn = #"""
        import socket, sys, time
        end = time.time() + 6
        held = []
        while time.time() < end:
            s = socket.socket(socket.AF_UNIX)
            s.connect(sys.argv[1])
            s.sendall(b'{"op":"subscribe"}\n')
            if not held: print("churning", flush=True)
            held = (held + [s])[-50:]
            time.sleep(0.002)
        """#

    /// Starts the crowd as uid 65534; returns the process, its stdin and its first line.
    func startCrowd(_ m: MountFixture, count: Int, line: String) throws -> (Process, Pipe, String) {
        let p = Process()
        p.executableURL = URL(fileURLWithPath: "/usr/bin/setpriv")
        p.arguments = [
            "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", Self.crowd, m.socket,
            String(count), line,
        ]
        let out = Pipe(), inp = Pipe()
        p.standardOutput = out
        p.standardInput = inp
        try p.run()
        var seen = Data()
        while !seen.contains(0x0A) {
            let d = out.fileHandleForReading.availableData
            if d.isEmpty { break }
            seen += d
        }
        return (p, inp, String(decoding: seen, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines))
    }

    /// Seconds a closure takes.
    func timed(_ body: () -> Void) -> Double {
        let t0 = Date()
        body()
        return Date().timeIntervalSince(t0)
    }

    /// One request on a fresh connection; the reply line.
    func request(_ m: MountFixture, _ line: String) -> String {
        guard let fd = try? ControlClient.connect(path: m.socket) else { return "" }
        defer { close(fd) }
        try? ControlClient.sendLine(fd, line)
        var buf: [UInt8] = []
        return ControlClient.readLine(fd, buffer: &buf) ?? ""
    }

    func testAnotherUsersSubscribersCannotKeepTheOwnerFromLocking() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let (crowd, stdin, summary) = try startCrowd(m, count: 200, line: #"{"op":"subscribe"}"#)
        defer { try? stdin.fileHandleForWriting.close(); crowd.waitUntilExit() }
        let parts = summary.split(separator: " ")
        guard parts.count == 4, let accepted = Int(parts[1]) else { return XCTFail("crowd did not start: \(summary)") }
        XCTAssertGreaterThan(accepted, 0, "other users may subscribe: \(summary)")
        XCTAssertLessThanOrEqual(accepted, 8, "one uid gets a bounded share: \(summary)")
        let lock = m.ctl(["lock", "--grace", "0"])
        XCTAssertEqual(lock.code, 0, "the owner's lock: \(lock.stderr)")
        XCTAssertEqual(m.state, "locked")
        m.unlock()
        XCTAssertEqual(m.state, "unlocked")
    }

    /// A python program, run as uid 65534, that subscribes, then sends status requests
    /// without ever reading the replies until the daemon stops reading too (its reply send
    /// waits on the full socket), prints "stuffed", and holds the connection until stdin closes.
    static let stuffer = """
        import socket, sys, time
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sys.argv[1])
        s.sendall(b'{"op":"subscribe"}\\n')
        s.setblocking(False)
        chunk = b'{"op":"status"}\\n' * 256
        stuck_since = None
        while True:
            try:
                s.send(chunk)
                stuck_since = None
            except BlockingIOError:
                if stuck_since is None: stuck_since = time.monotonic()
                elif time.monotonic() - stuck_since > 0.3: break
                time.sleep(0.02)
        print('stuffed', flush=True)
        sys.stdin.read()
        """

    /// Another user's subscriber that never reads keeps its reply send waiting on a full
    /// socket; the owner's lock must not wait for it (events go out without blocking, and a
    /// subscriber that cannot take one at once is dropped).
    func testASubscriberThatNeverReadsDoesNotDelayTheLock() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        // A well-behaved subscriber of root's, to check that events still reach the others.
        let watcher = try ControlClient.connect(path: m.socket)
        defer { close(watcher) }
        try ControlClient.sendLine(watcher, #"{"op":"subscribe"}"#)
        var buf: [UInt8] = []
        XCTAssertTrue(ControlClient.readLine(watcher, buffer: &buf)?.contains("\"ok\":true") ?? false)
        let p = Process()
        p.executableURL = URL(fileURLWithPath: "/usr/bin/setpriv")
        p.arguments = [
            "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", Self.stuffer, m.socket,
        ]
        let out = Pipe(), inp = Pipe()
        p.standardOutput = out
        p.standardInput = inp
        try p.run()
        defer { try? inp.fileHandleForWriting.close(); p.waitUntilExit() }
        let first = String(decoding: out.fileHandleForReading.availableData, as: UTF8.self)
        XCTAssertEqual(first.trimmingCharacters(in: .whitespacesAndNewlines), "stuffed")
        var lock: ToolResult?
        let lockTime = timed { lock = m.ctl(["lock", "--grace", "0"]) }
        XCTAssertEqual(lock?.code, 0, lock?.stderr ?? "")
        print("lock with a stuffed subscriber of another user: \(Int(lockTime * 1000)) ms")
        XCTAssertLessThan(
            lockTime, 2.0,
            "the daemon's reply send to the stuffed subscriber gives up only after 5 s; the lock must not wait for it")
        var events: [String] = []
        while events.count < 2, let line = ControlClient.readLine(watcher, buffer: &buf) { events.append(line) }
        XCTAssertTrue(events.first?.contains("protectedDataWillBecomeUnavailable") ?? false, "\(events)")
        XCTAssertTrue(events.last?.contains("protectedDataDidBecomeUnavailable") ?? false, "\(events)")
        m.unlock()
        XCTAssertEqual(m.state, "unlocked")
    }

    /// A lock that lands between the subscribe request and its reply is still delivered:
    /// the reply's state and the events after it tell one consistent story.
    func testALockDuringSubscribeIsNotMissed() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(environment: ["KEYBAGFS_TEST_FAILPOINTS": "subscribe-before-reply=sleep:1500"])
        m.unlock()
        let fd = try ControlClient.connect(path: m.socket)
        defer { close(fd) }
        try ControlClient.sendLine(fd, #"{"op":"subscribe"}"#)
        usleep(400_000)  // the daemon is inside the failpoint now
        XCTAssertEqual(m.ctl(["lock", "--grace", "0"]).code, 0)
        var buf: [UInt8] = []
        var tv = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        let reply = ControlClient.readLine(fd, buffer: &buf) ?? ""
        XCTAssertTrue(reply.contains("\"ok\":true"), reply)
        if reply.contains("\"state\":\"unlocked\"") {
            let next = ControlClient.readLine(fd, buffer: &buf) ?? "(nothing within 5 s)"
            XCTAssertTrue(
                next.contains("protectedDataWillBecomeUnavailable"),
                "the reply said unlocked, so the lock's events must follow: \(next)")
        } else {
            XCTAssertTrue(reply.contains("\"state\":\"locked\""), reply)
        }
    }

    func testThousandsOfIdleConnectionsDoNotDelayRoot() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let (crowd, stdin, summary) = try startCrowd(m, count: 2000, line: "")
        defer { try? stdin.fileHandleForWriting.close(); crowd.waitUntilExit() }
        XCTAssertTrue(summary.hasPrefix("accepted"), summary)
        // Root's own idle connections too.
        var mine: [Int32] = []
        for _ in 0..<100 { if let fd = try? ControlClient.connect(path: m.socket) { mine.append(fd) } }
        defer { mine.forEach { close($0) } }
        var worst = 0.0
        for _ in 0..<10 {
            var reply = ""
            worst = max(worst, timed { reply = request(m, #"{"op":"status"}"#) })
            XCTAssertTrue(reply.contains("\"ok\":true"), reply)
        }
        var lockReply = ""
        let lockTime = timed { lockReply = request(m, #"{"op":"lock","grace":0}"#) }
        XCTAssertTrue(lockReply.contains("\"ok\":true"), lockReply)
        print(
            "2,000 idle connections of another user, 100 of root: status worst \(Int(worst * 1000)) ms, lock \(Int(lockTime * 1000)) ms"
        )
        XCTAssertLessThan(worst, 0.5)
        XCTAssertLessThan(lockTime, 0.5)
        m.unlock()
        XCTAssertEqual(m.state, "unlocked")
    }

    /// A lock only takes access away: root is never refused one, even when its own leaking
    /// agent holds every privileged connection (the idle one makes room).
    func testRootLocksWhenItsOwnConnectionsAreAllTaken() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        var mine: [Int32] = []
        defer { mine.forEach { close($0) } }
        for _ in 0..<600 { if let fd = try? ControlClient.connect(path: m.socket) { mine.append(fd) } }
        XCTAssertEqual(mine.count, 600)
        usleep(300_000)  // every connection accepted
        var lockReply = ""
        let lockTime = timed { lockReply = request(m, #"{"op":"lock","grace":0}"#) }
        XCTAssertTrue(lockReply.contains("\"ok\":true"), "root's lock with 600 idle root connections: \(lockReply)")
        XCTAssertLessThan(lockTime, 2)
        XCTAssertEqual(m.state, "locked", "status too")
        // The room came from the oldest idle connections: closed by the daemon (EOF).
        var closedByDaemon = 0
        for fd in mine.prefix(20) {
            var pfd = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            var b: UInt8 = 0
            if poll(&pfd, 1, 0) == 1 && recv(fd, &b, 1, Int32(MSG_DONTWAIT)) == 0 { closedByDaemon += 1 }
        }
        XCTAssertGreaterThan(closedByDaemon, 0, "the oldest idle root connections made room")
    }

    /// The owner's leaking agent (subscribers filling every privileged slot, and more
    /// connections arriving all the time) can neither keep root from locking nor close
    /// root's connection before it sends its request.
    func testTheOwnersFloodNeverKeepsRootFromLocking() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        try m.mount(extra: ["--owner", "nobody"])
        m.unlock()
        let (crowd, stdin, summary) = try startCrowd(m, count: 600, line: #"{"op":"subscribe"}"#)
        defer { try? stdin.fileHandleForWriting.close(); crowd.waitUntilExit() }
        XCTAssertTrue(summary.hasPrefix("accepted"), summary)
        // More owner subscribers keep arriving, each making room for itself.
        let churn = Process()
        churn.executableURL = URL(fileURLWithPath: "/usr/bin/setpriv")
        churn.arguments = [
            "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
            Self.churn, m.socket,
        ]
        let churning = Pipe()
        churn.standardOutput = churning
        try churn.run()
        defer { churn.terminate(); churn.waitUntilExit() }
        // Root's requests go in while the flood runs, however slowly python started.
        let said = String(decoding: churning.fileHandleForReading.availableData, as: UTF8.self)
        XCTAssertTrue(said.hasPrefix("churning"), "the flood did not start: \(said)")
        usleep(100_000)
        for i in 0..<6 {
            let reply = request(m, i % 2 == 0 ? #"{"op":"lock","grace":0}"# : #"{"op":"status"}"#)
            XCTAssertTrue(reply.contains("\"ok\":true"), "root's request \(i) during the owner's flood: \(reply)")
            usleep(300_000)
        }
        XCTAssertEqual(m.state, "locked")
    }

    func testStatusAnswersWhileAnUnlockRunsItsKDF() throws {
        let m = try MountFixture(kdf: "moderate")
        addTeardownBlock { m.close() }
        let unlockDone = Atomic<Bool>(false)
        let finished = DispatchSemaphore(value: 0)
        let socket = m.socket, passcode = m.passcode
        let started = Date()
        Thread.detachNewThread {
            _ = MountFixture.run(
                MountFixture.binDir + "/keybagctl", ["--socket", socket, "unlock", "--passcode-stdin"],
                stdin: passcode + "\n")
            unlockDone.store(true, ordering: .releasing)
            finished.signal()
        }
        // Wait until the daemon is inside the KDF: Argon2id "moderate" fills 256 MiB.
        let pid = try XCTUnwrap(m.daemon?.processIdentifier)
        func rssMiB() -> Int {
            let s = ProcFile.read("/proc/\(pid)/status") ?? ""
            let line = s.split(separator: "\n").first { $0.hasPrefix("VmRSS:") } ?? ""
            return (Int(line.split(separator: " ", omittingEmptySubsequences: true).dropFirst().first ?? "") ?? 0)
                / 1024
        }
        XCTAssertTrue(
            waitUntil(10) { rssMiB() > 120 || unlockDone.load(ordering: .acquiring) }, "the KDF never started")
        XCTAssertFalse(unlockDone.load(ordering: .acquiring), "the unlock ended before status could be asked during it")
        var replies: [String] = []
        let during = timed { replies.append(request(m, #"{"op":"status"}"#)) }
        let statusEnded = Date().timeIntervalSince(started)
        finished.wait()
        let unlockEnded = Date().timeIntervalSince(started)
        print(
            "status during a moderate-KDF unlock: \(Int(during * 1000)) ms, answered at \(Int(statusEnded * 1000)) ms, unlock done at \(Int(unlockEnded * 1000)) ms"
        )
        XCTAssertTrue(replies[0].contains("\"ok\":true"), replies[0])
        XCTAssertLessThan(statusEnded + 0.1, unlockEnded, "status waited for the unlock's KDF")
        XCTAssertEqual(m.state, "unlocked")
    }

    func testGraceMustBeANumberAndRequestsMustBeFlatObjects() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        func code(_ line: String) -> String? {
            let r = request(m, line)
            return (try? JSONSerialization.jsonObject(with: Data(r.utf8)) as? [String: Any])?["error"] as? String
        }
        XCTAssertEqual(code(#"{"op":"lock","grace":true}"#), "badRequest", "true is not 1 second")
        XCTAssertEqual(code(#"{"op":"lock","grace":[1]}"#), "badRequest")
        XCTAssertEqual(code(#"{"op":"unlock","passcode":{"a":1}}"#), "badRequest")
        XCTAssertEqual(code(#"{"op":"status"} trailing"#), "badRequest")
        XCTAssertEqual(code(#"{"op":"status","op":"lock"}"#), "badRequest", "duplicate fields")
        XCTAssertEqual(m.state, "unlocked", "nothing above locked")
        XCTAssertTrue(request(m, #"{ "op" : "st\u0061tus" }"#).contains("\"ok\":true"), "escapes work")
        // A passcode with escapes reaches the KDF decoded.
        let p = try MountFixture(passcode: "p\"w\\ü")
        addTeardownBlock { p.close() }
        let r = request(p, #"{"op":"unlock","passcode":"p\"w\\\u00fc"}"#)
        XCTAssertTrue(r.contains("\"ok\":true"), r)
    }
}
