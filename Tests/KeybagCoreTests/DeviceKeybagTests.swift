import CSodium
import Foundation
import Glibc
import XCTest
@testable import KeybagCore

/// Devices of one store: a keybag per device, adding with the recovery key, removing by a
/// new key set that the removed device never holds, and the recovery key across key sets.
final class DeviceKeybagTests: TempDirTestCase {
    let storeID = "0123456789abcdef0123456789abcdef"

    /// A store made by device A (passcode "pa", with a recovery key) and joined by device B ("pb").
    func twoDevices() throws -> (a: Keybag, dkA: SecureKey, b: Keybag, dkB: SecureKey, recovery: RecoveryKey) {
        let dkA = SecureKey(random: 32), dkB = SecureKey(random: 32), recovery = RecoveryKey.generate()
        let a = try Keybag.create(
            storePath: dir, storeID: storeID, passcode: secret("pa"), deviceKey: dkA, strength: .interactive,
            recovery: recovery, deviceName: "a")
        let b = try Keybag.addDevice(
            storePath: dir, recovery: recovery, passcode: secret("pb"), deviceKey: dkB, name: "b", strength: .interactive)
        return (a, dkA, b, dkB, recovery)
    }

    func testEachDeviceOpensItsOwnKeybagWithItsOwnPasscodeAndTheSameClassKeys() throws {
        let (_, dkA, _, dkB, _) = try twoDevices()
        let a = try Keybag.load(storePath: dir, deviceKey: dkA), b = try Keybag.load(storePath: dir, deviceKey: dkB)
        XCTAssertEqual(a.relativePath, "keybag")
        XCTAssertEqual(b.relativePath, "devices/\(try DeviceIdentity.id(deviceKey: dkB, storeID: storeID)).keybag")
        XCTAssertThrowsError(try b.unlock(passcode: secret("pa"), deviceKey: dkB)) { XCTAssertEqual($0 as? KeybagError, .badPasscode) }
        XCTAssertThrowsError(try a.unlock(passcode: secret("pb"), deviceKey: dkA)) { XCTAssertEqual($0 as? KeybagError, .badPasscode) }
        let ka = try a.openAll(passcode: secret("pa"), deviceKey: dkA), kb = try b.openAll(passcode: secret("pb"), deviceKey: dkB)
        XCTAssertTrue(try same(ka.sets[0].classA, kb.sets[0].classA))
        XCTAssertTrue(try same(ka.classD[0], kb.classD[0]))
        XCTAssertTrue(try same(ka.volume, kb.volume))
        XCTAssertThrowsError(try Keybag.load(storePath: dir, deviceKey: SecureKey(random: 32))) {
            XCTAssertEqual($0 as? KeybagError, .badDeviceKey, "a key of no device")
        }
        // B's failures are written to B's keybag only.
        var bb = b
        XCTAssertEqual(try bb.authenticate(deviceKey: dkB), .authentic)
        try bb.recordFailure(now: 1000)
        XCTAssertEqual(try Keybag.load(storePath: dir, deviceKey: dkA).file.failedAttempts, 0)
        XCTAssertEqual(try Keybag.load(storePath: dir, deviceKey: dkB).file.failedAttempts, 1)
    }

    func testARemovalStartsAKeySetTheRemovedDeviceNeverHolds() throws {
        var (a, dkA, b, dkB, _) = try twoDevices()
        let idB = try DeviceIdentity.id(deviceKey: dkB, storeID: storeID)
        XCTAssertThrowsError(try a.removeDevice(idB, passcode: secret("wrong"), deviceKey: dkA, now: 1000))
        XCTAssertEqual(a.file.failedAttempts, 1, "a wrong passcode counts")
        XCTAssertEqual(try a.removeDevice(idB, passcode: secret("pa"), deviceKey: dkA, now: 2000), 1)
        XCTAssertEqual(a.file.format, Keybag.keySetsFormat, "a keybag older versions refuse")
        XCTAssertFalse(FileManager.default.fileExists(atPath: dir + "/" + b.relativePath))
        XCTAssertEqual(StoreDevices.list(storePath: dir).first { $0.id == idB }?.removedBeforeKeySet, 1)

        // A new file of set 1, and what each device's keyring makes of it.
        let ringA = ClassKeyring(classD: try a.classDKeys(deviceKey: dkA), current: 1)
        ringA.install(try a.unlockAll(passcode: secret("pa"), deviceKey: dkA))
        let ringB = ClassKeyring(classD: try b.classDKeys(deviceKey: dkB), current: 0)
        ringB.install(try b.unlockAll(passcode: secret("pb"), deviceKey: dkB))   // B's copy, as its thief kept it
        for cls in ProtectionClass.allCases {
            let (wrap, _, set) = try XCTUnwrap(ringA.wrappingKey(for: cls))
            XCTAssertEqual(set, 1)
            let h = try FileHeader.create(fileKey: SecureKey(random: 32), class: cls, cipher: .xchacha20poly1305, using: wrap, keySet: set)
            XCTAssertNoThrow(try h.unwrap(using: XCTUnwrap(ringA.unwrappingKey(for: cls, keySet: 1))), "\(cls)")
            XCTAssertNil(ringB.unwrappingKey(for: cls, keySet: 1), "B holds no key of set 1 (\(cls))")
            // Claiming set 0 does not make B's keys fit: the set is bound into the wrap.
            var claimed = h
            claimed.keySet = 0
            let b0 = try XCTUnwrap(ringB.unwrappingKey(for: cls, keySet: 0))
            XCTAssertThrowsError(try claimed.unwrap(using: b0), "\(cls)")
            XCTAssertThrowsError(try FileHeader.parse(claimed.encodeSlot() + [UInt8](repeating: 0, count: 160)).unwrap(using: b0))
        }
        // Older files still open on A with set 0.
        let (w0, _, _) = try XCTUnwrap(ringB.wrappingKey(for: .complete))
        let old = try FileHeader.create(fileKey: SecureKey(random: 32), class: .complete, cipher: .xchacha20poly1305, using: w0)
        XCTAssertNoThrow(try old.unwrap(using: XCTUnwrap(ringA.unwrappingKey(for: .complete, keySet: 0))))
        // The removed device's key now only tells it that it was removed.
        XCTAssertThrowsError(try Keybag.load(storePath: dir, deviceKey: dkB)) { XCTAssertTrue("\($0)".contains("was removed"), "\($0)") }
        XCTAssertThrowsError(try a.removeDevice(idB, passcode: secret("pa"), deviceKey: dkA))
        XCTAssertThrowsError(try a.removeDevice(try DeviceIdentity.id(deviceKey: dkA, storeID: storeID), passcode: secret("pa"), deviceKey: dkA))
    }

