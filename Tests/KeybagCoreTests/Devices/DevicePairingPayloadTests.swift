import Foundation
import XCTest

@testable import KeybagCore

/// What a pairing grant seals (`DevicePairing.payload`): every key set of the store and the
/// volume key, taken back whole by the newcomer; a payload of a wrong shape (no set, more sets
/// than a keybag may hold, a byte short or over) is refused before any key is made of it.
final class DevicePairingPayloadTests: TempDirTestCase {
    /// The seed store's keys (two sets), opened with its device key and passcode.
    func seedKeys() throws -> StoreKeys {
        let store = dir + "/store"
        try FileManager.default.copyItem(atPath: StoreCheckTests.fuzz + "/seed-store", toPath: store)
        let deviceKey = try DeviceKeyFile.load(from: StoreCheckTests.fuzz + "/seed.key")
        defer { deviceKey.wipe() }
        return try Keybag.load(storePath: store, deviceKey: deviceKey)
            .openAll(passcode: secret("fuzz seed passcode"), deviceKey: deviceKey)
    }

    /// A payload of `bytes`.
    func payload(_ bytes: [UInt8]) -> SecureKey { SecureKey(count: bytes.count) { $0.copyBytes(from: bytes) } }

    func testAGrantCarriesEveryKeySetAndTheVolumeKey() throws {
        let keys = try seedKeys()
        defer { keys.wipe() }
        XCTAssertEqual(keys.sets.count, 2)
        let sealed = try DevicePairing.payload(keys)
        defer { sealed.wipe() }
        XCTAssertEqual(sealed.count, 2 + 128 * 2 + 32)
        let back = try DevicePairing.keys(ofPayload: sealed)
        defer { back.wipe() }
        XCTAssertTrue(try back.sameKeys(as: keys))
        XCTAssertEqual(back.sets.map(\.classBPublic), keys.sets.map(\.classBPublic), "class B public keys derived")
        XCTAssertEqual(back.sets.map(\.keySet), [0, 1])
        XCTAssertEqual(try back.volume.withBytes { Array($0) }, try keys.volume.withBytes { Array($0) })
    }

    func testAPayloadOfAWrongShapeIsRefused() throws {
        let one = [UInt8](repeating: 7, count: 2 + 128 + 32)
        var good = one
        good[0] = 1
        good[1] = 0
        XCTAssertNoThrow(try DevicePairing.keys(ofPayload: payload(good)).wipe())
        var none = one
        none[0] = 0
        var tooMany = [UInt8](repeating: 7, count: 2 + 128 * (Keybag.maxKeySet + 2) + 32)
        tooMany[0] = UInt8((Keybag.maxKeySet + 2) & 0xff)
        tooMany[1] = UInt8((Keybag.maxKeySet + 2) >> 8)
        for (what, bytes) in [
            ("no key set", none), ("a byte short", Array(good.dropLast())), ("a byte over", good + [0]),
            ("more sets than a keybag holds", tooMany), ("empty", []),
        ] {
            XCTAssertThrowsError(try DevicePairing.keys(ofPayload: payload(bytes)), what) { error in
                guard case KeybagError.corrupt = error else { return XCTFail("\(what): \(error)") }
            }
        }
    }
}
