import CSodium
import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// The recovery key: its written form, recovery after a lost passcode or device key, the
/// throttle on wrong keys, and rotation.
final class RecoveryKeyTests: TempDirTestCase {
    let id = "5555aaaa5555aaaa5555aaaa5555aaaa"

    func text(_ k: RecoveryKey) throws -> String { try k.text().withBytes { String(decoding: $0, as: UTF8.self) } }

    func testTheWrittenFormRoundTripsAndCatchesTypos() throws {
        let random = RecoveryKey.generate()
        XCTAssertTrue(try same(RecoveryKey.parse(random.text()).secret, random.secret))
        // A fixed key, so the typo checks below are deterministic (a 16-bit check lets one
        // random typo in 65,536 through; for this key none of the 55 below).
        let k = RecoveryKey(secret: SecureKey(count: 32) { for i in 0..<32 { $0[i] = UInt8(i * 7 + 3) } })
        let t = try text(k)
        XCTAssertEqual(t.count, RecoveryKey.textLength)
        XCTAssertTrue(t.hasPrefix("KBR1-"), t)
        XCTAssertEqual(t.split(separator: "-").count, 12, t)
        XCTAssertTrue(try same(RecoveryKey.parse(secret(t)).secret, k.secret))
        // Case, spaces and dashes do not matter.
        let loose = t.lowercased().replacingOccurrences(of: "-", with: " ")
        XCTAssertTrue(try same(RecoveryKey.parse(secret(loose)).secret, k.secret))
        // Every single changed character is caught by the check (not a wrong-key attempt).
        var caught = 0, tried = 0
        for i in Array(t.indices).dropFirst(5) where t[i] != "-" {
            let other: Character = t[i] == "A" ? "B" : "A"
            var typo = t
            typo.replaceSubrange(i...i, with: String(other))
            tried += 1
            XCTAssertThrowsError(try RecoveryKey.parse(secret(typo))) { e in
                if case KeybagError.invalid(let m) = e, m.contains("mistyped") || m.contains("not a recovery key") {
                    caught += 1
                }
            }
        }
        XCTAssertEqual(tried, 55)
        XCTAssertEqual(caught, 55)
        // The last character carries three padding bits: a typo there is caught by them or the check.
        for last in ["A", "B", "H", "7"] where String(t.last!) != last {
            XCTAssertThrowsError(try RecoveryKey.parse(secret(String(t.dropLast()) + last)), "last character \(last)")
        }
        XCTAssertThrowsError(try RecoveryKey.parse(secret(String(t.dropLast()))))
        XCTAssertThrowsError(try RecoveryKey.parse(secret("KBR2" + t.dropFirst(4))))
        XCTAssertThrowsError(try RecoveryKey.parse(secret(t.replacingOccurrences(of: "A", with: "1"))))
    }

