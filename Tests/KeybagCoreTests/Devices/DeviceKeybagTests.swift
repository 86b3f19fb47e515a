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
        let b = try StoreDevices.add(
            storePath: dir, recovery: recovery, passcode: secret("pb"), deviceKey: dkB, name: "b",
            strength: .interactive)
        return (a, dkA, b, dkB, recovery)
    }

    func testEachDeviceOpensItsOwnKeybagWithItsOwnPasscodeAndTheSameClassKeys() throws {
        let (_, dkA, _, dkB, _) = try twoDevices()
        let a = try Keybag.load(storePath: dir, deviceKey: dkA), b = try Keybag.load(storePath: dir, deviceKey: dkB)
        XCTAssertEqual(a.relativePath, "keybag")
        XCTAssertEqual(b.relativePath, "devices/\(try DeviceIdentity.id(deviceKey: dkB, storeID: storeID)).keybag")
        XCTAssertThrowsError(try b.unlock(passcode: secret("pa"), deviceKey: dkB)) {
            XCTAssertEqual($0 as? KeybagError, .badPasscode)
        }
        XCTAssertThrowsError(try a.unlock(passcode: secret("pb"), deviceKey: dkA)) {
            XCTAssertEqual($0 as? KeybagError, .badPasscode)
        }
        let ka = try a.openAll(passcode: secret("pa"), deviceKey: dkA),
            kb = try b.openAll(passcode: secret("pb"), deviceKey: dkB)
        XCTAssertTrue(try same(ka.sets[0].classA, kb.sets[0].classA))
        XCTAssertTrue(try same(ka.classD[0], kb.classD[0]))
        XCTAssertTrue(try same(ka.volume, kb.volume))
        XCTAssertThrowsError(try Keybag.load(storePath: dir, deviceKey: SecureKey(random: 32))) {
            XCTAssertEqual($0 as? KeybagError, .badDeviceKey, "a key of no device")
        }
        // B's failures are written to B's keybag only.
        var bb = b
        XCTAssertEqual(try bb.authenticate(deviceKey: dkB), .authentic)
        try PasscodeAttempts.recordFailure(&bb, now: 1000)
        XCTAssertEqual(try Keybag.load(storePath: dir, deviceKey: dkA).file.failedAttempts, 0)
        XCTAssertEqual(try Keybag.load(storePath: dir, deviceKey: dkB).file.failedAttempts, 1)
    }

    func testARemovalStartsAKeySetTheRemovedDeviceNeverHolds() throws {
        var (a, dkA, b, dkB, recovery) = try twoDevices()
        let idB = try DeviceIdentity.id(deviceKey: dkB, storeID: storeID)
        XCTAssertThrowsError(
            try StoreDevices.remove(&a, idB, passcode: secret("wrong"), deviceKey: dkA, recovery: recovery, now: 1000))
        XCTAssertEqual(a.file.failedAttempts, 1, "a wrong passcode counts")
        XCTAssertThrowsError(
            try StoreDevices.remove(&a, idB, passcode: secret("pa"), deviceKey: dkA, recovery: nil, now: 1500)
        ) {
            XCTAssertTrue("\($0)".contains("recovery key"), "the recovery key must cover the new set: \($0)")
        }
        XCTAssertThrowsError(
            try StoreDevices.remove(
                &a, idB, passcode: secret("pa"), deviceKey: dkA, recovery: RecoveryKey.generate(), now: 1600)
        )
        XCTAssertEqual(a.currentKeySet, 0, "nothing changed")
        XCTAssertEqual(
            try StoreDevices.remove(&a, idB, passcode: secret("pa"), deviceKey: dkA, recovery: recovery, now: 2000), 1)
        XCTAssertGreaterThanOrEqual(a.file.format, Keybag.keySetsFormat, "a keybag older versions refuse")
        XCTAssertFalse(FileManager.default.fileExists(atPath: dir + "/" + b.relativePath))
        XCTAssertEqual(StoreDevices.list(storePath: dir).first { $0.id == idB }?.removedBeforeKeySet, 1)

        // A new file of set 1, and what each device's keyring makes of it.
        let ringA = ClassKeyring(classD: try a.classDKeys(deviceKey: dkA), current: 1)
        ringA.install(try a.unlockAll(passcode: secret("pa"), deviceKey: dkA))
        let ringB = ClassKeyring(classD: try b.classDKeys(deviceKey: dkB), current: 0)
        ringB.install(try b.unlockAll(passcode: secret("pb"), deviceKey: dkB))  // B's copy, as its thief kept it
        for cls in ProtectionClass.allCases {
            let (wrap, _, set) = try XCTUnwrap(ringA.wrappingKey(for: cls))
            XCTAssertEqual(set, 1)
            let h = try FileHeader.create(
                fileKey: SecureKey(random: 32), class: cls, cipher: .xchacha20poly1305, using: wrap, keySet: set)
            XCTAssertNoThrow(try h.unwrap(using: XCTUnwrap(ringA.unwrappingKey(for: cls, keySet: 1))), "\(cls)")
            XCTAssertNil(ringB.unwrappingKey(for: cls, keySet: 1), "B holds no key of set 1 (\(cls))")
            // Claiming set 0 does not make B's keys fit: the set is bound into the wrap.
            var claimed = h
            claimed.keySet = 0
            let b0 = try XCTUnwrap(ringB.unwrappingKey(for: cls, keySet: 0))
            XCTAssertThrowsError(try claimed.unwrap(using: b0), "\(cls)")
            XCTAssertThrowsError(
                try FileHeader.parse(claimed.encodeSlot() + [UInt8](repeating: 0, count: 160)).unwrap(using: b0))
        }
        // Older files still open on A with set 0.
        let (w0, _, _) = try XCTUnwrap(ringB.wrappingKey(for: .complete))
        let old = try FileHeader.create(
            fileKey: SecureKey(random: 32), class: .complete, cipher: .xchacha20poly1305, using: w0)
        XCTAssertNoThrow(try old.unwrap(using: XCTUnwrap(ringA.unwrappingKey(for: .complete, keySet: 0))))
        // The removed device's key now only tells it that it was removed.
        XCTAssertThrowsError(try Keybag.load(storePath: dir, deviceKey: dkB)) {
            XCTAssertTrue("\($0)".contains("was removed"), "\($0)")
        }
        XCTAssertThrowsError(
            try StoreDevices.remove(&a, idB, passcode: secret("pa"), deviceKey: dkA, recovery: recovery))
        XCTAssertThrowsError(
            try StoreDevices.remove(
                &a,
                try DeviceIdentity.id(deviceKey: dkA, storeID: storeID), passcode: secret("pa"), deviceKey: dkA,
                recovery: recovery))
    }

    func testTheRecoveryKeyCoversEveryKeySetAndOnlyItsHoldersWriteEscrow() throws {
        var (a, dkA, _, dkB, recovery) = try twoDevices()
        // A third device C joins before B is removed.
        let dkC = SecureKey(random: 32)
        var c = try StoreDevices.add(
            storePath: dir, recovery: recovery, passcode: secret("pc"), deviceKey: dkC, name: "c",
            strength: .interactive)
        _ = try StoreDevices.remove(
            &a,
            try DeviceIdentity.id(deviceKey: dkB, storeID: storeID), passcode: secret("pa"), deviceKey: dkA,
            recovery: recovery)
        let keysA = try a.openAll(passcode: secret("pa"), deviceKey: dkA)
        XCTAssertEqual(keysA.sets.count, 2)
        let escrowed = try RecoveryEscrow.keys(in: a.file, recovery: recovery)
        XCTAssertEqual(escrowed.sets.count, 2)
        XCTAssertTrue(try escrowed.sameKeys(as: keysA))
        XCTAssertThrowsError(try RecoveryEscrow.keys(in: a.file, recovery: RecoveryKey.generate())) {
            XCTAssertEqual($0 as? KeybagError, .badRecoveryKey)
        }
        // C is behind: it may not remove anyone (its set 1 would be another set 1), and takes up
        // set 1 with `recover` from the keybag that holds it.
        XCTAssertEqual(c.currentKeySet, 0)
        XCTAssertEqual(StoreDevices.newestKeySet(storePath: dir), 1, "C can tell it is behind")
        XCTAssertThrowsError(
            try StoreDevices.remove(&c, "first", passcode: secret("pc"), deviceKey: dkC, recovery: recovery)
        ) {
            XCTAssertTrue("\($0)".contains("recover"), "\($0)")
        }
        // A keybag planted by someone who can write the store, claiming more sets, is passed over.
        var planted =
            try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: dir + "/keybag")))
            as! [String: Any]
        planted["keySet"] = 2
        planted["deviceID"] = String(repeating: "e", count: 32)
        var wrapped = planted["wrapped"] as! [String: String]
        for slot in ["A.2", "B.2", "C.2", "D.2", "rA.2", "rB.2", "rC.2", "rD.2"] {
            wrapped[slot] = wrapped[slot.replacingOccurrences(of: ".2", with: ".1")]
        }
        planted["wrapped"] = wrapped
        planted["classBPublics"] = [
            "1": (planted["classBPublics"] as! [String: String])["1"]!,
            "2": (planted["classBPublics"] as! [String: String])["1"]!,
        ]
        try JSONSerialization.data(withJSONObject: planted).write(
            to: URL(fileURLWithPath: dir + "/devices/\(String(repeating: "e", count: 32)).keybag"))
        let (source, keys) = try StoreDevices.escrowSource(storePath: dir, recovery: recovery)
        XCTAssertEqual(source.relativePath, "keybag", "the planted keybag's slots do not open under their names")
        XCTAssertTrue(try keys.sameKeys(as: keysA))
        try RecoveryEscrow.recover(&c, with: recovery, newPasscode: secret("pc2"), deviceKey: dkC, escrowFrom: source)
        let keysC = try Keybag.load(storePath: dir, deviceKey: dkC).openAll(passcode: secret("pc2"), deviceKey: dkC)
        XCTAssertTrue(try keysC.sameKeys(as: keysA))
        let dkD = SecureKey(random: 32)
        let d = try StoreDevices.add(
            storePath: dir, recovery: recovery, passcode: secret("pd"), deviceKey: dkD, name: nil,
            strength: .interactive)
        XCTAssertEqual(d.currentKeySet, 1)
        // A slot moved to another slot's name does not open there.
        var swapped = a
        swapped.file.wrapped["rA.1"] = a.file.wrapped["rC.1"]
        XCTAssertThrowsError(try RecoveryEscrow.keys(in: swapped.file, recovery: recovery))
    }

    func testTheKeySetOfNewFilesCannotBeEditedOrRolledBackOffline() throws {
        var (a, dkA, _, dkB, recovery) = try twoDevices()
        let before = try Data(contentsOf: URL(fileURLWithPath: dir + "/keybag"))
        let idA = try DeviceIdentity.id(deviceKey: dkA, storeID: storeID)
        _ = try StoreDevices.remove(
            &a,
            try DeviceIdentity.id(deviceKey: dkB, storeID: storeID), passcode: secret("pa"), deviceKey: dkA,
            recovery: recovery)
        XCTAssertTrue(
            FileManager.default.fileExists(atPath: dir + "/state/\(storeID).keysets"), "the removal recorded the floor")
        let after = try Data(contentsOf: URL(fileURLWithPath: dir + "/keybag"))
        func write(_ edit: (inout [String: Any]) -> Void) throws {
            var json = try JSONSerialization.jsonObject(with: after) as! [String: Any]
            edit(&json)
            try JSONSerialization.data(withJSONObject: json).write(to: URL(fileURLWithPath: dir + "/keybag"))
        }
        // The key set of new files set back to 0 (which B still holds): set 1's slots are still there.
        try write { $0["keySet"] = 0 }
        XCTAssertThrowsError(try Keybag.load(storePath: dir, deviceKey: dkA))
        // The MAC stripped from a keybag with key sets is refused.
        try write { $0["cipherMAC"] = nil }
        var stripped = try Keybag.load(storePath: dir, deviceKey: dkA)
        XCTAssertThrowsError(try stripped.authenticate(deviceKey: dkA)) {
            XCTAssertTrue("\($0)".contains("removed offline"), "\($0)")
        }
        // A format-3 keybag claiming format 2 is refused.
        try write { $0["format"] = 2 }
        XCTAssertThrowsError(try Keybag.load(storePath: dir, deviceKey: dkA))
        // The whole keybag from before the removal: its own MACs verify, but this device held set 1.
        try before.write(to: URL(fileURLWithPath: dir + "/keybag"))
        let rolledBack = try Keybag.load(storePath: dir, deviceKey: dkA)
        XCTAssertEqual(rolledBack.currentKeySet, 0)
        XCTAssertThrowsError(try KeySetFloor.check(rolledBack, deviceID: idA)) {
            XCTAssertTrue("\($0)".contains("rolled back"), "\($0)")
        }
        XCTAssertNoThrow(
            try KeySetFloor.check(rolledBack, deviceID: String(repeating: "0", count: 32)),
            "each device has its own floor")
        // An unreadable record fails closed.
        try Data("{".utf8).write(to: URL(fileURLWithPath: dir + "/state/\(storeID).keysets"))
        XCTAssertThrowsError(try KeySetFloor.check(rolledBack, deviceID: String(repeating: "0", count: 32)))
    }
}
