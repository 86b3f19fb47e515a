import Foundation
import Glibc
import KeybagCore
import KeybagProtocol
import XCTest

/// The control socket's bytes, line by line, from a real daemon: every request and reply
/// shape the contract names, compared with golden lines. Values that differ per run (the
/// pid, the mount point, the time) are put in before comparing; nothing else may change.
final class ControlGoldenTests: XCTestCase {
    /// A connection that sends raw lines and reads raw lines.
    final class Line {
        let fd: Int32
        var buffer: [UInt8] = []
        init(_ path: String) throws { fd = try ControlClient.connect(path: path) }
        deinit { close(fd) }
        /// Sends `line` and returns the next line the daemon sends.
        func ask(_ line: String) throws -> String {
            try ControlClient.sendLine(fd, line)
            return try XCTUnwrap(ControlClient.readLine(fd, buffer: &buffer), "no reply to \(line)")
        }
        /// The next line the daemon sends (an event).
        func next() throws -> String { try XCTUnwrap(ControlClient.readLine(fd, buffer: &buffer)) }
    }

    /// `line` with its ISO 8601 `"time"` value replaced by `TIME`.
    func withoutTime(_ line: String) -> String {
        line.replacingOccurrences(
            of: #""time":"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z""#, with: #""time":"TIME""#,
            options: .regularExpression)
    }