    func testRecoverAfterForgettingThePasscode() throws {
        let dk = SecureKey(random: 32)
        let rk = RecoveryKey.generate()
        var kb = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("forgotten"), deviceKey: dk, strength: .interactive,
            recovery: rk)
        let before = try kb.unlock(passcode: secret("forgotten"), deviceKey: dk)
        for _ in 1...3 { try PasscodeAttempts.recordFailure(&kb, now: 1_000) }
        var loaded = try Keybag.load(storePath: dir)
        XCTAssertTrue(loaded.hasRecoveryKey)
        _ = try loaded.authenticate(deviceKey: dk)
        try RecoveryEscrow.recover(
            &loaded, with: RecoveryKey.parse(k(rk)), newPasscode: secret("new passcode"), deviceKey: dk)
        var after = try Keybag.load(storePath: dir)
        XCTAssertEqual(try after.authenticate(deviceKey: dk), .authentic, "the counter MAC was rewritten")
        XCTAssertEqual(after.file.failedAttempts, 0)
        XCTAssertThrowsError(try after.unlock(passcode: secret("forgotten"), deviceKey: dk)) {
            XCTAssertEqual($0 as? KeybagError, .badPasscode)
        }
        let keys = try after.unlock(passcode: secret("new passcode"), deviceKey: dk)
        XCTAssertTrue(try same(keys.classA, before.classA), "the class keys are the same: no file changes")
        XCTAssertTrue(try same(keys.classBSecret, before.classBSecret))
        XCTAssertTrue(try same(keys.classC, before.classC))
    }

    /// The recovery key's written form, parsed back (what a user types).
    func k(_ rk: RecoveryKey) throws -> SecureKey { try rk.text() }

    func testRecoverAfterLosingTheDeviceKey() throws {
        let lost = SecureKey(random: 32)
        let rk = RecoveryKey.generate()
        _ = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: lost, strength: .interactive, recovery: rk)
        let kbBefore = try Keybag.load(storePath: dir)
        let d = try kbBefore.unwrapDeviceKeySlot("D", deviceKey: lost),
            vol = try kbBefore.unwrapDeviceKeySlot("volume", deviceKey: lost)
        let a = try kbBefore.unlock(passcode: secret("p"), deviceKey: lost).classA
        let fresh = SecureKey(random: 32)
        var kb = try Keybag.load(storePath: dir)
        try RecoveryEscrow.recover(&kb, with: rk, newPasscode: secret("q"), deviceKey: fresh)
        var after = try Keybag.load(storePath: dir)
        XCTAssertEqual(try after.authenticate(deviceKey: fresh), .authentic)
        XCTAssertTrue(
            try same(after.unwrapDeviceKeySlot("D", deviceKey: fresh), d), "class D files open with the new device key")
        XCTAssertTrue(
            try same(after.unwrapDeviceKeySlot("volume", deviceKey: fresh), vol),
            "names decrypt with the new device key")
        XCTAssertTrue(try same(after.unlock(passcode: secret("q"), deviceKey: fresh).classA, a))
        XCTAssertThrowsError(try after.unwrapDeviceKeySlot("D", deviceKey: lost)) {
            XCTAssertEqual($0 as? KeybagError, .badDeviceKey)
        }
        XCTAssertThrowsError(try after.unlock(passcode: secret("q"), deviceKey: lost))
    }

    func testWrongRecoveryKeysAreThrottledAndCounted() throws {
        let dk = SecureKey(random: 32)
        let rk = RecoveryKey.generate()
        _ = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive, recovery: rk)
        let now = 2_000_000.0
        for i in 1...5 {
            var kb = try Keybag.load(storePath: dir)  // device key lost: no counter key
            XCTAssertThrowsError(
                try RecoveryEscrow.recover(
                    &kb,
                    with: RecoveryKey.generate(), newPasscode: secret("x"), deviceKey: SecureKey(random: 32), now: now)
            ) {
                XCTAssertEqual($0 as? KeybagError, .badRecoveryKey)
            }
            XCTAssertEqual(try Keybag.load(storePath: dir).file.recoveryFailedAttempts, i, "persisted")
        }
        var kb = try Keybag.load(storePath: dir)
        XCTAssertEqual(PasscodeAttempts.recoveryRetryAfter(kb, now: now), 60)
        XCTAssertThrowsError(
            try RecoveryEscrow.recover(&kb, with: rk, newPasscode: secret("x"), deviceKey: dk, now: now + 1)
        ) {
            XCTAssertEqual($0 as? KeybagError, .throttled(retryAfter: 59))
        }
        // The wrong attempts changed nothing else: the passcode and device key still open the store.
        var same = try Keybag.load(storePath: dir)
        XCTAssertEqual(try same.authenticate(deviceKey: dk), .authentic, "the passcode counter's MAC is untouched")
        XCTAssertNoThrow(try same.unlock(passcode: secret("p"), deviceKey: dk))
        // After the delay the right key works and clears the counter.
        try RecoveryEscrow.recover(&kb, with: rk, newPasscode: secret("x"), deviceKey: dk, now: now + 61)
        XCTAssertNil(try Keybag.load(storePath: dir).file.recoveryFailedAttempts)
    }

    func testRotationRetiresTheOldKeyAndGivesOneToStoresWithout() throws {
        let dk = SecureKey(random: 32)
        var kb = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive)
        XCTAssertFalse(kb.hasRecoveryKey)
        XCTAssertThrowsError(
            try RecoveryEscrow.recover(&kb, with: RecoveryKey.generate(), newPasscode: secret("x"), deviceKey: dk))
        XCTAssertThrowsError(try RecoveryEscrow.rotate(&kb, passcode: secret("wrong"), deviceKey: dk)) {
            XCTAssertEqual($0 as? KeybagError, .badPasscode)
        }
        XCTAssertEqual(try Keybag.load(storePath: dir).file.failedAttempts, 1, "a wrong passcode counts")
        let first = try RecoveryEscrow.rotate(&kb, passcode: secret("p"), deviceKey: dk)
        let second = try RecoveryEscrow.rotate(&kb, passcode: secret("p"), deviceKey: dk)
        var reloaded = try Keybag.load(storePath: dir)
        XCTAssertThrowsError(
            try RecoveryEscrow.recover(&reloaded, with: first, newPasscode: secret("x"), deviceKey: dk)
        ) {
            XCTAssertEqual($0 as? KeybagError, .badRecoveryKey)
        }
        reloaded = try Keybag.load(storePath: dir)
        try RecoveryEscrow.recover(&reloaded, with: second, newPasscode: secret("x"), deviceKey: dk)
        XCTAssertNoThrow(try Keybag.load(storePath: dir).unlock(passcode: secret("x"), deviceKey: dk))
    }

    func testPartialOrDamagedEscrowIsAClearError() throws {
        let dk = SecureKey(random: 32)
        _ = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive,
            recovery: RecoveryKey.generate())
        let path = dir + "/keybag"
        var o = try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: path))) as! [String: Any]
        var w = o["wrapped"] as! [String: Any]
        w["rB"] = nil
        o["wrapped"] = w
        try JSONSerialization.data(withJSONObject: o).write(to: URL(fileURLWithPath: path))
        XCTAssertThrowsError(try Keybag.load(storePath: dir)) { e in
            guard case KeybagError.corrupt(let m) = e else { return XCTFail("\(e)") }
            XCTAssertTrue(m.contains("recovery"), m)
        }
    }

    /// Escrow slots planted for an attacker's key (holding other keys) are refused as damage
    /// and change nothing; a keybag edited to a weak KDF is not kept weak by recover.
    func testPlantedEscrowIsRefusedAndTheKDFIsNeverWeakened() throws {
        let dk = SecureKey(random: 32)
        let real = RecoveryKey.generate()
        _ = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive, recovery: real)
        let before = try Data(contentsOf: URL(fileURLWithPath: dir + "/keybag"))
        let planted = RecoveryKey.generate()
        var kb = try Keybag.load(storePath: dir)
        var f = kb.file
        try RecoveryEscrow.write(
            &f, keys: ["A", "B", "C", "D", "volume"].map { ($0, SecureKey(random: 32)) }, recovery: planted)
        kb.file = f
        try kb.saveWithoutCounter()
        var forged = try Keybag.load(storePath: dir)
        XCTAssertThrowsError(
            try RecoveryEscrow.recover(&forged, with: planted, newPasscode: secret("x"), deviceKey: dk)
        ) { e in
            guard case KeybagError.corrupt(let m) = e else { return XCTFail("\(e)") }
            XCTAssertTrue(m.contains("do not match"), m)
        }
        XCTAssertNil(try Keybag.load(storePath: dir).file.recoveryFailedAttempts, "damage is not counted as a guess")
        // Back to the genuine keybag, edited down to libsodium's minimum KDF.
        try before.write(to: URL(fileURLWithPath: dir + "/keybag"))
        var o = try JSONSerialization.jsonObject(with: before) as! [String: Any]
        o["kdfOpsLimit"] = Int(crypto_pwhash_opslimit_min()); o["kdfMemLimit"] = Int(crypto_pwhash_memlimit_min())
        try JSONSerialization.data(withJSONObject: o).write(to: URL(fileURLWithPath: dir + "/keybag"))
        var weak = try Keybag.load(storePath: dir)
        try RecoveryEscrow.recover(&weak, with: real, newPasscode: secret("x"), deviceKey: dk)
        let after = try Keybag.load(storePath: dir).file
        XCTAssertGreaterThanOrEqual(after.kdfOpsLimit, KDFStrength.interactive.opsLimit)
        XCTAssertGreaterThanOrEqual(after.kdfMemLimit, KDFStrength.interactive.memLimit)
    }
}
