import Foundation
import Glibc
import KeybagProtocol
import XCTest

@testable import KeybagDaemon

/// `EventHub` with subscribers on socket pairs: the subscribe reply comes before any event,
/// a subscriber that cannot take an event is dropped and hung up, and a connection is only
/// ever removed by itself (not by a later one with its descriptor number).
final class EventHubTests: XCTestCase {
    var clients: [Int32] = []
    var connections: [Connection] = []

    /// A connection whose client end the test reads.
    func connection() -> (Connection, client: Int32) {
        var fds: [Int32] = [0, 0]
        XCTAssertEqual(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &fds), 0)
        var tv = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(fds[1], SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        clients.append(fds[1])
        let c = Connection(fd: fds[0])
        connections.append(c)
        return (c, fds[1])
    }

    override func tearDown() {
        for c in connections { c.close() }
        for fd in clients { close(fd) }
    }

    func testTheSubscribeReplyComesFirstThenEachEvent() throws {
        let hub = EventHub()
        let (c, client) = connection()
        hub.subscribe(c) { ControlProtocol.encode(StateReply(.locked)) }
        hub.publish(.didBecomeAvailable, state: .unlocked)
        XCTAssertTrue(c.drain())
        XCTAssertEqual(hub.count, 1)
        var buffer: [UInt8] = []
        let reply = try XCTUnwrap(ControlClient.readLine(client, buffer: &buffer))
        XCTAssertEqual(ControlProtocol.decode(StateReply.self, from: reply), StateReply(.locked))
        let event = try XCTUnwrap(ControlClient.readLine(client, buffer: &buffer))
        let line = try XCTUnwrap(ControlProtocol.decode(EventLine.self, from: event), event)
        XCTAssertEqual(line.event, .didBecomeAvailable)
        XCTAssertEqual(line.state, .unlocked)
    }

    func testASubscriberThatCannotTakeAnEventIsDroppedAndHungUp() {
        let hub = EventHub()
        let (slow, slowClient) = connection()
        let (fine, _) = connection()
        hub.subscribe(slow) { "reply" }
        hub.subscribe(fine) { "reply" }
        // The slow subscriber's queue is full (its writer is elsewhere, as during a reply).
        while slow.enqueue("queued") {}
        hub.publish(.willBecomeUnavailable, state: .locking)
        XCTAssertEqual(hub.count, 1, "the slow subscriber is gone, the other stays")
        XCTAssertTrue(slow.isDropped)
        XCTAssertFalse(fine.isDropped)
        var b: UInt8 = 0
        var got = 1
        while got > 0 { got = recv(slowClient, &b, 1, 0) }
        XCTAssertEqual(got, 0, "its client reads EOF")
    }

    func testOnlyTheSubscribedConnectionItselfIsRemoved() {
        let hub = EventHub()
        let (c, _) = connection()
        hub.subscribe(c) { "reply" }
        // Another connection that got the same descriptor number after c was closed.
        hub.remove(Connection(fd: c.fd))
        XCTAssertEqual(hub.count, 1)
        hub.remove(c)
        XCTAssertEqual(hub.count, 0)
    }
}
