import Foundation
import Glibc
import XCTest

@testable import KeybagDaemon

/// The control socket's connection limits: `ConnectionSlots` (a share per unprivileged uid,
/// a separate pool for root and the owner) and `PrivilegedConnections` (which idle connection
/// a privileged newcomer may close for room), the closed connections seen from the client's
/// end of a socket pair.
final class ConnectionSlotsTests: XCTestCase {
    func other(_ uid: uid_t) -> Peer { Peer(uid: uid, privileged: false) }

    func testEachOtherUserHasItsOwnShare() {
        let slots = ConnectionSlots()
        for _ in 0..<ConnectionSlots.perUID { XCTAssertTrue(slots.take(other(1000))) }
        XCTAssertFalse(slots.take(other(1000)), "a ninth connection of one user")
        XCTAssertTrue(slots.take(other(1001)), "another user is not crowded out")
        slots.give(other(1000))
        XCTAssertTrue(slots.take(other(1000)), "a closed connection gives its slot back")
        XCTAssertFalse(slots.take(other(1000)))
    }

    func testOtherUsersCannotUseUpThePrivilegedPool() {
        let slots = ConnectionSlots()
        var taken = 0
        for uid in uid_t(2000)..<2100 {
            for _ in 0..<ConnectionSlots.perUID where slots.take(other(uid)) { taken += 1 }
        }
        XCTAssertEqual(taken, ConnectionSlots.unprivilegedTotal, "all other users together")
        for i in 0..<ConnectionSlots.privilegedTotal {
            XCTAssertTrue(slots.take(Peer(uid: i % 2 == 0 ? 0 : 1000, privileged: true)), "privileged \(i)")
        }
        XCTAssertFalse(slots.take(Peer(uid: 0, privileged: true)), "the privileged pool has its own bound")
        slots.give(other(2000))
        XCTAssertTrue(slots.take(other(2099)), "a slot given back is free for any other user")
    }

    /// Socket pairs: the daemon's ends (registered) and the clients' ends.
    var pairs: [(daemon: Int32, client: Int32)] = []

    func pair() -> (daemon: Int32, client: Int32) {
        var fds: [Int32] = [0, 0]
        XCTAssertEqual(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &fds), 0)
        var tv = timeval(tv_sec: 0, tv_usec: 1)
        setsockopt(fds[1], SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        pairs.append((fds[0], fds[1]))
        return (fds[0], fds[1])
    }

    override func tearDown() {
        for p in pairs { close(p.daemon); close(p.client) }
        pairs = []
    }

    /// Whether the daemon's end of `p` was shut down (its client reads EOF, not a timeout).
    func closed(_ p: (daemon: Int32, client: Int32)) -> Bool {
        var b: UInt8 = 0
        return recv(p.client, &b, 1, Int32(MSG_DONTWAIT)) == 0
    }

    func testRoomIsMadeOnlyFromTheNewcomersOwnIdleConnections() {
        let registry = PrivilegedConnections()
        let owners = pair(), roots = pair()
        let ownersID = registry.add(owners.daemon, uid: 1000)
        _ = registry.add(roots.daemon, uid: 0)
        registry.serving(ownersID, true, subscribed: false)
        XCTAssertFalse(registry.makeRoom(for: 1000), "a connection serving a request is never closed")
        XCTAssertFalse(closed(owners))
        XCTAssertFalse(closed(roots), "the owner never closes root's connection")
        registry.serving(ownersID, false, subscribed: false)
        XCTAssertTrue(registry.makeRoom(for: 1000))
        XCTAssertTrue(closed(owners))
        XCTAssertFalse(closed(roots))
        XCTAssertFalse(registry.makeRoom(for: 1000), "a connection is closed for room once")
    }

    func testRootMayCloseAnyPrivilegedConnectionButNotARemovedOne() {
        let registry = PrivilegedConnections()
        let owners = pair(), gone = pair()
        _ = registry.add(owners.daemon, uid: 1000)
        registry.remove(registry.add(gone.daemon, uid: 1000))
        XCTAssertTrue(registry.makeRoom(for: 0))
        XCTAssertTrue(closed(owners))
        XCTAssertFalse(registry.makeRoom(for: 0))
        XCTAssertFalse(closed(gone), "a removed connection's descriptor number may be reused: never shut down")
    }

    /// Idle non-subscribers go before subscribers, and of the subscribers the newest (a leak
    /// is the latest subscriptions; the oldest is an app's long-lived feed).
    func testIdleRequestConnectionsGoFirstThenTheNewestSubscriber() {
        let registry = PrivilegedConnections()
        let oldFeed = pair(), newFeed = pair(), idle = pair()
        registry.serving(registry.add(oldFeed.daemon, uid: 1000), false, subscribed: true)
        usleep(2000)
        registry.serving(registry.add(newFeed.daemon, uid: 1000), false, subscribed: true)
        _ = registry.add(idle.daemon, uid: 1000)
        XCTAssertTrue(registry.makeRoom(for: 1000))
        XCTAssertEqual([closed(oldFeed), closed(newFeed), closed(idle)], [false, false, true])
        XCTAssertTrue(registry.makeRoom(for: 1000))
        XCTAssertEqual([closed(oldFeed), closed(newFeed)], [false, true])
        XCTAssertTrue(registry.makeRoom(for: 1000))
        XCTAssertTrue(closed(oldFeed))
    }
}
