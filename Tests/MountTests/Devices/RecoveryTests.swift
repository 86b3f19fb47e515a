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
        let rot = keybagfs(
            [
                "recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin",
                "--recovery-key-file", rkFile,
            ], stdin: m.passcode + "\n")
        XCTAssertEqual(rot.code, 0, rot.stderr)
        let rkText = try String(contentsOfFile: rkFile, encoding: .utf8)
        XCTAssertTrue(rkText.hasPrefix("KBR1-"), rkText)
        XCTAssertFalse(
            rot.stdout.contains(rkText.trimmingCharacters(in: .whitespacesAndNewlines)),
            "written to the file, not printed")
        var st = stat()
        XCTAssertEqual(stat(rkFile, &st), 0)
        XCTAssertEqual(st.st_mode & 0o777, 0o600)
        try m.mount()
        let files = try fill(m)

        // Refused while mounted.
        try m.mount()
        let busy = keybagfs(
            ["recover", m.store, "--stdin", "--new-device-key", "--device-key", m.deviceKey], stdin: rkText + "x\n")
        XCTAssertEqual(busy.code, 1)
        XCTAssertTrue(busy.stderr.contains("mounted"), busy.stderr)
        m.unmount()

        // A symlink at the key path is refused (the new key would replace the link, not its target).
        XCTAssertEqual(symlink(m.deviceKey, m.root + "/link.key"), 0)
        let viaLink = keybagfs(
            ["recover", m.store, "--stdin", "--new-device-key", "--device-key", m.root + "/link.key"],
            stdin: rkText + "x\n")
        XCTAssertEqual(viaLink.code, 1)
        XCTAssertTrue(viaLink.stderr.contains("symlink"), viaLink.stderr)
        // The device key is lost, and the passcode forgotten.
        XCTAssertEqual(unlink(m.deviceKey), 0)
        let noKey = keybagfs(
            ["recover", m.store, "--stdin", "--device-key", m.deviceKey], stdin: rkText + "s3cret after recovery\n")
        XCTAssertEqual(noKey.code, 1)
        XCTAssertTrue(noKey.stderr.contains("--new-device-key"), noKey.stderr)
        let rec = keybagfs(
            ["recover", m.store, "--stdin", "--new-device-key", "--device-key", m.deviceKey],
            stdin: rkText + "s3cret after recovery\n")
        XCTAssertEqual(rec.code, 0, rec.stderr)
        XCTAssertFalse(
            rec.stdout.contains("s3cret after recovery") || rec.stderr.contains("s3cret after recovery"),
            "the passcode is never echoed")
        XCTAssertEqual(stat(m.deviceKey, &st), 0, "a new device key was written")
        XCTAssertEqual(st.st_size, 32)
        try verify(m, files, passcode: "s3cret after recovery")
        let old = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertNotEqual(old.code, 0, "the old passcode no longer unlocks")
        m.unmount()
        // fsck agrees the store is whole.
        let fsck = keybagfs(
            ["fsck", m.store, "--device-key", m.deviceKey, "--passcode-stdin"], stdin: "s3cret after recovery\n")
        XCTAssertEqual(fsck.code, 0, fsck.stdout + fsck.stderr)
    }

    func testWrongKeysAreRefusedAndThrottledAndRotationRetiresTheOldKey() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let first = m.root + "/first.txt", second = m.root + "/second.txt"
        XCTAssertEqual(
            keybagfs(
                [
                    "recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin",
                    "--recovery-key-file", first,
                ], stdin: m.passcode + "\n"
            ).code, 0)
        let firstText = try String(contentsOfFile: first, encoding: .utf8)
        // A typo is caught by the check and does not count.
        var typo = Array(firstText)
        typo[7] = typo[7] == "A" ? "B" : "A"
        let t = keybagfs(["recover", m.store, "--stdin", "--device-key", m.deviceKey], stdin: String(typo) + "x\n")
        XCTAssertEqual(t.code, 1)
        XCTAssertTrue(t.stderr.contains("mistyped"), t.stderr)
        // Rotation: the first key stops working.
        let r = keybagfs(
            ["recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin"],
            stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 0, r.stderr)
        XCTAssertTrue(r.stdout.contains("KBR1-"), "printed once when no file is given: \(r.stdout)")
        let printed = r.stdout.split(separator: "\n").map { $0.trimmingCharacters(in: .whitespaces) }.first {
            $0.hasPrefix("KBR1-")
        }!
        try (printed + "\n").write(toFile: second, atomically: false, encoding: .utf8)
        for i in 1...5 {
            let w = keybagfs(
                ["recover", m.store, "--recovery-key-file", first, "--stdin", "--device-key", m.deviceKey], stdin: "x\n"
            )
            XCTAssertEqual(w.code, 1)
            XCTAssertTrue(w.stderr.contains("wrong recovery key"), "attempt \(i): \(w.stderr)")
        }
        let throttled = keybagfs(
            ["recover", m.store, "--recovery-key-file", second, "--stdin", "--device-key", m.deviceKey], stdin: "x\n")
        XCTAssertEqual(throttled.code, 1)
        XCTAssertTrue(throttled.stderr.contains("try again in"), "even the right key waits: \(throttled.stderr)")
        // The passcode and the device key still open the store; nothing else changed.
        try m.mount()
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n").code, 0)
    }

    /// The new key is handed out before the keybag changes: if it cannot be written, the old
    /// one still works (rotate) or no store is made (init). A wrong device key is refused
    /// before it can touch the counter or rebind the store.
    func testAKeyThatCannotBeHandedOutChangesNothingAndAWrongDeviceKeyIsRefused() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let first = m.root + "/first.txt", taken = m.root + "/taken.txt"
        XCTAssertEqual(
            keybagfs(
                [
                    "recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin",
                    "--recovery-key-file", first,
                ], stdin: m.passcode + "\n"
            ).code, 0)
        try Data("already here\n".utf8).write(to: URL(fileURLWithPath: taken))
        let r = keybagfs(
            [
                "recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin",
                "--recovery-key-file", taken,
            ], stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 1)
        XCTAssertFalse(r.stdout.contains("no longer works"), r.stdout)
        // stdout that cannot be written (/dev/full) is an error too, and changes nothing.
        let full = MountFixture.run(
            "/bin/sh",
            [
                "-c", "\"$0\" recovery-key rotate \"$1\" --device-key \"$2\" --passcode-stdin > /dev/full",
                MountFixture.binDir + "/keybagfs", m.store, m.deviceKey,
            ], stdin: m.passcode + "\n")
        XCTAssertNotEqual(full.code, 0, full.stderr)
        // A wrong device key: refused, and the counter is untouched.
        let wrongKey = m.root + "/wrong.key"
        try Data((0..<32).map { UInt8($0) }).write(to: URL(fileURLWithPath: wrongKey))
        let w = keybagfs(
            ["recovery-key", "rotate", m.store, "--device-key", wrongKey, "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(w.code, 1)
        XCTAssertTrue(w.stderr.contains("device key does not open this store"), w.stderr)
        let wr = keybagfs(
            ["recover", m.store, "--recovery-key-file", first, "--stdin", "--device-key", wrongKey],
            stdin: "other passcode\n")
        XCTAssertEqual(wr.code, 1)
        XCTAssertTrue(wr.stderr.contains("--new-device-key"), wr.stderr)
        // Still: the first key recovers, with the real device key, and the store mounts.
        let ok = keybagfs(
            ["recover", m.store, "--recovery-key-file", first, "--stdin", "--device-key", m.deviceKey],
            stdin: "other passcode\n")
        XCTAssertEqual(ok.code, 0, ok.stderr)
        try m.mount()
        XCTAssertEqual(
            m.ctl(["unlock", "--passcode-stdin"], stdin: "other passcode\n").code, 0,
            "no tampering penalty from the wrong key")
        m.unmount()
        // init: a key file that cannot be made leaves no store behind.
        let store2 = m.root + "/store2"
        let i = keybagfs(
            [
                "init", store2, "--passcode-stdin", "--device-key", m.root + "/dk2", "--kdf", "interactive",
                "--recovery-key-file", taken,
            ], stdin: "p\n")
        XCTAssertEqual(i.code, 1)
        XCTAssertFalse(
            FileManager.default.fileExists(atPath: store2 + "/keybag"), "no store whose recovery key nobody has")
        let again = keybagfs(
            [
                "init", store2, "--passcode-stdin", "--device-key", m.root + "/dk2", "--kdf", "interactive",
                "--recovery-key-file", m.root + "/second.txt",
            ], stdin: "p\n")
        XCTAssertEqual(again.code, 0, again.stderr)
    }
}