    func testTheRecoveryKeyCoversKeySetsMadeWithoutIt() throws {
        var (a, dkA, _, dkB, recovery) = try twoDevices()
        // A third device C joins before B is removed.
        let dkC = SecureKey(random: 32)
        var c = try Keybag.addDevice(storePath: dir, recovery: recovery, passcode: secret("pc"), deviceKey: dkC, name: "c", strength: .interactive)
        _ = try a.removeDevice(try DeviceIdentity.id(deviceKey: dkB, storeID: storeID), passcode: secret("pa"), deviceKey: dkA)
        let keysA = try a.openAll(passcode: secret("pa"), deviceKey: dkA)
        XCTAssertEqual(keysA.sets.count, 2)
        // The set was sealed to the recovery key's public key: the recovery key opens it.
        let escrowed = try a.escrowedKeys(recovery: recovery)
        XCTAssertEqual(escrowed.sets.count, 2)
        XCTAssertTrue(try same(escrowed.sets[1].classA, keysA.sets[1].classA))
        XCTAssertTrue(try same(escrowed.classD[1], keysA.classD[1]))
        XCTAssertThrowsError(try a.escrowedKeys(recovery: RecoveryKey.generate())) { XCTAssertEqual($0 as? KeybagError, .badRecoveryKey) }
        // C takes up set 1 with `recover` from the newest keybag; a device added now gets both sets.
        XCTAssertEqual(c.currentKeySet, 0)
        XCTAssertEqual(StoreDevices.newestKeySet(storePath: dir), 1, "C can tell it is behind")
        try c.recover(with: recovery, newPasscode: secret("pc2"), deviceKey: dkC, escrowFrom: try Keybag.newest(storePath: dir))
        let keysC = try Keybag.load(storePath: dir, deviceKey: dkC).openAll(passcode: secret("pc2"), deviceKey: dkC)
        XCTAssertTrue(try same(keysC.sets[1].classC, keysA.sets[1].classC))
        let dkD = SecureKey(random: 32)
        let d = try Keybag.addDevice(storePath: dir, recovery: recovery, passcode: secret("pd"), deviceKey: dkD, name: nil, strength: .interactive)
        XCTAssertEqual(d.currentKeySet, 1)
        // A sealed slot moved to another slot's name does not open there.
        var swapped = a
        swapped.file.wrapped["rA.1"] = a.file.wrapped["rC.1"]
        XCTAssertThrowsError(try swapped.escrowedKeys(recovery: recovery))
    }

    func testTheKeySetOfNewFilesCannotBeEditedOffline() throws {
        var (a, dkA, b, dkB, _) = try twoDevices()
        _ = try a.removeDevice(try DeviceIdentity.id(deviceKey: dkB, storeID: storeID), passcode: secret("pa"), deviceKey: dkA)
        _ = b
        // Someone with the store sets the key set of new files back to 0 (which B still holds).
        var json = try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: dir + "/keybag"))) as! [String: Any]
        json["keySet"] = 0
        try JSONSerialization.data(withJSONObject: json).write(to: URL(fileURLWithPath: dir + "/keybag"))
        var edited = try Keybag.load(storePath: dir, deviceKey: dkA)
        XCTAssertThrowsError(try edited.authenticate(deviceKey: dkA)) { XCTAssertTrue("\($0)".contains("edited offline"), "\($0)") }
        // A format-3 keybag claiming format 2 is refused (its key sets would be ignored by older versions).
        json["keySet"] = 1
        json["format"] = 2
        try JSONSerialization.data(withJSONObject: json).write(to: URL(fileURLWithPath: dir + "/keybag"))
        XCTAssertThrowsError(try Keybag.load(storePath: dir, deviceKey: dkA))
    }
}
