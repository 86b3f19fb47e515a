import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// Keybag, keyring, throttle, lock state machine and path helpers.
final class KeybagTests: TempDirTestCase {
    func testUnlockWrongPasscodeWrongDeviceKeyAndPasswd() throws {
        let dk = SecureKey(random: 32)
        var kb = try Keybag.create(
            storePath: dir, storeID: "00112233445566778899aabbccddeeff", passcode: secret("right"), deviceKey: dk,
            strength: .interactive)
        let keys = try kb.unlock(passcode: secret("right"), deviceKey: dk)
        XCTAssertEqual(keys.classBPublic, try ClassBAgreement.publicKey(of: keys.classBSecret))
        XCTAssertThrowsError(try kb.unlock(passcode: secret("wrong"), deviceKey: dk)) {
            XCTAssertEqual($0 as? KeybagError, .badPasscode)
        }
        // The passcode alone does not derive the keys: a different device key fails too.
        XCTAssertThrowsError(try kb.unlock(passcode: secret("right"), deviceKey: SecureKey(random: 32)))
        XCTAssertThrowsError(try kb.unwrapDeviceKeySlot("D", deviceKey: SecureKey(random: 32))) {
            XCTAssertEqual($0 as? KeybagError, .badDeviceKey)
        }
        XCTAssertNoThrow(try kb.unwrapDeviceKeySlot("D", deviceKey: dk))
        // passwd keeps the class keys, changes what unlocks them, and persists.
        try PasscodeKey.change(&kb, old: secret("right"), new: secret("new one"), deviceKey: dk)
        let reloaded = try Keybag.load(storePath: dir)
        XCTAssertThrowsError(try reloaded.unlock(passcode: secret("right"), deviceKey: dk))
        let again = try reloaded.unlock(passcode: secret("new one"), deviceKey: dk)
        XCTAssertTrue(try keys.classA.withBytes { a in try again.classA.withBytes { b in Array(a) == Array(b) } })
        XCTAssertThrowsError(try PasscodeKey.change(&kb, old: secret("nope"), new: secret("x"), deviceKey: dk))
    }

    func testFailuresPersistAndEscalate() throws {
        let dk = SecureKey(random: 32)
        var kb = try Keybag.create(
            storePath: dir, storeID: "ffeeddccbbaa99887766554433221100", passcode: secret("p"), deviceKey: dk,
            strength: .interactive)
        let now = 1_000_000.0
        for _ in 1...4 { try PasscodeAttempts.recordFailure(&kb, now: now) }
        XCTAssertEqual(PasscodeAttempts.retryAfter(kb, now: now), 0)
        try PasscodeAttempts.recordFailure(&kb, now: now)
        XCTAssertEqual(PasscodeAttempts.retryAfter(kb, now: now), 60)
        XCTAssertEqual(PasscodeAttempts.retryAfter(try Keybag.load(storePath: dir), now: now), 60, "persisted")
        XCTAssertEqual(
            [5, 6, 7, 8, 9, 12].map { UnlockThrottle.delay(afterFailures: $0) }, [60, 300, 900, 900, 3600, 3600])
        try PasscodeAttempts.recordSuccess(&kb)
        XCTAssertEqual(try Keybag.load(storePath: dir).file.failedAttempts, 0)
    }

    /// A `keybag.tmp` planted as a symlink (or left as a file) is not written through: the
    /// daemon runs as root, and the store's temporary must never reach another file.
    func testSaveDoesNotWriteThroughAPlantedTemporary() throws {
        let dk = SecureKey(random: 32)
        var kb = try Keybag.create(
            storePath: dir, storeID: "0123456789abcdef0123456789abcdef", passcode: secret("p"), deviceKey: dk,
            strength: .interactive)
        let victim = dir + "/victim"
        try Data("precious\n".utf8).write(to: URL(fileURLWithPath: victim))
        XCTAssertEqual(symlink(victim, dir + "/keybag.tmp"), 0)
        try PasscodeAttempts.recordFailure(&kb, now: 1_000_000)
        XCTAssertEqual(
            try String(contentsOfFile: victim, encoding: .utf8), "precious\n", "the symlink's target is untouched")
        XCTAssertEqual(try Keybag.load(storePath: dir).file.failedAttempts, 1, "the keybag itself was saved")
        var st = stat()
        XCTAssertEqual(lstat(dir + "/keybag", &st), 0)
        XCTAssertEqual(st.st_mode & S_IFMT, S_IFREG, "the keybag is a regular file, not the planted link")
        XCTAssertEqual(st.st_mode & 0o777, 0o600)
    }

