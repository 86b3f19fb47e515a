import Foundation
import XCTest

@testable import KeybagCore

/// The keybag's MACs and slot tags as pure functions of a file (`KeybagMACs`), and the file's
/// own checks (`KeybagFile.validate`).
final class KeybagMACsTests: TempDirTestCase {
    let storeID = "5555aaaa5555aaaa5555aaaa5555aaaa"

    /// The associated data of `slot` at `format`, as text.
    func tag(_ slot: String, _ format: Int) -> String {
        String(decoding: KeybagMACs.ad(storeID, slot, format: format), as: UTF8.self)
    }

    func testDeviceOnlySlotsCarryTheirFormatsTag() {
        XCTAssertEqual(tag("A", 4), "keybagfs-keybag-v1|\(storeID)|A")
        XCTAssertEqual(tag("B.3", 2), "keybagfs-keybag-v1|\(storeID)|B.3")
        XCTAssertEqual(tag("D", 1), "keybagfs-keybag-v1|\(storeID)|D")
        XCTAssertEqual(tag("volume", 2), "keybagfs-keybag-v2|\(storeID)|volume")
        XCTAssertEqual(tag("D.2", 3), "keybagfs-keybag-v2|\(storeID)|D.2")
        XCTAssertEqual(tag("D.2", Keybag.settingsFormat), "keybagfs-keybag-v4|\(storeID)|D.2")
    }

    func testAStoredMACMatchesOnlyItsOwnValue() throws {
        let key = SecureKey(random: 32)
        defer { key.wipe() }
        let mac = try KeybagMACs.mac(Array("message".utf8), key: key)
        XCTAssertEqual(KeybagMACs.storedMAC(mac, matches: mac), true)
        XCTAssertEqual(KeybagMACs.storedMAC(mac, matches: try KeybagMACs.mac(Array("other".utf8), key: key)), false)
        XCTAssertNil(KeybagMACs.storedMAC(nil, matches: mac))
    }

    func testTheCounterAndCipherMACsCoverTheirFields() throws {
        let key = SecureKey(random: 32)
        defer { key.wipe() }
        _ = try Keybag.create(
            storePath: dir, storeID: storeID, passcode: secret("p"), deviceKey: SecureKey(random: 32),
            strength: .interactive)
        let f = try Keybag.load(storePath: dir, relativePath: Keybag.fileName).file  // as saved, its MACs in
        var g = f
        g.failedAttempts += 1
        XCTAssertNotEqual(try KeybagMACs.counterMAC(f, key: key), try KeybagMACs.counterMAC(g, key: key))
        XCTAssertEqual(try KeybagMACs.cipherMAC(f, key: key), try KeybagMACs.cipherMAC(g, key: key))
        g.keySet = 1
        XCTAssertNotEqual(try KeybagMACs.cipherMAC(f, key: key), try KeybagMACs.cipherMAC(g, key: key))
        XCTAssertNoThrow(try f.validate())
        g = f
        g.kdfSalt = "short"
        XCTAssertThrowsError(try g.validate()) { XCTAssertTrue("\($0)".contains("kdfSalt"), "\($0)") }
    }
}
