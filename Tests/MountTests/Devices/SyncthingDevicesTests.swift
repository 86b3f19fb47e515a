import Foundation
import Glibc
import XCTest

/// Three hosts, each with its own replica, device key, passcode, mount and Syncthing, in a
/// network namespace with no route out (`SyncthingGroup`): a device added by approval, a
/// removal that the device that stays takes up with its own passcode, and a record forged
/// straight into one replica, as a user with a laptop, a desktop and a phone-sized third
/// machine would check.
final class SyncthingDevicesTests: XCTestCase {
    static let classes = ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"]

    private func keybagfs(_ args: [String], stdin: String? = nil) -> ToolResult {
        MountFixture.run(MountFixture.binDir + "/keybagfs", args, stdin: stdin)
    }

    private func id(_ m: MountFixture) -> String {
        keybagfs(["device", "id", m.store, "--device-key", m.deviceKey]).stdout.trimmingCharacters(
            in: .whitespacesAndNewlines)
    }

    private func storeID(_ m: MountFixture) -> String {
        ((try? JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))))
            as? [String: Any])?["storeID"] as? String ?? ""
    }

    private func exists(_ m: MountFixture, _ rel: String) -> Bool {
        FileManager.default.fileExists(atPath: m.store + "/" + rel)
    }

    /// The daemon log's last lines and Syncthing's, for failure messages.
    private func diagnosis(_ mounts: [MountFixture], _ sync: SyncthingGroup) -> String {
        sync.logs(lines: 10)
            + mounts.map { m in
                let log = (try? String(contentsOfFile: m.root + "/daemon.log", encoding: .utf8)) ?? ""
                let devices = (try? FileManager.default.contentsOfDirectory(atPath: m.store + "/devices")) ?? []
                return "\n--- \(m.root): devices/ \(devices.sorted())\n"
                    + log.split(separator: "\n").suffix(10).joined(separator: "\n")
            }.joined()
    }

    /// C joins by A's approval, each step's file carried by Syncthing.
    private func addByApproval(_ c: MountFixture, approver a: MountFixture, _ sync: SyncthingGroup) throws {
        let first = keybagfs(
            ["device", "add", c.store, "--device-key", c.deviceKey, "--approval", "--kdf", "interactive", "--stdin"],
            stdin: c.passcode + "\n")
        XCTAssertEqual(first.code, 0, first.stderr)
        let idC = id(c)
        XCTAssertTrue(waitUntil(60) { self.exists(a, "devices/\(idC).request") }, diagnosis([a, c], sync))
        XCTAssertEqual(keybagfs(["device", "approve", a.store, idC, "--device-key", a.deviceKey]).code, 0)
        XCTAssertTrue(waitUntil(60) { self.exists(c, "devices/\(idC).challenge") }, diagnosis([a, c], sync))
        let shown = keybagfs(["device", "add", c.store, "--device-key", c.deviceKey, "--approval"])
        guard let r = shown.stdout.range(of: "pairing code: ") else {
            return XCTFail("no code: \(shown.stdout) \(shown.stderr)")
        }
        let code = String(shown.stdout[r.upperBound...].prefix(6))
        XCTAssertTrue(waitUntil(60) { self.exists(a, "devices/\(idC).reveal") }, diagnosis([a, c], sync))
        let ok = keybagfs(
            ["device", "approve", a.store, idC, "--device-key", a.deviceKey, "--code", code, "--stdin"],
            stdin: a.passcode + "\n")
        XCTAssertEqual(ok.code, 0, ok.stderr)
        let confirmation =
            ok.stdout.range(of: "confirmation code: ").map { String(ok.stdout[$0.upperBound...].prefix(6)) } ?? ""
        XCTAssertTrue(waitUntil(60) { self.exists(c, "devices/\(idC).grant") }, diagnosis([a, c], sync))
        let done = keybagfs(
            [
                "device", "add", c.store, "--device-key", c.deviceKey, "--approval", "--code", confirmation, "--stdin",
                "--kdf", "interactive",
            ], stdin: c.passcode + "\n")
        XCTAssertEqual(done.code, 0, done.stderr)
    }

    func testThreeHostsAddByApprovalRemoveOneAndTheThirdCarriesOnWithItsOwnPasscode() throws {
        let a = try MountFixture(passcode: "host A passcode", mount: false)
        defer { a.close() }
        let b = try MountFixture(replicaOf: a, passcode: "host B passcode", copy: false)
        let c = try MountFixture(replicaOf: a, passcode: "host C passcode", copy: false)
        defer { b.close(); c.close() }
        let rk = a.root + "/recovery.txt"
        XCTAssertEqual(
            keybagfs(
                [
                    "recovery-key", "rotate", a.store, "--device-key", a.deviceKey, "--passcode-stdin",
                    "--recovery-key-file", rk,
                ],
                stdin: a.passcode + "\n"
            ).code, 0)
        let sync = try SyncthingGroup(root: a.root, folders: [a.store, b.store, c.store])
        defer { sync.close() }
        XCTAssertEqual(sync.routes().trimmingCharacters(in: .whitespacesAndNewlines), "", "no route out")
        for i in 0..<3 { try sync.start(i) }
        for m in [b, c] {
            XCTAssertTrue(
                waitUntil(90) { self.exists(m, "keybag") && self.exists(m, "data") && self.exists(m, "devices") },
                "the store reached \(m.root): \(diagnosis([a, b, c], sync))")
        }
        // B joins with the recovery key, C by A's approval.
        let add = keybagfs(
            [
                "device", "add", b.store, "--device-key", b.deviceKey, "--recovery-key-file", rk, "--stdin", "--kdf",
                "interactive", "--name", "host-b",
            ], stdin: b.passcode + "\n")
        XCTAssertEqual(add.code, 0, add.stderr)
        try addByApproval(c, approver: a, sync)
        let (idA, idB, idC) = (id(a), id(b), id(c))
        for m in [a, b, c] {
            XCTAssertTrue(
                waitUntil(60) {
                    [idB, idC].allSatisfy {
                        self.exists(m, "devices/\($0).keybag") && self.exists(m, "devices/\($0).identity")
                    }
                }, "every device's keybag and certificate everywhere: \(diagnosis([a, b, c], sync))")
        }
        for m in [a, b, c] {
            try m.mount()
            m.unlock()
        }
        for cls in Self.classes {
            XCTAssertEqual(writeFile(a.path("a-\(cls)"), bytes("from A \(cls)")), 0)
            XCTAssertEqual(setXattr(a.path("a-\(cls)"), cls), 0)
        }
        for m in [b, c] {
            XCTAssertTrue(
                waitUntil(60) {
                    Self.classes.allSatisfy { (try? readFile(m.path("a-\($0)")).get()) == bytes("from A \($0)") }
                },
                "A's files on \(m.root): \(diagnosis([a, b, c], sync))")
        }

        // A store writer puts a forged removal of C straight into B's replica: every device names
        // it and nothing stops.
        let forged =
            #"{"deviceID":"\#(idC)","removedAt":1,"keySet":2,"by":"\#(idA)","signature":"\#(Data(repeating: 3, count: 64).base64EncodedString())"}"#
        try Data(forged.utf8).write(to: URL(fileURLWithPath: b.store + "/devices/\(idC).removed"))
        for m in [a, b, c] {
            XCTAssertTrue(
                waitUntil(60) {
                    ((m.status()["refusedRecords"] as? [String]) ?? []).contains { $0.hasPrefix("\(idC).removed") }
                },
                "\(m.root) names the forged record: \(m.status())")
            XCTAssertEqual(m.status()["keySetBehind"] as? Bool, false)
        }
        XCTAssertEqual(writeFile(c.path("c-still-works"), bytes("C after the forgery")), 0)
        for m in [a, b, c] { unlink(m.store + "/devices/\(idC).removed") }  // the writer's file goes again

        // A removes B (a lost laptop); C takes the new set up at its next unlock, no recovery key.
        a.unmount()
        let rm = keybagfs(
            ["device", "remove", a.store, idB, "--device-key", a.deviceKey, "--recovery-key-file", rk, "--stdin"],
            stdin: a.passcode + "\n")
        XCTAssertEqual(rm.code, 0, rm.stderr)
        try a.mount()
        a.unlock()
        XCTAssertTrue(
            waitUntil(60) { c.status()["keySetBehind"] as? Bool == true },
            "C hears of the removal while mounted: \(diagnosis([a, b, c], sync))")
        c.lock()
        c.unlock()
        XCTAssertEqual(c.status()["keySetBehind"] as? Bool, false, "\(c.status())")
        XCTAssertEqual(c.status()["keySet"] as? Int, 2)
        for cls in Self.classes {
            XCTAssertEqual(writeFile(c.path("c-\(cls)"), bytes("from C \(cls)")), 0)
            XCTAssertEqual(setXattr(c.path("c-\(cls)"), cls), 0)
        }
        XCTAssertTrue(
            waitUntil(60) {
                Self.classes.allSatisfy { (try? readFile(a.path("c-\($0)")).get()) == bytes("from C \($0)") }
            },
            "C's new files on A: \(diagnosis([a, b, c], sync))")
        // B, still mounted with the keys it had, gets the files and opens none of them.
        XCTAssertTrue(
            waitUntil(60) { Self.classes.allSatisfy { FileManager.default.fileExists(atPath: b.path("c-\($0)")) } },
            diagnosis([a, b, c], sync))
        for cls in Self.classes { XCTAssertEqual(errnoOf(readFile(b.path("c-\(cls)"))), EACCES, cls) }
        XCTAssertNotEqual(writeFile(b.path("b-after"), bytes("x")), 0, "B wraps nothing new")

        // A store writer deletes the removal record (the deletion reaches every replica) and adds
        // a device of its own (a certificate and a keybag, neither the recovery key's nor an
        // approval's): C still knows B is removed, names the device, and carries on.
        unlink(c.store + "/devices/\(idB).removed")
        let forger = "ffffffffffffffffffffffffffffff02"
        let junk = Data(repeating: 9, count: 32).base64EncodedString()
        let cert =
            #"{"storeID":"\#(storeID(a))","deviceID":"\#(forger)","box":"\#(junk)","sign":"\#(junk)","keySet":2,"#
            + #""by":"store","issuedAt":1,"signature":"\#(Data(repeating: 7, count: 64).base64EncodedString())"}"#
        try Data(cert.utf8).write(to: URL(fileURLWithPath: c.store + "/devices/\(forger).identity"))
        try FileManager.default.copyItem(
            atPath: c.store + "/devices/\(idC).keybag", toPath: c.store + "/devices/\(forger).keybag")
        for m in [a, b] {
            XCTAssertTrue(
                waitUntil(60) {
                    !self.exists(m, "devices/\(idB).removed") && self.exists(m, "devices/\(forger).identity")
                },
                diagnosis([a, b, c], sync))
        }
        for m in [a, c] {
            let refused = (m.status()["refusedRecords"] as? [String]) ?? []
            XCTAssertTrue(refused.contains { $0.hasPrefix("\(forger).identity") }, "\(refused)")
            XCTAssertEqual(m.status()["keySetBehind"] as? Bool, false)
        }
        XCTAssertEqual(writeFile(c.path("c-after-the-writer"), bytes("C carries on")), 0)

        // A rotates the recovery key; C takes the new set up at its next unlock; a file C writes
        // then opens with no key the old recovery key reaches.
        a.unmount()
        let rk2 = a.root + "/recovery-2.txt"
        let rot = keybagfs(
            [
                "recovery-key", "rotate", a.store, "--device-key", a.deviceKey, "--passcode-stdin",
                "--recovery-key-file", rk2, "--current-recovery-key-file", rk,
            ],
            stdin: a.passcode + "\n")
        XCTAssertEqual(rot.code, 0, rot.stderr)
        try a.mount()
        a.unlock()
        XCTAssertTrue(waitUntil(60) { c.status()["keySetBehind"] as? Bool == true }, diagnosis([a, b, c], sync))
        c.lock()
        c.unlock()
        XCTAssertEqual(c.status()["keySet"] as? Int, 3, "\(c.status())")
        for cls in Self.classes {
            XCTAssertEqual(writeFile(c.path("r-\(cls)"), bytes("after the rotation \(cls)")), 0)
            XCTAssertEqual(setXattr(c.path("r-\(cls)"), cls), 0)
        }
        XCTAssertTrue(
            waitUntil(60) {
                Self.classes.allSatisfy {
                    (try? readFile(a.path("r-\($0)")).get()) == bytes("after the rotation \($0)")
                }
            }, diagnosis([a, b, c], sync))
        for m in [a, b, c] { m.unmount() }
        // A thief with the old recovery key and C's replica (the writer's copy of a keybag gone
        // again): no keybag's escrow opens with it now. (A keybag copy from before the rotation
        // opens the older sets only: DeviceIdentityTests.)
        for kind in ["identity", "keybag"] { unlink(c.store + "/devices/\(forger).\(kind)") }
        let thief = try MountFixture(replicaOf: c, passcode: "thief passcode")
        defer { thief.close() }
        let rec = keybagfs(
            [
                "recover", thief.store, "--device-key", thief.deviceKey, "--new-device-key", "--recovery-key-file", rk,
                "--stdin", "--first-device",
            ], stdin: thief.passcode + "\n")
        XCTAssertNotEqual(rec.code, 0, "the old recovery key: \(rec.stdout)")
        for m in [a, c] { XCTAssertEqual(m.fsck().code, 0, "\(m.fsck().out)") }
        // B's replica, checked with A's device key (B's own keybag is gone from it).
        let fsckB = keybagfs(
            ["fsck", b.store, "--device-key", a.deviceKey, "--passcode-stdin", "--json"], stdin: a.passcode + "\n")
        XCTAssertEqual(fsckB.code, 0, fsckB.stdout + fsckB.stderr)
    }
}