    func testTheControlSocketsBytesAreTheGoldenLines() throws {
        let m = try MountFixture(grace: 2.5)
        addTeardownBlock { m.close() }
        let pid = try XCTUnwrap(m.daemon?.processIdentifier)
        let c = try Line(m.socket)

        // Malformed and unknown requests.
        XCTAssertEqual(try c.ask("{}"), #"{"error":"badRequest","message":"missing \"op\"","ok":false}"#)
        XCTAssertEqual(
            try c.ask(#"{"op":"status","op":"lock"}"#),
            #"{"error":"badRequest","message":"not a flat JSON object: duplicate field \"op\"","ok":false}"#)
        XCTAssertEqual(
            try c.ask(#"{"op":"x/y"}"#), #"{"error":"badRequest","message":"unknown op \"x/y\"","ok":false}"#)
        XCTAssertEqual(
            try c.ask(#"{"op":"unlock"}"#),
            #"{"error":"badRequest","message":"unlock needs a non-empty \"passcode\" string","ok":false}"#)
        XCTAssertEqual(
            try c.ask(#"{"op":"passwd","old":"a"}"#),
            #"{"error":"badRequest","message":"passwd needs non-empty \"old\" and \"new\" strings","ok":false}"#)
        XCTAssertEqual(
            try c.ask(#"{"op":"lock","grace":-1}"#),
            #"{"error":"badRequest","message":"\"grace\" must be a number of seconds from 0 to 86400","ok":false}"#)

        // Status before the first unlock, the mount's grace (2.5 s) as given.
        let status = try c.ask(#"{"op":"status"}"#)
        let golden =
            #"{"aesMemoryLocked":B,"classADirectIO":B,"defaultClass":"completeUntilFirstUserAuthentication","#
            + #""deviceID":"DEV","failedAttempts":0,"grace":2.5,"inactivityRelock":null,"keySet":0,"keySetBehind":false,"#
            + #""mountpoint":"MNT","ok":true,"openFiles":0,"owner":0,"pid":PID,"posixACLs":B,"#
            + #""protectedDataAvailable":false,"refusedRecords":[],"relockIn":null,"retryAfter":0,"state":"beforeFirstUnlock","#
            + #""subscribers":0,"tpm2":{"inUse":false},"writebackCache":B}"#
        // The values that depend on the machine become their placeholders in the line read.
        let shown = status.replacingOccurrences(
            of: #""(aesMemoryLocked|classADirectIO|posixACLs|writebackCache)":(true|false)"#, with: #""$1":B"#,
            options: .regularExpression
        ).replacingOccurrences(
            of: #""deviceID":"[0-9a-f]{32}""#, with: #""deviceID":"DEV""#, options: .regularExpression)
        let expected = golden.replacingOccurrences(of: "MNT", with: m.mnt).replacingOccurrences(
            of: "PID", with: "\(pid)")
        XCTAssertEqual(shown, expected)

        // A subscriber sees the reply, then one line per event.
        let watcher = try Line(m.socket)
        XCTAssertEqual(try watcher.ask(#"{"op":"subscribe"}"#), #"{"ok":true,"state":"beforeFirstUnlock"}"#)

        // A wrong passcode, then the right one.
        XCTAssertEqual(
            try c.ask(#"{"op":"unlock","passcode":"wrong"}"#),
            #"{"error":"badPasscode","failedAttempts":1,"message":"wrong passcode","ok":false}"#)
        XCTAssertEqual(
            try c.ask(#"{"op":"unlock","passcode":"\#(m.passcode)"}"#), #"{"ok":true,"state":"unlocked"}"#)
        XCTAssertEqual(
            withoutTime(try watcher.next()),
            #"{"event":"protectedDataDidBecomeAvailable","state":"unlocked","time":"TIME"}"#)

        // The policy of a mount without rules.
        XCTAssertEqual(try c.ask(#"{"op":"policy"}"#), #"{"ok":true,"rules":[]}"#)

        // A lock with a grace period, then the eviction.
        XCTAssertEqual(try c.ask(#"{"op":"lock","grace":0.2}"#), #"{"ok":true,"state":"locking"}"#)
        XCTAssertEqual(
            withoutTime(try watcher.next()),
            #"{"event":"protectedDataWillBecomeUnavailable","state":"locking","time":"TIME"}"#)
        XCTAssertEqual(
            withoutTime(try watcher.next()),
            #"{"event":"protectedDataDidBecomeUnavailable","state":"locked","time":"TIME"}"#)
        XCTAssertEqual(try c.ask(#"{"op":"lock"}"#), #"{"ok":true,"state":"locked"}"#)

        // A passcode change, and a wrong old passcode.
        XCTAssertEqual(
            try c.ask(#"{"op":"passwd","old":"\#(m.passcode)","new":"another passcode"}"#), #"{"ok":true}"#)
        XCTAssertEqual(
            try c.ask(#"{"op":"passwd","old":"\#(m.passcode)","new":"x"}"#),
            #"{"error":"badPasscode","failedAttempts":1,"message":"wrong passcode","ok":false}"#)

        // Another user: status yes, the rest no.
        let script = """
            import socket, sys
            s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile()
            for line in [b'{"op":"lock"}', b'{"op":"policy"}']:
                s.sendall(line + b'\\n'); print(f.readline().strip())
            """
        let other = MountFixture.run(
            "/usr/bin/setpriv",
            ["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", script, m.socket])
        XCTAssertEqual(
            other.stdout.split(separator: "\n").map(String.init),
            [
                #"{"error":"forbidden","message":"only root and the mounting user may lock","ok":false}"#,
                #"{"error":"forbidden","message":"only root and the mounting user may read the policy","ok":false}"#,
            ], other.stderr)
    }

    /// A status line of a daemon with a TPM, a device id and a pending relock.
    static let statusLine =
        #"{"aesMemoryLocked":false,"classADirectIO":true,"defaultClass":"complete","deviceID":"0123456789abcdef0123456789abcdef","#
        + #""failedAttempts":2,"grace":0.25,"inactivityRelock":48,"keySet":2,"keySetBehind":true,"mountpoint":"/m","ok":true,"#
        + #""openFiles":3,"owner":1000,"pid":4242,"posixACLs":true,"protectedDataAvailable":false,"relockIn":172799,"#
        + #""retryAfter":60,"state":"locked","subscribers":1,"tpm2":{"inLockout":false,"inUse":true,"lockoutAuthSet":true,"#
        + #""lockoutCounter":1,"lockoutRecovery":86400,"maxTries":32,"recoveryTime":600},"writebackCache":true}"#

    /// The lines keybagctl sends, seen by a listener standing in for the daemon.
    func testKeybagctlSendsTheGoldenRequestLines() throws {
        let root = try MountFixture.makeRoot()
        defer { try? FileManager.default.removeItem(atPath: root) }
        let path = root + "/ctl.sock"
        let listener = try UnixSocket.make(path: path) { Glibc.bind($0, $1, $2) }
        defer { close(listener) }
        XCTAssertEqual(listen(listener, 4), 0)
        let statusText = """
            state: locked
            protected data available: no
            open files: 3
            grace: 0.25 s
            unlock throttled: retry in 60 s
            key set: behind (another device made a newer one): new files and class changes are refused until this device takes it up (lock and unlock) or runs `keybagfs recover`
            TPM: in use; lockout counter 1 of 32 tries, one forgiven every 600 s

            """
        let cases: [([String], String?, String, String)] = [
            (["status"], nil, #"{"op":"status"}"#, Self.statusLine),
            (["status", "--json"], nil, #"{"op":"status"}"#, Self.statusLine),
            (["lock", "--grace", "1.5"], nil, #"{"grace":1.5,"op":"lock"}"#, #"{"ok":true,"state":"locked"}"#),
            (["lock"], nil, #"{"op":"lock"}"#, #"{"ok":true,"state":"locked"}"#),
            (
                ["unlock", "--passcode-stdin"], "p\"w/\\x\n", #"{"op":"unlock","passcode":"p\"w/\\x"}"#,
                #"{"ok":true,"state":"unlocked"}"#
            ),
            (
                ["passwd", "--passcode-stdin"], "old\nnew\n", #"{"new":"new","old":"old","op":"passwd"}"#,
                #"{"ok":true}"#
            ),
        ]
        for (args, stdin, request, reply) in cases {
            let seen = Locked<String?>(nil)
            let t = Thread {
                let fd = accept(listener, nil, nil)
                guard fd >= 0 else { return }
                defer { close(fd) }
                var buf: [UInt8] = []
                seen.withLock { $0 = ControlClient.readLine(fd, buffer: &buf) }
                try? ControlClient.sendLine(fd, reply)
            }
            t.start()
            let r = MountFixture.run(MountFixture.binDir + "/keybagctl", ["--socket", path] + args, stdin: stdin)
            XCTAssertEqual(r.code, 0, "\(args): \(r.stderr)")
            XCTAssertEqual(seen.withLock { $0 }, request, "\(args)")
            if args == ["status"] { XCTAssertEqual(r.stdout, statusText) }
            if args == ["status", "--json"] { XCTAssertEqual(r.stdout, Self.statusLine + "\n") }
        }
    }
}
