import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `Controller` over a seed store (`SeedStoreTestCase`), with a `Filesystem` but no mount: the
/// lock states, the keys an unlock installs and a lock evicts, the events, the failed-attempt
/// count.
final class ControllerTests: SeedStoreTestCase {
    var controller: Controller!
    let events = Locked<[LockState]>([])

    override func setUpWithError() throws {
        try super.setUpWithError()
        controller = Controller(
            keybag: keybag, deviceKey: deviceKey, keyring: keyring, fs: fs, grace: 0, mountpoint: "/nowhere", owner: 0
        ) { [events] state in events.withLock { $0.append(state) } }
    }

    override func tearDown() {
        controller?.shutdown()
        super.tearDown()
    }

    func testAWrongPasscodeIsCountedAndInstallsNothing() {
        XCTAssertEqual(controller.state, .beforeFirstUnlock)
        guard case .failure(let refusal) = controller.unlock(passcode: passcode("not the passcode")) else {
            return XCTFail("a wrong passcode unlocked")
        }
        XCTAssertEqual(refusal.error, .badPasscode, refusal.message)
        XCTAssertEqual(refusal.failedAttempts, 1)
        XCTAssertEqual(controller.state, .beforeFirstUnlock)
        XCTAssertEqual(controller.status().failedAttempts, 1)
        XCTAssertFalse(keyring.access.canOpen(.complete))
        XCTAssertEqual(events.withLock { $0 }, [])
    }

    func testUnlockInstallsTheKeysAndALockEvictsThem() throws {
        guard case .success(let reply) = controller.unlock(passcode: passcode("fuzz seed passcode")) else {
            return XCTFail("the seed passcode did not unlock")
        }
        XCTAssertEqual(reply.state, .unlocked)
        XCTAssertTrue(keyring.access.canOpen(.complete))
        XCTAssertEqual(controller.status().failedAttempts, 0)
        _ = controller.lock(grace: 0)
        XCTAssertTrue(waitUntil { self.controller.state == .locked })
        XCTAssertFalse(keyring.access.canOpen(.complete), "class A is gone once locked")
        XCTAssertTrue(keyring.access.canOpen(.completeUntilFirstUserAuthentication), "class C stays")
        XCTAssertEqual(events.withLock { $0 }.first, .unlocked)
        XCTAssertEqual(events.withLock { $0 }.last, .locked)
    }

    func testALockWithGraceCanBeCancelledByAnUnlock() {
        guard case .success = controller.unlock(passcode: passcode("fuzz seed passcode")) else {
            return XCTFail("the seed passcode did not unlock")
        }
        XCTAssertEqual(controller.lock(grace: 30).state, .locking)
        XCTAssertTrue(keyring.access.canOpen(.complete), "the keys stay for the grace period")
        guard case .success = controller.unlock(passcode: passcode("fuzz seed passcode")) else {
            return XCTFail("unlock during the grace period")
        }
        XCTAssertEqual(controller.state, .unlocked)
        XCTAssertTrue(keyring.access.canOpen(.complete))
    }
}
