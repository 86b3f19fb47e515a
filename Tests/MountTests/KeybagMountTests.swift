import Foundation
import Glibc
import XCTest

/// The keybag and the store against someone with write access to them: an edited
/// failed-attempt counter, hostile KDF limits, a second daemon on the same store.
final class KeybagMountTests: XCTestCase {
    /// Rewrites the store's keybag JSON through `edit`.
    func editKeybag(_ m: MountFixture, _ edit: (inout [String: Any]) -> Void) throws {
        let url = URL(fileURLWithPath: m.store + "/keybag")
        var o = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        edit(&o)
        try JSONSerialization.data(withJSONObject: o).write(to: url)
    }

    func testEditingTheCounterOfflineDoesNotLiftALockout() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        for i in 1...5 { XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: "wrong \(i)\n").code, 1) }
        XCTAssertTrue(m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n").stderr.contains("throttled"))
        m.unmount()
        try editKeybag(m) { o in o["failedAttempts"] = 0; o["lockoutUntil"] = 0 }
        try m.mount()
        let r = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 1, "the edit lifted the lockout")
        XCTAssertTrue(r.stderr.contains("throttled"), r.stderr)
        XCTAssertEqual(m.state, "beforeFirstUnlock")
        XCTAssertGreaterThanOrEqual(m.status()["retryAfter"] as? Int ?? 0, 60)
    }

    func testASecondDaemonCannotMountTheSameStore() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("f"), bytes("first")), 0)
        let mnt2 = m.root + "/mnt2"
        XCTAssertEqual(mkdir(mnt2, 0o755), 0)
        addTeardownBlock { _ = MountFixture.run("/bin/fusermount3", ["-u", mnt2]) }
        let r = MountFixture.run(MountFixture.binDir + "/keybagfs", ["mount", m.store, mnt2, "--socket", m.root + "/ctl2.sock", "--device-key", m.deviceKey])
        XCTAssertNotEqual(r.code, 0, "a second daemon mounted the store")
        XCTAssertTrue(r.stderr.contains("already mounted"), r.stderr)
        XCTAssertEqual(try readFile(m.path("f")).get(), bytes("first"), "the first mount is undisturbed")
        XCTAssertEqual(m.state, "unlocked")
    }

    func testHostileKDFLimitsAreAClearErrorNotACrash() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        for (field, value) in [("kdfMemLimit", UInt64(1) << 62), ("kdfOpsLimit", UInt64(1) << 40)] as [(String, UInt64)] {
            let original = try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))
            try editKeybag(m) { $0[field] = value }
            let r = MountFixture.run(MountFixture.binDir + "/keybagfs", ["mount", m.store, m.mnt, "--socket", m.socket, "--device-key", m.deviceKey])
            XCTAssertEqual(r.code, 1, "\(field): \(r.stderr)")
            XCTAssertTrue(r.stderr.contains(field), r.stderr)
            XCTAssertFalse(m.isMounted)
            try original.write(to: URL(fileURLWithPath: m.store + "/keybag"))
        }
        try m.mount()
        m.unlock()
        XCTAssertEqual(m.state, "unlocked")
    }
}