    func testCorruptKeybagIsAnErrorNotACrash() throws {
        try Data("{\"format\": 1".utf8).write(to: URL(fileURLWithPath: dir + "/keybag"))
        XCTAssertThrowsError(try Keybag.load(storePath: dir))
        try Data("[]".utf8).write(to: URL(fileURLWithPath: dir + "/keybag"))
        XCTAssertThrowsError(try Keybag.load(storePath: dir))
        XCTAssertThrowsError(try Keybag.load(storePath: dir + "/absent"))
    }

    func testKeyringEvictionOnLock() throws {
        let d = SecureKey(random: 32)
        let ring = ClassKeyring(classD: d)
        XCTAssertTrue(ring.access.canOpen(.none))
        for c in [ProtectionClass.complete, .completeUnlessOpen, .completeUntilFirstUserAuthentication] {
            XCTAssertFalse(ring.access.canOpen(c)); XCTAssertFalse(ring.access.canCreate(c))
        }
        let bs = SecureKey(random: 32)
        let keys = UnlockedClassKeys(
            classA: SecureKey(random: 32), classBSecret: bs, classBPublic: try ClassBAgreement.publicKey(of: bs),
            classC: SecureKey(random: 32))
        ring.install(keys)
        ProtectionClass.allCases.forEach { XCTAssertTrue(ring.access.canOpen($0)) }
        ring.evictForLock()
        XCTAssertTrue(keys.classA.isWiped, "class A key zeroed")
        XCTAssertTrue(keys.classBSecret.isWiped, "class B private key zeroed")
        XCTAssertFalse(keys.classC.isWiped)
        XCTAssertFalse(ring.access.canOpen(.complete)); XCTAssertFalse(ring.access.canCreate(.complete))
        XCTAssertFalse(ring.access.canOpen(.completeUnlessOpen));
        XCTAssertTrue(ring.access.canCreate(.completeUnlessOpen))
        XCTAssertTrue(ring.access.canOpen(.completeUntilFirstUserAuthentication))
        ring.wipeAll()
        XCTAssertTrue(d.isWiped)
    }

    func testLockStateMachine() {
        var m = LockStateMachine()
        XCTAssertEqual(m.requestLock(grace: 0), .nothing, "nothing to lock before the first unlock")
        XCTAssertEqual(m.unlocked(), [.didBecomeAvailable])
        XCTAssertEqual(m.unlocked(), [], "already unlocked")
        guard case .startGrace(let t1) = m.requestLock(grace: 5) else { return XCTFail() }
        XCTAssertEqual(m.state, .locking)
        XCTAssertEqual(m.unlocked(), [.didBecomeAvailable])
        XCTAssertFalse(m.shouldEvict(ticket: t1), "cancelled")
        XCTAssertEqual(m.evicted(ticket: t1), [])
        XCTAssertEqual(m.state, .unlocked)
        guard case .startGrace(let t2) = m.requestLock(grace: 5) else { return XCTFail() }
        XCTAssertEqual(
            m.requestLock(grace: 0), .evictNow(ticket: t2, sendWill: false), "grace 0 during locking finishes now")
        XCTAssertEqual(m.evicted(ticket: t2), [.didBecomeUnavailable])
        XCTAssertEqual(m.state, .locked)
        XCTAssertEqual(m.requestLock(grace: 0), .nothing)
        XCTAssertEqual(m.unlocked(), [.didBecomeAvailable])
        guard case .evictNow(let t3, true) = m.requestLock(grace: 0) else { return XCTFail() }
        XCTAssertEqual(m.evicted(ticket: t3), [.didBecomeUnavailable])
    }

    func testClassNamesAndAliases() {
        XCTAssertEqual(ProtectionClass(name: "complete"), .complete)
        XCTAssertEqual(ProtectionClass(name: "NSFileProtectionCompleteUnlessOpen"), .completeUnlessOpen)
        XCTAssertEqual(ProtectionClass(name: "none\0"), ProtectionClass.none)
        XCTAssertNil(ProtectionClass(name: "Complete"))
        XCTAssertNil(ProtectionClass(name: ""))
    }

