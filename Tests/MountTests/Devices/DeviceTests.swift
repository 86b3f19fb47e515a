import Foundation
import Glibc
import XCTest

/// Several devices of one store, each with its own device key, passcode, counter and lock,
/// through the real binaries and real mounts. The sync engine is played by copying store
/// files between the two replicas (the two-host Syncthing test does it for real).
final class DeviceTests: XCTestCase {
    private func keybagfs(_ args: [String], stdin: String? = nil) -> ToolResult {
        MountFixture.run(MountFixture.binDir + "/keybagfs", args, stdin: stdin)
    }

    /// Copies `rel` (a file or folder inside the store) from one replica to the other, as a sync engine would.
    private func sync(_ rel: String, from a: MountFixture, to b: MountFixture) {
        let r = MountFixture.run(
            "/bin/sh",
            ["-c", "mkdir -p \"$(dirname \"$1\")\" && cp -a \"$0\" \"$1\"", a.store + "/" + rel, b.store + "/" + rel])
        XCTAssertEqual(r.code, 0, r.stderr)
    }

    /// The key set byte (11) of a backing file's header slot in use.
    private func keySet(ofBacking path: String) -> UInt8? {
        guard let d = FileManager.default.contents(atPath: path), d.count >= 320 else { return nil }
        let b = [UInt8](d)
        return b[0..<4] == [0x4b, 0x42, 0x48, 0x31][...] ? b[11] : b[160 + 11]
    }

    /// Device A's store with its recovery key written to a file, mounted and unlocked.
    private func firstDevice() throws -> (MountFixture, recoveryKey: String) {
        let a = try MountFixture(passcode: "device A passcode", mount: false)
        let rk = a.root + "/recovery.txt"
        XCTAssertEqual(
            keybagfs(
                [
                    "recovery-key", "rotate", a.store, "--device-key", a.deviceKey, "--passcode-stdin",
                    "--recovery-key-file", rk,
                ], stdin: a.passcode + "\n"
            ).code, 0)
        do { try a.mount() } catch { a.close(); throw error }
        a.unlock()
        return (a, rk)
    }

