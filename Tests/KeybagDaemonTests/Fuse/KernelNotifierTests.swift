import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `KernelNotifier` without a FUSE session: what INIT agreed is read through it, every page
/// drop asked for reaches its observer (now, or soon from its queue), and none fails or logs
/// while no session is attached.
final class KernelNotifierTests: XCTestCase {
    func testDropsReachTheObserverAndNothingIsLoggedWithoutASession() {
        let drops = Locked<[([UInt64], String)]>([])
        let (log, lines) = EventLog.recording()
        let k = KernelNotifier(
            negotiated: { MountNegotiation(directIOMappable: false, writeback: true) },
            observer: { ids, pass in drops.withLock { $0.append((ids, pass)) } }, log: log)
        XCTAssertEqual(k.negotiated, MountNegotiation(directIOMappable: false, writeback: true))
        k.dropPageCache([3, 4], pass: "now")
        k.dropPagesSoon(5, pass: "soon")
        k.refreshAttributes([3])
        k.forgetEntrySoon(parent: 1, name: "x")
        k.detach()  // waits for the queued work
        XCTAssertEqual(drops.withLock { $0.map(\.0) }, [[3, 4], [5]])
        XCTAssertEqual(drops.withLock { $0.map(\.1) }, ["now", "soon"])
        XCTAssertEqual(lines(), [])
    }
}