    func testSystemdEscapeAndMountinfo() {
        XCTAssertEqual(ControlPaths.systemdEscapePath("/"), "-")
        XCTAssertEqual(ControlPaths.systemdEscapePath("/mnt/secure"), "mnt-secure")
        XCTAssertEqual(ControlPaths.systemdEscapePath("/mnt//my data/"), "mnt-my\\x20data")
        XCTAssertEqual(ControlPaths.systemdEscapePath("/a-b/.c"), "a\\x2db-.c")
        XCTAssertEqual(ControlPaths.systemdEscapePath("/.hidden"), "\\x2ehidden")
        XCTAssertEqual(ControlPaths.defaultSocket(forMountpoint: "/srv/vault"), "/run/keybagfs/srv-vault.sock")
        let info = """
            36 35 98:0 / /mnt1 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
            40 35 0:50 / /srv/my\\040vault rw,nosuid - fuse.keybagfs /store rw,user_id=0
            """
        XCTAssertEqual(ControlPaths.keybagfsMounts(mountinfo: info), ["/srv/my vault"])
    }
}

/// The name construction on its own.
final class NameCipherTests: XCTestCase {
    func testDeterministicPerDirectoryAuthenticatedAndUnlinkable() throws {
        let c = try NameCipher(volumeKey: SecureKey(random: 32))
        let iv1 = Sodium.randomArray(16), iv2 = Sodium.randomArray(16)
        let name = Array("report.pdf".utf8)
        let a = try c.encrypt(name, dirIV: iv1)
        XCTAssertEqual(try c.encrypt(name, dirIV: iv1), a, "deterministic in one directory")
        XCTAssertNotEqual(try c.encrypt(name, dirIV: iv2), a, "different across directories")
        XCTAssertNotEqual(try c.encrypt(Array("report.pdg".utf8), dirIV: iv1).prefix(10), a.prefix(10))
        XCTAssertEqual(try c.decrypt(a, dirIV: iv1), name)
        XCTAssertThrowsError(try c.decrypt(a, dirIV: iv2), "wrong directory")
        // A new store's root IV: the same on every device (one volume key), another store's differs.
        let root = try c.rootIV()
        XCTAssertEqual(root.count, 16)
        XCTAssertEqual(try c.rootIV(), root)
        XCTAssertNotEqual(try NameCipher(volumeKey: SecureKey(random: 32)).rootIV(), root)
        var chars = Array(a)
        for i in [0, 5, chars.count - 1] {
            let saved = chars[i]
            chars[i] = saved == "A" ? "B" : "A"
            XCTAssertThrowsError(try c.decrypt(String(chars), dirIV: iv1), "altered at \(i)")
            chars[i] = saved
        }
        XCTAssertThrowsError(try c.decrypt("not base64!", dirIV: iv1))
        XCTAssertFalse(a.contains("/") || a.contains("."), "base64url: no slash, no dot")
        // Long names hash into a short entry with a side file.
        let long = try c.encrypt([UInt8](repeating: 0x41, count: 255), dirIV: iv1)
        XCTAssertGreaterThan(long.utf8.count, 255)
        let (entry, side) = NameCipher.backingEntry(for: long)
        XCTAssertLessThanOrEqual(entry.utf8.count, 255)
        XCTAssertEqual(side, entry + ".name")
        XCTAssertTrue(NameCipher.isLongName(entry))
        XCTAssertTrue(NameCipher.isSideFile(side!))
        XCTAssertEqual(NameCipher.backingEntry(for: a).sideFile, nil)
        // Targets and directory metadata are sealed with random nonces.
        let t = try c.encryptTarget(Array("../x".utf8))
        XCTAssertNotEqual(try c.encryptTarget(Array("../x".utf8)), t)
        XCTAssertEqual(try c.decryptTarget(t), Array("../x".utf8))
        let meta = DirectoryMeta(iv: iv1, defaultClass: .complete)
        var enc = try meta.encode(c)
        XCTAssertEqual(try DirectoryMeta.decode(enc, c), meta)
        enc[enc.count - 1] ^= 1
        XCTAssertThrowsError(try DirectoryMeta.decode(enc, c))
    }
}

/// The keybag as an attacker with write access to the store edits it.
final class KeybagTrustTests: TempDirTestCase {
    let id = "0123456789abcdef0123456789abcdef"

    /// Rewrites the keybag JSON through `edit`.
    func editJSON(_ edit: (inout [String: Any]) -> Void) throws {
        let url = URL(fileURLWithPath: dir + "/keybag")
        var o = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        edit(&o)
        try JSONSerialization.data(withJSONObject: o).write(to: url)
    }