    func testAnAddedDeviceReadsTheStoreWithItsOwnPasscodeAndARemovedOneCannotOpenNewerFiles() throws {
        let (a, rk) = try firstDevice()
        defer { a.close() }
        XCTAssertEqual(writeFile(a.path("old-c.txt"), bytes("written before B was removed")), 0)
        XCTAssertEqual(writeFile(a.path("old-a.txt"), bytes("class A, before")), 0)
        XCTAssertEqual(setXattr(a.path("old-a.txt"), "complete"), 0)
        a.unmount()

        // Host B gets a copy of the store (the sync engine) and joins with the recovery key.
        let b = try MountFixture(replicaOf: a, passcode: "device B passcode")
        defer { b.close() }
        let add = keybagfs(
            [
                "device", "add", b.store, "--device-key", b.deviceKey, "--recovery-key-file", rk, "--stdin", "--kdf",
                "interactive", "--name", "host-b",
            ], stdin: b.passcode + "\n")
        XCTAssertEqual(add.code, 0, add.stderr)
        let idB = keybagfs(["device", "id", b.store, "--device-key", b.deviceKey]).stdout.trimmingCharacters(
            in: .whitespacesAndNewlines)
        let idA = keybagfs(["device", "id", a.store, "--device-key", a.deviceKey]).stdout.trimmingCharacters(
            in: .whitespacesAndNewlines)
        XCTAssertEqual(idB.count, 32)
        XCTAssertNotEqual(idA, idB)
        XCTAssertTrue(FileManager.default.fileExists(atPath: b.store + "/devices/\(idB).keybag"))
        XCTAssertFalse(add.stdout.contains(b.passcode) || add.stderr.contains(b.passcode))
        let again = keybagfs(
            [
                "device", "add", b.store, "--device-key", b.deviceKey, "--recovery-key-file", rk, "--stdin", "--kdf",
                "interactive",
            ], stdin: "x\n")
        XCTAssertNotEqual(again.code, 0, "a device is added once")
        sync("devices/\(idB).keybag", from: b, to: a)
        let list = keybagfs(["device", "list", a.store, "--json"])
        XCTAssertTrue(list.stdout.contains(idB) && list.stdout.contains("host-b"), list.stdout + list.stderr)

        // B mounts with its own key; A's passcode does not unlock it, and B's failures are B's alone.
        try b.mount()
        let wrong = b.ctl(["unlock", "--passcode-stdin"], stdin: a.passcode + "\n")
        XCTAssertNotEqual(wrong.code, 0, "device A's passcode is not device B's")
        b.unlock()
        XCTAssertEqual(try readFile(b.path("old-c.txt")).get(), bytes("written before B was removed"))
        XCTAssertEqual(try readFile(b.path("old-a.txt")).get(), bytes("class A, before"))
        XCTAssertEqual(try getXattr(b.path("old-a.txt")).get(), "complete", "the class is the same on every device")
        b.lock()
        XCTAssertEqual(errnoOf(readFile(b.path("old-a.txt"))), EACCES, "B's lock is B's")
        b.unmount()
        let kbA =
            try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: a.store + "/keybag")))
            as! [String: Any]
        XCTAssertEqual(kbA["failedAttempts"] as? Int, 0, "B's wrong passcode is not counted in A's keybag")

        // A removes B: a wrong passcode is refused and nothing changes; the right one starts key set 1.
        let bad = keybagfs(
            ["device", "remove", a.store, idB, "--device-key", a.deviceKey, "--recovery-key-file", rk, "--stdin"],
            stdin: "not it\n")
        XCTAssertNotEqual(bad.code, 0)
        XCTAssertTrue(FileManager.default.fileExists(atPath: a.store + "/devices/\(idB).keybag"))
        let rm = keybagfs(
            ["device", "remove", a.store, idB, "--device-key", a.deviceKey, "--recovery-key-file", rk, "--stdin"],
            stdin: a.passcode + "\n")
        XCTAssertEqual(rm.code, 0, rm.stderr)
        XCTAssertFalse(FileManager.default.fileExists(atPath: a.store + "/devices/\(idB).keybag"))
        XCTAssertTrue(keybagfs(["device", "list", a.store]).stdout.contains("\(idB)  removed"))
        try a.mount()
        a.unlock()
        XCTAssertEqual(writeFile(a.path("new-c.txt"), bytes("written after B was removed")), 0)
        XCTAssertEqual(writeFile(a.path("new-a.txt"), bytes("class A, after")), 0)
        XCTAssertEqual(setXattr(a.path("new-a.txt"), "complete"), 0)
        XCTAssertEqual(try readFile(a.path("old-a.txt")).get(), bytes("class A, before"), "A still reads older files")
        // `recovery-key rotate` (in `firstDevice`) started set 1; the removal set 2.
        XCTAssertEqual(keySet(ofBacking: a.backing("new-c.txt")), 2)
        XCTAssertEqual(keySet(ofBacking: a.backing("old-c.txt")), 1)
        a.unmount()
        let fsck = a.fsck()
        XCTAssertEqual(fsck.code, 0, "\(fsck.out)")

        // B's holder keeps B's keybag and gets the newer files (a thief ignores the removal):
        // the files from before open, the files from after do not.
        let r = MountFixture.run("/bin/cp", ["-a", a.store + "/data/.", b.store + "/data/"])
        XCTAssertEqual(r.code, 0, r.stderr)
        try b.mount()
        b.unlock()
        XCTAssertEqual(try readFile(b.path("old-c.txt")).get(), bytes("written before B was removed"))
        XCTAssertEqual(errnoOf(readFile(b.path("new-c.txt"))), EACCES, "a file written after the removal")
        XCTAssertEqual(errnoOf(readFile(b.path("new-a.txt"))), EACCES, "a class A file written after the removal")
        b.unmount()

        // An honest B, synced in full, is told it was removed (its own keybag still there).
        XCTAssertEqual(MountFixture.run("/bin/cp", ["-a", a.store + "/devices/.", b.store + "/devices/"]).code, 0)
        XCTAssertThrowsError(try b.mount())
        let log = (try? String(contentsOfFile: b.root + "/daemon.log", encoding: .utf8)) ?? ""
        XCTAssertTrue(log.contains("was removed"), log)
    }
    /// Two devices of one store on one machine (two users, or two replicas) share the default
    /// device-key path `/var/lib/keybagfs/STOREID.key` unless each names its own: `device add`
    /// with a key file that is already a device of the store is refused before it asks for
    /// anything, naming `--device-key`; the key file and the replica stay as they were.
    func testDeviceAddRefusesAKeyFileThatIsAlreadyADeviceOfTheStore() throws {
        let (a, rk) = try firstDevice()
        defer { a.close() }
        a.unmount()
        let b = try MountFixture(replicaOf: a, passcode: "device B passcode")
        defer { b.close() }
        let keyBefore = try Data(contentsOf: URL(fileURLWithPath: a.deviceKey))
        let devicesBefore = try FileManager.default.contentsOfDirectory(atPath: b.store + "/devices")
        let idA = keybagfs(["device", "id", a.store, "--device-key", a.deviceKey]).stdout.trimmingCharacters(
            in: .whitespacesAndNewlines)
        let add = keybagfs([
            "device", "add", b.store, "--device-key", a.deviceKey, "--recovery-key-file", rk, "--stdin", "--kdf",
            "interactive",
        ])
        XCTAssertNotEqual(add.code, 0, "device A's key made a second device")
        XCTAssertTrue(
            add.stderr.contains("--device-key") && add.stderr.contains(idA),
            "names the way out and the owner: \(add.stderr)")
        XCTAssertFalse(add.stderr.contains("passcode"), "refused before asking for a passcode: \(add.stderr)")
        XCTAssertEqual(try Data(contentsOf: URL(fileURLWithPath: a.deviceKey)), keyBefore)
        XCTAssertEqual(
            try FileManager.default.contentsOfDirectory(atPath: b.store + "/devices"), devicesBefore,
            "nothing written to the replica")
        let own = keybagfs(
            [
                "device", "add", b.store, "--device-key", b.deviceKey, "--recovery-key-file", rk, "--stdin", "--kdf",
                "interactive",
            ], stdin: b.passcode + "\n")
        XCTAssertEqual(own.code, 0, "with its own key: \(own.stderr)")
    }

    func testADeviceMountedWhileAnotherIsRemovedRefusesNewFilesAtOnce() throws {
        let (a, rk) = try firstDevice()
        defer { a.close() }
        XCTAssertEqual(writeFile(a.path("before.txt"), bytes("before the removal")), 0)
        a.unmount()
        // Devices B (to be lost) and C (mounted through the removal) join from their replicas.
        var ids: [String] = []
        var replicas: [MountFixture] = []
        for name in ["host-b", "host-c"] {
            let m = try MountFixture(replicaOf: a, passcode: name + " passcode")
            replicas.append(m)
            let add = keybagfs(
                [
                    "device", "add", m.store, "--device-key", m.deviceKey, "--recovery-key-file", rk, "--stdin",
                    "--kdf", "interactive", "--name", name,
                ], stdin: m.passcode + "\n")
            XCTAssertEqual(add.code, 0, add.stderr)
            ids.append(
                keybagfs(["device", "id", m.store, "--device-key", m.deviceKey]).stdout.trimmingCharacters(
                    in: .whitespacesAndNewlines))
            sync("devices/\(ids.last!).keybag", from: m, to: a)
        }
        let (b, c) = (replicas[0], replicas[1])
        defer { b.close(); c.close() }
        sync("devices/\(ids[0]).keybag", from: b, to: c)
        try c.mount()
        c.unlock()
        XCTAssertEqual(writeFile(c.path("while-b-was-there.txt"), bytes("C, before")), 0)
        XCTAssertTrue(
            c.ctl(["status", "--json"]).stdout.contains("\"keySetBehind\":false"), c.ctl(["status", "--json"]).stdout)

        // A removes B; the record reaches C's replica as a sync engine brings it, while C is mounted.
        let rm = keybagfs(
            ["device", "remove", a.store, ids[0], "--device-key", a.deviceKey, "--recovery-key-file", rk, "--stdin"],
            stdin: a.passcode + "\n")
        XCTAssertEqual(rm.code, 0, rm.stderr)
        let record = a.store + "/devices/\(ids[0]).removed", tmp = c.store + "/devices/.syncthing.\(ids[0]).removed.tmp"
        XCTAssertEqual(MountFixture.run("/bin/cp", [record, tmp]).code, 0)
        XCTAssertEqual(rename(tmp, c.store + "/devices/\(ids[0]).removed"), 0)
        XCTAssertEqual(unlink(c.store + "/devices/\(ids[0]).keybag"), 0)

        // C takes no new file or class change that B could open, and says why; what exists still reads.
        XCTAssertTrue(
            waitUntil(5) { c.ctl(["status", "--json"]).stdout.contains("\"keySetBehind\":true") },
            c.ctl(["status", "--json"]).stdout)
        XCTAssertNotEqual(
            writeFile(c.path("after.txt"), bytes("C, after")), 0, "a new file would be wrapped for the old key set")
        XCTAssertNotEqual(setXattr(c.path("before.txt"), "complete"), 0, "so would a class change")
        XCTAssertEqual(try readFile(c.path("before.txt")).get(), bytes("before the removal"))
        XCTAssertEqual(try readFile(c.path("while-b-was-there.txt")).get(), bytes("C, before"))
        let log = (try? String(contentsOfFile: c.root + "/daemon.log", encoding: .utf8)) ?? ""
        XCTAssertTrue(log.contains("keybagfs recover"), log)
    }
}
