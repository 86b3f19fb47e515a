import Foundation
import Glibc
import XCTest

@testable import KeybagDaemon

/// `Connection` on one end of a socket pair, the test reading the other as a client would:
/// replies and events as whole lines, the event queue's bound, a client that stops reading
/// dropped rather than waited for, nothing written once closed.
final class ConnectionTests: XCTestCase {
    /// The daemon's end (owned by the `Connection`) and the client's.
    var daemonFD: Int32 = -1
    var clientFD: Int32 = -1

    override func setUp() {
        var fds: [Int32] = [0, 0]
        XCTAssertEqual(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &fds), 0)
        (daemonFD, clientFD) = (fds[0], fds[1])
        var tv = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(clientFD, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
    }

    override func tearDown() { close(clientFD) }

    /// Everything the client can read until EOF (or the 5 s timeout).
    func readAll() -> String {
        var out: [UInt8] = []
        var buf = [UInt8](repeating: 0, count: 65536)
        while true {
            let n = recv(clientFD, &buf, buf.count, 0)
            if n < 0 && errno == EINTR { continue }
            if n <= 0 { break }
            out += buf[0..<n]
        }
        return String(decoding: out, as: UTF8.self)
    }

    func testRepliesAndEventsArriveAsWholeLinesInOrder() {
        let c = Connection(fd: daemonFD)
        XCTAssertTrue(c.send(#"{"ok":true}"#))
        XCTAssertTrue(c.enqueue(#"{"event":"a"}"#), "queued behind no writer")
        XCTAssertTrue(c.sendEvent(#"{"event":"b"}"#))
        c.close()
        XCTAssertEqual(readAll(), "{\"ok\":true}\n{\"event\":\"a\"}\n{\"event\":\"b\"}\n")
        XCTAssertFalse(c.isDropped)
    }

    func testAClosedConnectionWritesNothingMore() {
        let c = Connection(fd: daemonFD)
        c.close()
        // The number may already belong to another descriptor: nothing may be written to it.
        XCTAssertFalse(c.send("late reply"))
        XCTAssertFalse(c.sendEvent("late event"))
        c.close()  // a second close is harmless
        XCTAssertEqual(readAll(), "")
    }

    func testTheEventQueueIsBounded() {
        let c = Connection(fd: daemonFD)
        defer { c.close() }
        for i in 0..<Connection.maxPending { XCTAssertTrue(c.enqueue("event \(i)"), "event \(i)") }
        XCTAssertFalse(c.enqueue("one too many"), "a subscriber that never reads cannot grow the daemon")
        XCTAssertTrue(c.drain())
        XCTAssertTrue(c.enqueue("room again after a drain"))
    }

    /// Events never wait for a client: when its buffer is full the connection is dropped
    /// (shut down, so its reader sees EOF after what did fit: a line cut there is the last).
    func testAnEventThatDoesNotFitDropsTheConnectionAndNoLineIsCut() {
        var size: Int32 = 4096
        setsockopt(daemonFD, SOL_SOCKET, SO_SNDBUF, &size, socklen_t(MemoryLayout<Int32>.size))
        let c = Connection(fd: daemonFD)
        defer { c.close() }
        let line = String(repeating: "x", count: 1000)
        var sent = 0
        while sent < 10_000, c.sendEvent(line) { sent += 1 }
        XCTAssertLessThan(sent, 10_000, "a client that does not read is dropped")
        XCTAssertTrue(c.isDropped)
        XCTAssertFalse(c.sendEvent(line))
        let got = readAll()  // ends: the daemon's end was shut down
        let whole = got.split(separator: "\n", omittingEmptySubsequences: false).dropLast()
        XCTAssertGreaterThan(whole.count, 0)
        XCTAssertTrue(whole.allSatisfy { $0 == line }, "every delivered line is whole")
    }

    func testHangUpEndsTheClientsStream() {
        let c = Connection(fd: daemonFD)
        defer { c.close() }
        XCTAssertTrue(c.send("before"))
        c.hangUp()
        XCTAssertTrue(c.isDropped)
        XCTAssertEqual(readAll(), "before\n", "the client reads what was sent, then EOF")
    }
}