    func testEditedCounterDoesNotLiftALockout() throws {
        let dk = SecureKey(random: 32)
        var kb = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive)
        let now = Date().timeIntervalSince1970
        for _ in 1...5 { try PasscodeAttempts.recordFailure(&kb, now: now) }
        var reloaded = try Keybag.load(storePath: dir)
        XCTAssertEqual(try reloaded.authenticate(deviceKey: dk, now: now), .authentic)
        XCTAssertEqual(PasscodeAttempts.retryAfter(reloaded, now: now), 60)
        for edit in [
            { (o: inout [String: Any]) in
                o["failedAttempts"] = 0; o["lockoutUntil"] = 0
            },
            { (o: inout [String: Any]) in
                o["failedAttempts"] = 0; o["lockoutUntil"] = 0; o["counterMAC"] = nil
            },
        ] {
            try kb.save()
            try editJSON(edit)
            var edited = try Keybag.load(storePath: dir)
            XCTAssertEqual(PasscodeAttempts.retryAfter(edited, now: now), 0, "the edit itself reads as no lockout")
            XCTAssertEqual(try edited.authenticate(deviceKey: dk, now: now), .tampered)
            XCTAssertGreaterThanOrEqual(
                PasscodeAttempts.retryAfter(edited, now: now), 3600, "an edited counter means the longest lockout")
            XCTAssertGreaterThanOrEqual(
                PasscodeAttempts.retryAfter(try Keybag.load(storePath: dir), now: now), 3600, "and it is saved")
        }
        // Claiming the old format to drop the MAC: the device key no longer opens the store's
        // device slots under that format's tag, and the error says the format was edited.
        try kb.save()
        try editJSON { o in
            o["format"] = 1; o["counterMAC"] = nil; o["failedAttempts"] = 0; o["lockoutUntil"] = 0
        }
        XCTAssertThrowsError(try Keybag.load(storePath: dir).unwrapDeviceKeySlot("D", deviceKey: dk)) { e in
            guard case KeybagError.corrupt(let m) = e else { return XCTFail("\(e)") }
            XCTAssertTrue(m.contains("format was edited"), m)
        }
    }

    func testFormatOneKeybagIsUpgradedAtFirstAuthentication() throws {
        let dk = SecureKey(random: 32)
        _ = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive, format: 1)
        var kb = try Keybag.load(storePath: dir)
        XCTAssertEqual(kb.file.format, 1)
        let d1 = try kb.unwrapDeviceKeySlot("D", deviceKey: dk)
        XCTAssertEqual(try kb.authenticate(deviceKey: dk), .upgraded)
        var again = try Keybag.load(storePath: dir)
        XCTAssertEqual(again.file.format, Keybag.currentFormat)
        XCTAssertNotNil(again.file.counterMAC)
        XCTAssertNotNil(again.file.settingsMAC)
        XCTAssertEqual(try again.authenticate(deviceKey: dk), .authentic)
        XCTAssertEqual(
            try again.unwrapDeviceKeySlot("D", deviceKey: dk).withBytes { Array($0) }, try d1.withBytes { Array($0) })
        XCTAssertNoThrow(try again.unlock(passcode: secret("p"), deviceKey: dk))
    }

    /// Every setting of a keybag is authenticated (issue 34): an offline edit of any field but
    /// the wrapped slots, the cipher and the counters (which have MACs and rules of their own)
    /// and the recovery counters is refused with an error that says so; a keybag of format 2
    /// or 3 (written before the settings MAC) is upgraded in place and then protected too.
    func testEveryKeybagSettingIsAuthenticated() throws {
        let dk = SecureKey(random: 32)
        for format in [2, Keybag.currentFormat] {
            try? FileManager.default.removeItem(atPath: dir + "/keybag")
            _ = try Keybag.create(
                storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive,
                format: format)
            var kb = try Keybag.load(storePath: dir)
            XCTAssertEqual(try kb.authenticate(deviceKey: dk), format == 2 ? .upgraded : .authentic)
            XCTAssertEqual(try Keybag.load(storePath: dir).file.format, Keybag.settingsFormat, "from format \(format)")
            let pristine = try Data(contentsOf: URL(fileURLWithPath: dir + "/keybag"))
            let otherSalt = Data(repeating: 7, count: 16).base64EncodedString()
            let edits: [(String, (inout [String: Any]) -> Void)] = [
                ("format 4 → 3", { $0["format"] = 3 }), ("format 4 → 2", { $0["format"] = 2 }),
                ("kdfOpsLimit", { $0["kdfOpsLimit"] = ($0["kdfOpsLimit"] as! Int) + 1 }),
                ("kdfMemLimit", { $0["kdfMemLimit"] = ($0["kdfMemLimit"] as! Int) * 2 }),
                ("kdfSalt", { $0["kdfSalt"] = otherSalt }),
                ("classBPublic", { $0["classBPublic"] = Data(repeating: 9, count: 32).base64EncodedString() }),
                ("deviceName", { $0["deviceName"] = "not this laptop" }),
                ("settingsMAC removed", { $0["settingsMAC"] = nil }),
            ]
            for (name, edit) in edits {
                try pristine.write(to: URL(fileURLWithPath: dir + "/keybag"))
                try editJSON(edit)
                let edited = try Data(contentsOf: URL(fileURLWithPath: dir + "/keybag"))
                XCTAssertThrowsError(
                    try {
                        var e = try Keybag.load(storePath: dir)
                        try e.unwrapDeviceKeySlot("D", deviceKey: dk).wipe()
                        _ = try e.authenticate(deviceKey: dk)
                    }(), "\(name) (from format \(format))"
                ) { e in
                    guard case KeybagError.corrupt(let m) = e else { return XCTFail("\(name): \(e)") }
                    XCTAssertTrue(m.contains("edited offline") || m.contains("settingsMAC"), "\(name): \(m)")
                }
                XCTAssertEqual(
                    try Data(contentsOf: URL(fileURLWithPath: dir + "/keybag")), edited, "\(name): nothing was written")
            }
            // The recovery counters stay outside (recovery without the device key writes them).
            try pristine.write(to: URL(fileURLWithPath: dir + "/keybag"))
            try editJSON { $0["recoveryFailedAttempts"] = 2 }
            var fine = try Keybag.load(storePath: dir)
            XCTAssertEqual(try fine.authenticate(deviceKey: dk), .authentic)
            XCTAssertNoThrow(try fine.unlock(passcode: secret("p"), deviceKey: dk))
        }
    }

    func testHostileFieldsAreClearErrorsNotTraps() throws {
        let dk = SecureKey(random: 32)
        let kb = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive)
        let cases: [(String, Any)] = [
            ("kdfMemLimit", UInt64(1) << 62), ("kdfMemLimit", 1), ("kdfOpsLimit", 0), ("kdfOpsLimit", 1 << 40),
            ("storeID", "../../etc/passwd"), ("storeID", "0123456789ABCDEF0123456789ABCDEF"), ("failedAttempts", -1),
            ("failedAttempts", 1 << 40), ("lockoutUntil", -5), ("kdfSalt", "c2hvcnQ="), ("classBPublic", ""),
            ("format", 7),
            ("counterMAC", "bm90IGEgbWFj"),
        ]
        for (field, value) in cases {
            try kb.save()
            try editJSON { $0[field] = value }
            XCTAssertThrowsError(try Keybag.load(storePath: dir), "\(field) = \(value)") { e in
                guard case KeybagError.corrupt(let m) = e else { return XCTFail("\(e)") }
                XCTAssertTrue(m.contains(field), m)
            }
        }
        try kb.save()
        try editJSON { $0["lockoutUntil"] = 1e300 }
        XCTAssertLessThanOrEqual(
            PasscodeAttempts.retryAfter(try Keybag.load(storePath: dir), now: Date().timeIntervalSince1970), 3600,
            "a lockout is cut to the longest delay")
    }

    /// A clock set back (the lockout now lies further ahead than the longest delay) is not
    /// tampering: the counter's MAC still verifies, and the wait is cut to the longest delay.
    func testAClockSetBackIsNotTampering() throws {
        let dk = SecureKey(random: 32)
        var kb = try Keybag.create(
            storePath: dir, storeID: id, passcode: secret("p"), deviceKey: dk, strength: .interactive)
        let then = Date().timeIntervalSince1970
        for _ in 1...5 { try PasscodeAttempts.recordFailure(&kb, now: then) }  // lockout until then + 60
        let dayEarlier = then - 86_400
        var reloaded = try Keybag.load(storePath: dir, now: dayEarlier)
        XCTAssertEqual(
            try reloaded.authenticate(deviceKey: dk, now: dayEarlier), .authentic,
            "the stored counter is the authentic one")
        XCTAssertEqual(reloaded.file.failedAttempts, 5, "not raised to the tampering penalty")
        XCTAssertEqual(
            PasscodeAttempts.retryAfter(reloaded, now: dayEarlier), 3600,
            "the wait is never longer than the longest delay")
    }

    func testPasscodeComparisonIsExact() {
        XCTAssertTrue(PasscodeInput.equal(secret("same"), secret("same")))
        XCTAssertFalse(PasscodeInput.equal(secret("same"), secret("samf")))
        XCTAssertFalse(PasscodeInput.equal(secret("same"), secret("sam")))
    }
}
