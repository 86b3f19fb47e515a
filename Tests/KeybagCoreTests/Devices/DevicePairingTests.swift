import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// Adding a device by approval (`DevicePairing`) on a copy of the seed store, both machines in
/// this process (each with its own state folder, the files between them in the store as a sync
/// engine would bring them): the steps in order, a new device whose keybag opens the very keys
/// of the store; a wrong code approves nothing; an answer changed after the reveal is refused.
final class DevicePairingTests: TempDirTestCase {
    var store = ""
    let newPasscode = "new machine passcode"

    override func setUp() {
        super.setUp()
        store = dir + "/store"
        XCTAssertNoThrow(try FileManager.default.copyItem(atPath: StoreCheckTests.fuzz + "/seed-store", toPath: store))
    }

    /// Runs `body` on machine `name` (its own STATE_DIRECTORY: pairing secrets, pins, floors).
    func on<R>(_ name: String, _ body: () throws -> R) rethrows -> R {
        setenv("STATE_DIRECTORY", dir + "/state-" + name, 1)
        return try body()
    }

    /// One step of the new machine (`device add --approval`).
    func newcomer(_ key: SecureKey, confirming code: String? = nil) throws -> DevicePairing.NewcomerStep {
        try on("new") {
            try DevicePairing.newcomerStep(
                storePath: store, deviceKey: key, name: "laptop", confirmedCode: code, strength: .interactive,
                newPasscode: { secret(newPasscode) }, passcode: { secret(newPasscode) })
        }
    }

    /// One step of the seed device (`device approve`).
    func approve(_ id: String, code: String? = nil) throws -> DevicePairing.ApproverStep {
        try on("seed") {
            let key = try DeviceKeyFile.load(from: StoreCheckTests.fuzz + "/seed.key")
            defer { key.wipe() }
            var kb = try Keybag.load(storePath: store, deviceKey: key)
            return try DevicePairing.approveStep(&kb, id, code: code, deviceKey: key) {
                secret("fuzz seed passcode")
            }
        }
    }

    /// A new machine's device key.
    func newDeviceKey() throws -> SecureKey { try DeviceKeyFile.create(at: dir + "/new.key") }

    /// The pairing up to the code the new machine shows: its id and that code.
    func upToTheCode(_ key: SecureKey) throws -> (id: String, code: String) {
        guard case .requested(let id) = try newcomer(key) else { throw KeybagError.invalid("no request") }
        XCTAssertEqual(try newcomer(key), .waitingForChallenge(id: id))
        XCTAssertEqual(try approve(id), .challenged)
        guard case .showCode(id, let code) = try newcomer(key) else { throw KeybagError.invalid("no code") }
        XCTAssertEqual(try approve(id), .needCode)
        return (id, code)
    }

    func testANewDeviceJoinsByApprovalWithTheStoresOwnKeys() throws {
        let key = try newDeviceKey()
        defer { key.wipe() }
        let (id, code) = try upToTheCode(key)
        guard case .approved(let set, let confirmation) = try approve(id, code: code) else {
            return XCTFail("not approved")
        }
        XCTAssertEqual(try newcomer(key, confirming: confirmation), .added(id: id, keySet: set))
        XCTAssertEqual(try approve(id), .finished, "the approver's pairing files go once it joined")
        let theirs = try on("new") {
            try Keybag.load(storePath: store, deviceKey: key).openAll(passcode: secret(newPasscode), deviceKey: key)
        }
        defer { theirs.wipe() }
        let seedKey = try DeviceKeyFile.load(from: StoreCheckTests.fuzz + "/seed.key")
        defer { seedKey.wipe() }
        let ours = try on("seed") {
            try Keybag.load(storePath: store, deviceKey: seedKey).openAll(
                passcode: secret("fuzz seed passcode"), deviceKey: seedKey)
        }
        defer { ours.wipe() }
        XCTAssertEqual(theirs.current, set)
        XCTAssertTrue(try theirs.sameKeys(as: ours), "the new device opens the store's own keys, every set")
        XCTAssertThrowsError(
            try on("new") {
                try Keybag.load(storePath: store, deviceKey: key).openAll(passcode: secret("wrong"), deviceKey: key)
            }, "only with its own passcode")
    }

    func testAWrongCodeApprovesNothing() throws {
        let key = try newDeviceKey()
        defer { key.wipe() }
        let (id, code) = try upToTheCode(key)
        let wrong = String(code.reversed()) == code ? code + "0" : String(code.reversed())
        XCTAssertThrowsError(try approve(id, code: wrong))
        XCTAssertNil(
            PairingMessages.read(PairingMessages.Grant.self, store, id, "grant"), "no grant was written")
        XCTAssertEqual(try newcomer(key, confirming: "anything"), .showCode(id: id, code: code), "nothing to take up")
    }

    func testAnAnswerChangedAfterTheRevealIsRefused() throws {
        let key = try newDeviceKey()
        defer { key.wipe() }
        let (id, _) = try upToTheCode(key)
        // Someone with write access to the synced folder answers again, with a nonce of theirs.
        guard var challenge = PairingMessages.read(PairingMessages.Challenge.self, store, id, "challenge") else {
            return XCTFail("no challenge")
        }
        challenge.nonce = Data(Sodium.randomArray(32)).base64EncodedString()
        try PairingMessages.write(challenge, store, id, "challenge")
        XCTAssertThrowsError(try newcomer(key)) { error in
            XCTAssertTrue("\(error)".contains("changed after this device revealed"), "\(error)")
        }
    }
}
