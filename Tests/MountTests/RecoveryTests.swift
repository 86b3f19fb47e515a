import CFuse
import Foundation
import Glibc
import XCTest

/// `keybagfs recover` and `keybagfs recovery-key rotate` through the real binaries, on a
/// store whose files are then read through a real mount.
final class RecoveryTests: XCTestCase {
    func keybagfs(_ args: [String], stdin: String? = nil) -> ToolResult {
        MountFixture.run(MountFixture.binDir + "/keybagfs", args, stdin: stdin)
    }

    /// Writes one file of each class, unmounts; returns what was written.
    func fill(_ m: MountFixture) throws -> [String: String] {
        m.unlock()
        var files: [String: String] = [:]
        for cls in ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"] {
            let d = m.path("d-" + cls)
            XCTAssertEqual(mkdir(d, 0o755), 0)
            XCTAssertEqual(setxattr(d, "user.protection", cls, cls.utf8.count, 0), 0)
            let text = "contents of \(cls) " + String(repeating: "x", count: 5000)
            try text.write(toFile: d + "/f", atomically: false, encoding: .utf8)
            files["d-" + cls + "/f"] = text
        }
        m.unmount()
        return files
    }

    /// Mounts, unlocks with `passcode`, and checks every file.
    func verify(_ m: MountFixture, _ files: [String: String], passcode: String) throws {
        try m.mount()
        let r = m.ctl(["unlock", "--passcode-stdin"], stdin: passcode + "\n")
        XCTAssertEqual(r.code, 0, r.stderr)
        for (rel, text) in files {
            XCTAssertEqual(try String(contentsOfFile: m.path(rel), encoding: .utf8), text, rel)
        }
    }

    func testRecoverAfterLosingTheDeviceKeyAndForgettingThePasscode() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        // The fixture's store has a recovery key printed by init; make one we can read.
        let rkFile = m.root + "/recovery.txt"
        let rot = keybagfs(["recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin", "--recovery-key-file", rkFile], stdin: m.passcode + "\n")
        XCTAssertEqual(rot.code, 0, rot.stderr)
        let rkText = try String(contentsOfFile: rkFile, encoding: .utf8)
        XCTAssertTrue(rkText.hasPrefix("KBR1-"), rkText)
        XCTAssertFalse(rot.stdout.contains(rkText.trimmingCharacters(in: .whitespacesAndNewlines)), "written to the file, not printed")
        var st = stat()
        XCTAssertEqual(stat(rkFile, &st), 0)
        XCTAssertEqual(st.st_mode & 0o777, 0o600)
        try m.mount()
        let files = try fill(m)

        // Refused while mounted.
        try m.mount()
        let busy = keybagfs(["recover", m.store, "--stdin", "--new-device-key", "--device-key", m.deviceKey], stdin: rkText + "x\n")
        XCTAssertEqual(busy.code, 1)
        XCTAssertTrue(busy.stderr.contains("mounted"), busy.stderr)
        m.unmount()

        // The device key is lost, and the passcode forgotten.
        XCTAssertEqual(unlink(m.deviceKey), 0)
        let noKey = keybagfs(["recover", m.store, "--stdin", "--device-key", m.deviceKey], stdin: rkText + "s3cret after recovery\n")
        XCTAssertEqual(noKey.code, 1)
        XCTAssertTrue(noKey.stderr.contains("--new-device-key"), noKey.stderr)
        let rec = keybagfs(["recover", m.store, "--stdin", "--new-device-key", "--device-key", m.deviceKey], stdin: rkText + "s3cret after recovery\n")
        XCTAssertEqual(rec.code, 0, rec.stderr)
        XCTAssertFalse(rec.stdout.contains("s3cret after recovery") || rec.stderr.contains("s3cret after recovery"), "the passcode is never echoed")
        XCTAssertEqual(stat(m.deviceKey, &st), 0, "a new device key was written")
        XCTAssertEqual(st.st_size, 32)
        try verify(m, files, passcode: "s3cret after recovery")
        let old = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertNotEqual(old.code, 0, "the old passcode no longer unlocks")
        m.unmount()
        // fsck agrees the store is whole.
        let fsck = keybagfs(["fsck", m.store, "--device-key", m.deviceKey, "--passcode-stdin"], stdin: "s3cret after recovery\n")
        XCTAssertEqual(fsck.code, 0, fsck.stdout + fsck.stderr)
    }

    func testWrongKeysAreRefusedAndThrottledAndRotationRetiresTheOldKey() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let first = m.root + "/first.txt", second = m.root + "/second.txt"
        XCTAssertEqual(keybagfs(["recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin", "--recovery-key-file", first], stdin: m.passcode + "\n").code, 0)
        let firstText = try String(contentsOfFile: first, encoding: .utf8)
        // A typo is caught by the check and does not count.
        var typo = Array(firstText)
        typo[7] = typo[7] == "A" ? "B" : "A"
        let t = keybagfs(["recover", m.store, "--stdin", "--device-key", m.deviceKey], stdin: String(typo) + "x\n")
        XCTAssertEqual(t.code, 1)
        XCTAssertTrue(t.stderr.contains("mistyped"), t.stderr)
        // Rotation: the first key stops working.
        let r = keybagfs(["recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 0, r.stderr)
        XCTAssertTrue(r.stdout.contains("KBR1-"), "printed once when no file is given: \(r.stdout)")
        let printed = r.stdout.split(separator: "\n").map { $0.trimmingCharacters(in: .whitespaces) }.first { $0.hasPrefix("KBR1-") }!
        try (printed + "\n").write(toFile: second, atomically: false, encoding: .utf8)
        for i in 1...5 {
            let w = keybagfs(["recover", m.store, "--recovery-key-file", first, "--stdin", "--device-key", m.deviceKey], stdin: "x\n")
            XCTAssertEqual(w.code, 1)
            XCTAssertTrue(w.stderr.contains("wrong recovery key"), "attempt \(i): \(w.stderr)")
        }
        let throttled = keybagfs(["recover", m.store, "--recovery-key-file", second, "--stdin", "--device-key", m.deviceKey], stdin: "x\n")
        XCTAssertEqual(throttled.code, 1)
        XCTAssertTrue(throttled.stderr.contains("try again in"), "even the right key waits: \(throttled.stderr)")
        // The passcode and the device key still open the store; nothing else changed.
        try m.mount()
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n").code, 0)
    }
}
