import Foundation
import Glibc
import KeybagProtocol
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `ControlServer` on a Unix socket in the test's folder, over a seed store's `Controller`
/// (`SeedStoreTestCase`, no mount), driven by clients as `keybagctl` and other users'
/// programs would: line framing, refusals, peer credentials, per-user limits.
final class ControlServerTests: SeedStoreTestCase {
    var controller: Controller!
    var server: ControlServer!
    var socketPath: String { dir + "/control.sock" }
    var clients: [Int32] = []

    override func setUpWithError() throws {
        try super.setUpWithError()
        controller = Controller(
            keybag: keybag, deviceKey: deviceKey, keyring: keyring, fs: fs, grace: 0, mountpoint: "/nowhere",
            owner: 4242)
        server = try ControlServer(path: socketPath, controller: controller, owner: 4242)
        server.start()
    }

    override func tearDown() {
        for fd in clients { close(fd) }
        server?.stop()
        controller?.shutdown()
        super.tearDown()
    }

    /// A connected client (closed at teardown) that gives up reading after 5 s.
    func connect() throws -> Int32 {
        let fd = try ControlClient.connect(path: socketPath)
        var tv = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        clients.append(fd)
        return fd
    }

    /// Writes raw bytes, as one send where they fit.
    func write(_ fd: Int32, _ text: String) {
        let bytes = Array(text.utf8)
        var off = 0
        while off < bytes.count {
            let n = bytes.withUnsafeBytes { send(fd, $0.baseAddress! + off, bytes.count - off, Int32(MSG_NOSIGNAL)) }
            guard n > 0 else { return }
            off += n
        }
    }

    /// The reply lines a client reads until EOF or its timeout.
    func lines(_ fd: Int32, count: Int) -> [String] {
        var buffer: [UInt8] = []
        var out: [String] = []
        while out.count < count, let line = ControlClient.readLine(fd, buffer: &buffer) { out.append(line) }
        return out
    }

    func refusal(_ line: String?) -> ControlRefusal? {
        line.flatMap { ControlProtocol.decode(ControlRefusal.self, from: $0) }.flatMap { $0.ok ? nil : $0 }
    }

    /// Threads of this process named as the accept thread (a client's thread is `kbfs-client`).
    func acceptThreads() -> Int {
        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/task")) ?? []
        return tasks.filter { ProcFile.read("/proc/self/task/\($0)/comm") == "kbfs-control\n" }.count
    }

    func testStopEndsTheAcceptThreadAndNoOneConnectsAfterIt() throws {
        let fd = try connect()
        write(fd, ControlCall.status.line + "\n")
        XCTAssertEqual(lines(fd, count: 1).count, 1, "served before the stop")
        let running = acceptThreads()
        XCTAssertGreaterThanOrEqual(running, 1, "the accept thread runs")
        server.stop()
        server = nil
        // A blocked accept() on a closed descriptor never returns: the thread would stay, and
        // the descriptor's number could be handed to the next open() under it.
        XCTAssertTrue(waitUntil { self.acceptThreads() == running - 1 }, "the accept thread still runs after stop()")
        XCTAssertThrowsError(try ControlClient.connect(path: socketPath), "the socket is gone")
    }

    func testPipelinedRequestsAreAnsweredInOrderAndBlankLinesAreIgnored() throws {
        let fd = try connect()
        write(fd, "\n \r\n\t\n" + ControlCall.status.line + "\n" + ControlCall.policy.line + "\n")
        let replies = lines(fd, count: 2)
        XCTAssertEqual(replies.count, 2, "\(replies)")
        let status = try XCTUnwrap(ControlProtocol.decode(StatusReply.self, from: replies.first ?? ""))
        XCTAssertEqual(status.state, .beforeFirstUnlock)
        XCTAssertEqual(status.mountpoint, "/nowhere")
        XCTAssertEqual(status.owner, 4242)
        XCTAssertNotNil(ControlProtocol.decode(PolicyReply.self, from: replies.last ?? ""), replies.last ?? "")
    }

    func testALineThatIsNotARequestIsRefusedAndTheConnectionStays() throws {
        let fd = try connect()
        write(fd, "this is not json\n" + #"{"op":"reboot"}"# + "\n" + ControlCall.status.line + "\n")
        let replies = lines(fd, count: 3)
        XCTAssertEqual(refusal(replies.first)?.error, .badRequest, "\(replies)")
        XCTAssertEqual(refusal(replies.dropFirst().first)?.error, .badRequest, "an unknown op")
        XCTAssertEqual(ControlProtocol.decode(StatusReply.self, from: replies.last ?? "")?.state, .beforeFirstUnlock)
    }

    /// A request line of 64 KiB is served; a longer one is refused, and the connection ends.
    func testLinesUpTo64KiBAreServedAndLongerOnesEndTheConnection() throws {
        let fd = try connect()
        let status = ControlCall.status.line
        write(fd, status + String(repeating: " ", count: ControlProtocol.maxLine - status.utf8.count) + "\n")
        XCTAssertEqual(
            ControlProtocol.decode(StatusReply.self, from: lines(fd, count: 1).first ?? "")?.state, .beforeFirstUnlock)
        write(fd, String(repeating: "a", count: ControlProtocol.maxLine + 1))
        let replies = lines(fd, count: 2)
        XCTAssertEqual(replies.count, 1, "one refusal, then EOF: \(replies)")
        XCTAssertEqual(refusal(replies.first)?.error, .badRequest)
        XCTAssertEqual(refusal(replies.first)?.message, "line longer than 64 KiB")
    }

    func testAWrongPasscodeIsRefusedAndCounted() throws {
        let fd = try connect()
        write(fd, ControlCall.unlock(passcode: "not the passcode").line + "\n")
        let r = try XCTUnwrap(refusal(lines(fd, count: 1).first))
        XCTAssertEqual(r.error, .badPasscode)
        XCTAssertEqual(r.failedAttempts, 1)
        XCTAssertEqual(controller.state, .beforeFirstUnlock)
    }

    func testASecondDaemonIsRefusedTheLiveSocketButAStaleOneIsReplaced() throws {
        XCTAssertTrue(ControlServer.isLive(socketPath))
        XCTAssertThrowsError(try ControlServer(path: socketPath, controller: controller, owner: 0))
        XCTAssertTrue(ControlServer.isLive(socketPath), "the refused daemon left the live socket alone")
        // A socket file nobody listens on (a daemon that was killed) is taken over.
        let stale = dir + "/stale.sock"
        close(try UnixSocket.make(path: stale) { bind($0, $1, $2) })
        XCTAssertFalse(ControlServer.isLive(stale))
        let second = try ControlServer(path: stale, controller: controller, owner: 0)
        XCTAssertTrue(ControlServer.isLive(stale))
        second.stop()
        XCTAssertFalse(FileManager.default.fileExists(atPath: stale), "stop removes the socket file")
    }

    // MARK: another user (a client run as nobody)

    /// The lines a Python client run as `nobody` read: it opens `connections` connections,
    /// sends each `requests`, and prints every reply line (or `EOF`).
    func asNobody(connections: Int = 1, _ requests: [ControlCall]) throws -> [String] {
        let python = "/usr/bin/python3", setpriv = "/usr/bin/setpriv"
        guard access(python, X_OK) == 0, access(setpriv, X_OK) == 0 else {
            XCTFail("needs python3 and setpriv (util-linux): this test cannot run (a failure, never a skip)")
            return []
        }
        XCTAssertEqual(chmod(dir, 0o755), 0)
        let script = """
            import socket, sys
            path, n, reqs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
            socks = []
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5)
                s.connect(path)
                socks.append(s)
            for s in socks:
                f = s.makefile("rwb")
                for r in reqs:
                    try:
                        f.write(r.encode() + b"\\n"); f.flush()
                    except OSError:
                        pass
                    line = f.readline()
                    print(line.decode().rstrip("\\n") if line else "EOF", flush=True)
            """
        let p = Process()
        p.executableURL = URL(fileURLWithPath: setpriv)
        p.arguments =
            ["--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script, socketPath, "\(connections)"]
            + requests.map(\.line)
        let out = Pipe()
        p.standardOutput = out
        try p.run()
        let data = out.fileHandleForReading.readDataToEndOfFile()
        p.waitUntilExit()
        XCTAssertEqual(p.terminationStatus, 0)
        return String(decoding: data, as: UTF8.self).split(separator: "\n").map(String.init)
    }

    func testOtherUsersMayAskTheStatusButNotLockUnlockOrReadThePolicy() throws {
        let replies = try asNobody([.status, .policy, .lock(grace: 0), .unlock(passcode: "fuzz seed passcode")])
        XCTAssertEqual(replies.count, 4, "\(replies)")
        XCTAssertEqual(ControlProtocol.decode(StatusReply.self, from: replies.first ?? "")?.state, .beforeFirstUnlock)
        for line in replies.dropFirst() { XCTAssertEqual(refusal(line)?.error, .forbidden, line) }
        XCTAssertEqual(controller.state, .beforeFirstUnlock, "the passcode was never tried")
        XCTAssertEqual(controller.status().failedAttempts, 0)
    }

    func testAnotherUsersNinthConnectionIsBusyAndRootIsStillServed() throws {
        let replies = try asNobody(connections: ConnectionSlots.perUID + 1, [.status])
        XCTAssertEqual(replies.count, ConnectionSlots.perUID + 1, "\(replies)")
        for line in replies.prefix(ConnectionSlots.perUID) {
            XCTAssertNotNil(ControlProtocol.decode(StatusReply.self, from: line), line)
        }
        XCTAssertEqual(refusal(replies.last)?.error, .busy, replies.last ?? "")
        let fd = try connect()
        write(fd, ControlCall.status.line + "\n")
        XCTAssertNotNil(ControlProtocol.decode(StatusReply.self, from: lines(fd, count: 1).first ?? ""))
    }
}
