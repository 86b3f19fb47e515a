import Foundation
import Glibc
import XCTest

/// Three devices of one store, each with its own replica, device key, passcode and mount,
/// with device identities: a removal and a recovery-key rotation reach the devices that stay
/// without the recovery key, and records a store writer forges are refused. The sync engine is
/// played by copying store folders between replicas (the three-host Syncthing test does it for real).
final class DeviceIdentityTests: XCTestCase {
    static let classes = ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"]

    private func keybagfs(_ args: [String], stdin: String? = nil) -> ToolResult {
        MountFixture.run(MountFixture.binDir + "/keybagfs", args, stdin: stdin)
    }

    /// Makes `rel` (a folder of the store) of `dst` what it is in `src`, deletions included,
    /// as a sync engine that has caught up would.
    private func mirror(_ rel: String, from src: MountFixture, to dst: MountFixture) {
        let r = MountFixture.run(
            "/bin/sh", ["-c", "rm -rf \"$1\" && cp -a \"$0\" \"$1\"", src.store + "/" + rel, dst.store + "/" + rel])
        XCTAssertEqual(r.code, 0, r.stderr)
    }

    /// `dst`'s replica catches up with `src`'s: the first device's keybag, the devices folder
    /// and the data, as `src` has them.
    private func catchUp(_ dst: MountFixture, from src: MountFixture) {
        XCTAssertEqual(MountFixture.run("/bin/cp", ["-a", src.store + "/keybag", dst.store + "/keybag"]).code, 0)
        mirror("devices", from: src, to: dst)
        mirror("data", from: src, to: dst)
    }

    /// `m`'s own keybag reaches the other replicas (it wrote it; they hold an older copy).
    private func deliverOwnKeybag(_ m: MountFixture, to others: [MountFixture]) {
        let rel = "devices/\(id(m)).keybag"
        for o in others {
            XCTAssertEqual(MountFixture.run("/bin/cp", ["-a", m.store + "/" + rel, o.store + "/" + rel]).code, 0)
        }
    }

    /// Copies every file of `devices/` in each replica to every other (what each device wrote
    /// reaches the others).
    private func exchangeDevices(_ all: [MountFixture]) {
        for src in all {
            for dst in all where dst !== src {
                let r = MountFixture.run("/bin/cp", ["-an", src.store + "/devices/.", dst.store + "/devices/"])
                XCTAssertEqual(r.code, 0, r.stderr)
            }
        }
    }

    /// This device's id.
    private func id(_ m: MountFixture) -> String {
        keybagfs(["device", "id", m.store, "--device-key", m.deviceKey]).stdout.trimmingCharacters(
            in: .whitespacesAndNewlines)
    }

    /// The key set byte (11) of a backing file's header slot in use.
    private func keySet(ofBacking path: String) -> UInt8? {
        guard let d = FileManager.default.contents(atPath: path), d.count >= 320 else { return nil }
        let b = [UInt8](d)
        return b[0..<4] == [0x4b, 0x42, 0x48, 0x31][...] ? b[11] : b[160 + 11]
    }

    /// Device A (its recovery key in a file), and B and C added from replicas with it, each
    /// device's certificate and keybag delivered to the others; none mounted.
    private func threeDevices() throws -> (a: MountFixture, b: MountFixture, c: MountFixture, rk: String) {
        let a = try MountFixture(passcode: "device A passcode", mount: false)
        let rk = a.root + "/recovery.txt"
        let rot = keybagfs(
            [
                "recovery-key", "rotate", a.store, "--device-key", a.deviceKey, "--passcode-stdin",
                "--recovery-key-file", rk,
            ],
            stdin: a.passcode + "\n")
        XCTAssertEqual(rot.code, 0, rot.stderr)
        var others: [MountFixture] = []
        for name in ["host-b", "host-c"] {
            let m = try MountFixture(replicaOf: a, passcode: name + " passcode")
            others.append(m)
            let add = keybagfs(
                [
                    "device", "add", m.store, "--device-key", m.deviceKey, "--recovery-key-file", rk, "--stdin",
                    "--kdf", "interactive", "--name", name,
                ], stdin: m.passcode + "\n")
            XCTAssertEqual(add.code, 0, add.stderr)
        }
        exchangeDevices([a] + others)
        return (a, others[0], others[1], rk)
    }

    /// Writes one file of each class into `m`'s mount under `prefix`, checks it reads back.
    private func writeEveryClass(
        _ m: MountFixture, _ prefix: String, file: StaticString = #filePath, line: UInt = #line
    ) {
        for cls in Self.classes {
            let p = m.path("\(prefix)-\(cls)")
            XCTAssertEqual(writeFile(p, bytes("\(prefix) \(cls)")), 0, "create \(cls)", file: file, line: line)
            XCTAssertEqual(setXattr(p, cls), 0, "class \(cls)", file: file, line: line)
            XCTAssertEqual(try? readFile(p).get(), bytes("\(prefix) \(cls)"), file: file, line: line)
        }
    }

    func testARemovalReachesTheDevicesThatStayWithoutTheRecoveryKey() throws {
        let (a, b, c, rk) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        let (idB, idC) = (id(b), id(c))
        try a.mount()
        a.unlock()
        writeEveryClass(a, "before")
        a.unmount()
        let keepB = try Data(contentsOf: URL(fileURLWithPath: b.store + "/devices/\(idB).keybag"))

        let rm = remove(idB, on: a, rk: rk)
        XCTAssertEqual(rm.code, 0, rm.stderr)
        let record =
            try recordJSON(of: a, 2)
        XCTAssertEqual(
            Set(((record["members"] as? [String: Any]) ?? [:]).keys), [id(a), idC], "B is not handed the set")
        XCTAssertNil((record["grants"] as? [String: Any])?[idB])

        // C's replica catches up with A's (the removal, the new set's record, the data).
        catchUp(c, from: a)
        try c.mount()
        XCTAssertEqual(c.status()["keySetBehind"] as? Bool, true, "until C unlocks, nothing new is wrapped")
        XCTAssertNotEqual(writeFile(c.path("too-early"), bytes("x")), 0)
        c.unlock()  // its own passcode; no recovery key
        XCTAssertEqual(c.status()["keySetBehind"] as? Bool, false, "\(c.status())")
        XCTAssertEqual(c.status()["keySet"] as? Int, 2)
        writeEveryClass(c, "after")
        for cls in Self.classes {
            XCTAssertEqual(keySet(ofBacking: c.backing("after-\(cls)")), 2, cls)
            XCTAssertEqual(try? readFile(c.path("before-\(cls)")).get(), bytes("before \(cls)"), cls)
        }
        let log = (try? String(contentsOfFile: c.root + "/daemon.log", encoding: .utf8)) ?? ""
        XCTAssertTrue(log.contains("took up key set 2"), log)
        // Taken up for good: after a restart C unlocks straight into set 2.
        c.unmount()
        try c.mount()
        c.unlock()
        XCTAssertEqual(c.status()["keySetBehind"] as? Bool, false)
        XCTAssertEqual(try? readFile(c.path("after-complete")).get(), bytes("after complete"))
        c.unmount()
        XCTAssertEqual(c.fsck().code, 0, "\(c.fsck().out)")

        // A reads what C wrote.
        mirror("data", from: c, to: a)
        try a.mount()
        a.unlock()
        for cls in Self.classes { XCTAssertEqual(try? readFile(a.path("after-\(cls)")).get(), bytes("after \(cls)")) }
        a.unmount()

        // B's holder keeps B's keybag, takes C's replica and deletes the removal record from it:
        // B mounts, and opens what was written before its removal only.
        mirror("data", from: c, to: b)
        mirror("devices", from: c, to: b)
        XCTAssertEqual(unlink(b.store + "/devices/\(idB).removed"), 0)
        try keepB.write(to: URL(fileURLWithPath: b.store + "/devices/\(idB).keybag"))
        try b.mount()
        b.unlock()
        for cls in Self.classes {
            XCTAssertEqual(try? readFile(b.path("before-\(cls)")).get(), bytes("before \(cls)"), cls)
            XCTAssertEqual(errnoOf(readFile(b.path("after-\(cls)"))), EACCES, "written after B's removal: \(cls)")
        }
        XCTAssertNotEqual(writeFile(b.path("from-b"), bytes("x")), 0, "B knows set 2 exists and wraps nothing")

        // The same deletions on C's replica, the set's record too and B's keybag put back, give
        // B nothing: C remembers the removal, and the next set C makes goes to A alone.
        b.unmount()
        XCTAssertEqual(unlink(c.store + "/devices/\(idB).removed"), 0)
        XCTAssertEqual(unlink(recordPath(c, 2)), 0)
        try keepB.write(to: URL(fileURLWithPath: c.store + "/devices/\(idB).keybag"))
        let list = keybagfs(["device", "list", c.store, "--device-key", c.deviceKey, "--json"])
        let trust = (try? JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [String: Any])?["trust"]
        XCTAssertEqual((trust as? [String: Any])?["removed"] as? [String], [idB], list.stdout + list.stderr)
        XCTAssertEqual(Set((trust as? [String: Any])?["trusted"] as? [String] ?? []), [id(a), idC])
        let rot = keybagfs(
            [
                "recovery-key", "rotate", c.store, "--device-key", c.deviceKey, "--passcode-stdin",
                "--recovery-key-file", c.root + "/rk-c.txt", "--current-recovery-key-file", rk,
            ], stdin: c.passcode + "\n")
        XCTAssertEqual(rot.code, 0, rot.stderr)
        let set3 =
            try recordJSON(of: c, 3)
        XCTAssertEqual(Set(((set3["members"] as? [String: Any]) ?? [:]).keys), [id(a), idC], "never B")
    }

    /// A device added with the recovery key before the record of the newest set reached its
    /// replica trusts nobody but itself at first; once the record is there, its next unlock
    /// takes the record's list (checked with that set's keys), and it trusts A and C.
    func testADeviceAddedBeforeTheRecordArrivedTakesItsListAtUnlock() throws {
        let (a, b, c, rk) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        let rm = remove(id(b), on: a, rk: rk)
        XCTAssertEqual(rm.code, 0, rm.stderr)
        let d = try MountFixture(replicaOf: a, passcode: "host-d passcode")
        defer { d.close() }
        let record = recordPath(d, 2), aside = d.root + "/keyset-2.aside"
        XCTAssertEqual(rename(record, aside), 0)
        let add = keybagfs(
            [
                "device", "add", d.store, "--device-key", d.deviceKey, "--recovery-key-file", rk, "--stdin", "--kdf",
                "interactive",
            ], stdin: d.passcode + "\n")
        XCTAssertEqual(add.code, 0, add.stderr)
        func trusted() -> Set<String> {
            let list = keybagfs(["device", "list", d.store, "--device-key", d.deviceKey, "--json"])
            let t = (try? JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [String: Any])?["trust"]
            return Set(((t as? [String: Any])?["trusted"] as? [String]) ?? [])
        }
        XCTAssertEqual(trusted(), [id(d)])
        XCTAssertEqual(rename(aside, record), 0)
        try d.mount()
        d.unlock()
        d.unmount()
        XCTAssertEqual(trusted(), [id(a), id(c), id(d)])
        let log = (try? String(contentsOfFile: d.root + "/daemon.log", encoding: .utf8)) ?? ""
        XCTAssertTrue(log.contains("took the device list of key set 2"), log)
    }

    /// A device whose keybag a thief deleted from the store, or spoiled, is still removed by
    /// its id, and the device it approved is named.
    func testADeviceIsRemovedWhateverBecameOfItsKeybag() throws {
        let (a, b, c, rk) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        for (m, how) in [(b, "deleted"), (c, "spoiled")] {
            let path = a.store + "/devices/\(id(m)).keybag"
            if how == "deleted" {
                XCTAssertEqual(unlink(path), 0)
            } else {
                try Data("{}".utf8).write(to: URL(fileURLWithPath: path))
            }
            let rm = remove(id(m), on: a, rk: rk)
            XCTAssertEqual(rm.code, 0, "\(how): \(rm.stderr)")
            XCTAssertFalse(FileManager.default.fileExists(atPath: path))
        }
        let list = keybagfs(["device", "list", a.store, "--device-key", a.deviceKey, "--json"])
        let t = (try? JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [String: Any])?["trust"]
        XCTAssertEqual(Set(((t as? [String: Any])?["removed"] as? [String]) ?? []), [id(b), id(c)], list.stdout)
    }

    /// A pairing file a store writer swaps after the approver answered: its own challenge is
    /// put back (it never takes another for its own), and a changed request is refused.
    func testTheApproverKeepsItsOwnChallengeAndRefusesAChangedRequest() throws {
        let (a, b, c, _) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        let n = try MountFixture(replicaOf: a, passcode: "host-n passcode")
        let m = try MountFixture(replicaOf: a, passcode: "mallory passcode")
        defer { n.close(); m.close() }
        for x in [n, m] {
            let r = keybagfs(
                [
                    "device", "add", x.store, "--device-key", x.deviceKey, "--approval", "--kdf", "interactive",
                    "--stdin",
                ],
                stdin: x.passcode + "\n")
            XCTAssertEqual(r.code, 0, r.stderr)
        }
        let idN = id(n), idM = id(m)
        carry(idN, "request", from: n, to: a)
        XCTAssertEqual(keybagfs(["device", "approve", a.store, idN, "--device-key", a.deviceKey]).code, 0)
        let challengePath = a.store + "/devices/\(idN).challenge"
        let own = try Data(contentsOf: URL(fileURLWithPath: challengePath))
        var forged = try JSONSerialization.jsonObject(with: own) as! [String: Any]
        forged["nonce"] = Data(repeating: 4, count: 32).base64EncodedString()
        try JSONSerialization.data(withJSONObject: forged).write(to: URL(fileURLWithPath: challengePath))
        XCTAssertEqual(keybagfs(["device", "approve", a.store, idN, "--device-key", a.deviceKey]).code, 0)
        XCTAssertEqual(
            try JSONDecoder().decode(
                PairingChallenge.self, from: Data(contentsOf: URL(fileURLWithPath: challengePath))),
            try JSONDecoder().decode(PairingChallenge.self, from: own), "its own challenge is back")
        // The writer's request under N's name (its own keys and commitment).
        var req =
            try JSONSerialization.jsonObject(
                with: Data(contentsOf: URL(fileURLWithPath: m.store + "/devices/\(idM).request")))
            as! [String: Any]
        req["deviceID"] = idN
        try JSONSerialization.data(withJSONObject: req).write(
            to: URL(fileURLWithPath: a.store + "/devices/\(idN).request"))
        let refused = keybagfs(["device", "approve", a.store, idN, "--device-key", a.deviceKey])
        XCTAssertNotEqual(refused.code, 0)
        XCTAssertTrue(refused.stderr.contains("changed after this device answered"), refused.stderr)
        XCTAssertEqual(keybagfs(["device", "approve", a.store, idN, "--device-key", a.deviceKey, "--cancel"]).code, 0)
        XCTAssertFalse(FileManager.default.fileExists(atPath: challengePath))
    }

    /// A request under the id of a device of the store (a thief's keys for B's id) is never
    /// approved: only a new device is.
    func testTheApproverApprovesOnlyANewDevice() throws {
        let (a, b, c, _) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        let m = try MountFixture(replicaOf: a, passcode: "mallory passcode")
        defer { m.close() }
        let first = keybagfs(
            ["device", "add", m.store, "--device-key", m.deviceKey, "--approval", "--kdf", "interactive", "--stdin"],
            stdin: m.passcode + "\n")
        XCTAssertEqual(first.code, 0, first.stderr)
        for victim in [id(b), id(a)] {
            var req =
                try JSONSerialization.jsonObject(
                    with: Data(contentsOf: URL(fileURLWithPath: m.store + "/devices/\(id(m)).request")))
                as! [String: Any]
            req["deviceID"] = victim
            try JSONSerialization.data(withJSONObject: req).write(
                to: URL(fileURLWithPath: a.store + "/devices/\(victim).request"))
            let r = keybagfs(["device", "approve", a.store, victim, "--device-key", a.deviceKey])
            XCTAssertFalse(r.stdout.contains("answered"), r.stdout)  // B: its pairing is over; A: not another device
            XCTAssertFalse(FileManager.default.fileExists(atPath: a.store + "/devices/\(victim).challenge"))
        }
    }

    /// `n` joins by `approver`'s approval, the files carried by copying; its id.
    private func addByApproval(_ n: MountFixture, approver a: MountFixture) -> String {
        func step(_ m: MountFixture, _ args: [String], stdin: String? = nil) -> ToolResult {
            let r = keybagfs(args, stdin: stdin)
            XCTAssertEqual(r.code, 0, "\(args): \(r.stderr)")
            return r
        }
        let add = ["device", "add", n.store, "--device-key", n.deviceKey, "--approval", "--kdf", "interactive"]
        let approve = { (idN: String) in ["device", "approve", a.store, idN, "--device-key", a.deviceKey] }
        _ = step(n, add + ["--stdin"], stdin: n.passcode + "\n")
        let idN = id(n)
        carry(idN, "request", from: n, to: a)
        _ = step(a, approve(idN))
        carry(idN, "challenge", from: a, to: n)
        let code = pairingCode(step(n, add).stdout)
        carry(idN, "reveal", from: n, to: a)
        let ok = step(a, approve(idN) + ["--code", code, "--stdin"], stdin: a.passcode + "\n")
        let confirmation = ok.stdout.range(of: "confirmation code: ").map {
            String(ok.stdout[$0.upperBound...].prefix(6))
        }
        carry(idN, "grant", from: a, to: n)
        _ = step(n, add + ["--code", confirmation ?? "", "--stdin"], stdin: n.passcode + "\n")
        return idN
    }

    /// A thief's device approves a puppet, which every device remembers at its next unlock;
    /// the thief then deletes the puppet's certificate and keybag from the store. Removing the
    /// thief's device removes the puppet with it: the new set goes to neither.
    func testRemovingADeviceRemovesWhatItApprovedEvenWhenItsCertificatesAreGone() throws {
        let (a, b, c, rk) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        let p = try MountFixture(replicaOf: b, passcode: "puppet passcode")
        defer { p.close() }
        let idP = addByApproval(p, approver: b)
        carryDevice(idP, from: p, to: a)
        try a.mount()
        a.unlock()  // A learns of the puppet, approved by B
        a.unmount()
        for kind in ["identity", "keybag"] { unlink(a.store + "/devices/\(idP).\(kind)") }
        let rm = remove(id(b), on: a, rk: rk)
        XCTAssertEqual(rm.code, 0, rm.stderr)
        let record =
            try recordJSON(of: a, 2)
        XCTAssertEqual(Set((record["removed"] as? [String]) ?? []), [id(b), idP], rm.stdout)
        XCTAssertEqual(Set(((record["members"] as? [String: Any]) ?? [:]).keys), [id(a), id(c)])
        // On C's replica a store writer puts B's keybag in the first device's place: `device
        // remove first` would remove B, not the first device; it refuses, and removes nobody.
        let first = c.store + "/keybag"
        try FileManager.default.removeItem(atPath: first)
        try FileManager.default.copyItem(atPath: c.store + "/devices/\(id(b)).keybag", toPath: first)
        let swapped = remove("first", on: c, rk: rk)
        XCTAssertNotEqual(swapped.code, 0)
        XCTAssertTrue(swapped.stderr.contains("has a keybag of its own"), swapped.stderr)
        XCTAssertFalse(FileManager.default.fileExists(atPath: c.store + "/devices/\(id(b)).removed"))
    }

    /// Who approved whom travels with the trust itself: W, approved by A after A learnt of B's
    /// puppet, removes B and the puppet goes too, though its certificate is gone from W's replica.
    func testAnApprovedDeviceKnowsWhatTheOthersApproved() throws {
        let (a, b, c, rk) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        let p = try MountFixture(replicaOf: b, passcode: "puppet passcode")
        defer { p.close() }
        let idP = addByApproval(p, approver: b)
        carryDevice(idP, from: p, to: a)
        let w = try MountFixture(replicaOf: a, passcode: "host-w passcode")
        defer { w.close() }
        _ = addByApproval(w, approver: a)
        for kind in ["identity", "keybag"] { unlink(w.store + "/devices/\(idP).\(kind)") }
        let rm = remove(id(b), on: w, rk: rk)
        XCTAssertEqual(rm.code, 0, rm.stderr)
        let record =
            try recordJSON(of: w, 2)
        XCTAssertEqual(Set((record["removed"] as? [String]) ?? []), [id(b), idP], rm.stdout)
        XCTAssertNil((record["grants"] as? [String: Any])?[idP])
        // --keep names only devices W knew before: not one a store writer just showed it.
        let x = "ffffffffffffffffffffffffffffff03"
        let keep = remove(id(c), on: w, rk: rk, keep: x)
        XCTAssertNotEqual(keep.code, 0)
        XCTAssertTrue(keep.stderr.contains("knew before"), keep.stderr)
    }

    /// The fields of a challenge file, as a test compares them.
    struct PairingChallenge: Codable, Equatable {
        var deviceID: String, approver: String, approverSign: String, nonce: String, request: String
    }

    func testRecordsAStoreWriterForgesAreRefusedAndNothingStopsWorking() throws {
        let (a, b, c, rk) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        let (idA, idB, idC) = (id(a), id(b), id(c))
        // The writer's own key pair, and a device id of its own.
        let forger = "ffffffffffffffffffffffffffffff01"
        func forge(_ name: String, _ object: [String: Any]) throws {
            for m in [a, b, c] {
                try JSONSerialization.data(withJSONObject: object).write(
                    to: URL(fileURLWithPath: m.store + "/devices/" + name))
            }
        }
        let junkSig = Data(repeating: 7, count: 64).base64EncodedString()
        let junkKey = Data(repeating: 9, count: 32).base64EncodedString()
        let storeID =
            (try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: a.store + "/keybag")))
            as? [String: Any])?["storeID"] as? String ?? ""
        try forge("\(idC).removed", ["deviceID": idC, "removedAt": 1.0, "keySet": 7])  // unsigned
        try forge("\(idB).removed", ["deviceID": idB, "removedAt": 1.0, "keySet": 2, "by": idA, "signature": junkSig])
        try forge(
            "keyset-2.\(idA).json",
            [
                "storeID": storeID, "keySet": 2, "madeBy": idA, "madeAt": 1.0, "removed": [idC],
                "members": [idA: ["box": junkKey, "sign": junkKey]], "classBPublic": junkKey, "grants": [:],
                "escrow": [:], "signature": junkSig,
            ])
        try forge(
            "\(forger).identity",
            [
                "storeID": storeID, "deviceID": forger, "box": junkKey, "sign": junkKey, "keySet": 1, "by": "store",
                "issuedAt": 1.0, "signature": junkSig,
            ])
        try FileManager.default.copyItem(
            atPath: a.store + "/devices/\(idB).keybag", toPath: c.store + "/devices/\(forger).keybag")

        // Every device mounts, unlocks and writes; each names what it refused.
        for m in [a, b, c] {
            try m.mount()
            m.unlock()
            let st = m.status()
            XCTAssertEqual(st["keySetBehind"] as? Bool, false, "\(st)")
            let refused = (st["refusedRecords"] as? [String]) ?? []
            for name in ["\(idC).removed", "\(idB).removed", "keyset-2.\(idA).json", "\(forger).identity"] {
                XCTAssertTrue(refused.contains { $0.hasPrefix(name) }, "\(name) not refused: \(refused)")
            }
            writeEveryClass(m, "forged-around")
            m.unmount()
        }
        let log = (try? String(contentsOfFile: c.root + "/daemon.log", encoding: .utf8)) ?? ""
        XCTAssertTrue(log.contains("refused in devices/: keyset-2.\(idA).json"), log)

        // A real removal (the forged set-2 record moved aside, as A's replica has its own):
        // the set goes to C only, never to the forger's device.
        for m in [a, c] {
            unlink(m.store + "/devices/keyset-2.\(idA).json"); unlink(m.store + "/devices/\(idB).removed")
        }
        let rm = remove(idB, on: a, rk: rk)
        XCTAssertEqual(rm.code, 0, rm.stderr)
        let record =
            try recordJSON(of: a, 2)
        XCTAssertEqual(Set(((record["members"] as? [String: Any]) ?? [:]).keys), [idA, idC])
        mirror("devices", from: a, to: c)
        try c.mount()
        c.unlock()
        XCTAssertEqual(c.status()["keySet"] as? Int, 2)
        writeEveryClass(c, "after")
        c.unmount()
    }

    func testARecoveryKeyRotationReachesEveryDeviceAndTheOldKeyOpensNothingNewer() throws {
        let (a, b, c, rk) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        try a.mount()
        a.unlock()
        writeEveryClass(a, "before")
        a.unmount()
        // A backup of A's keybag from before the rotation: its escrow opens with the old key.
        let oldKeybag = try Data(contentsOf: URL(fileURLWithPath: a.store + "/keybag"))

        let rk2 = a.root + "/recovery-2.txt"
        // A device alone cannot take the store's recovery key over: on a store of several devices
        // the rotation needs the current one.
        let alone = keybagfs(
            [
                "recovery-key", "rotate", a.store, "--device-key", a.deviceKey, "--passcode-stdin",
                "--recovery-key-file", rk2,
            ],
            stdin: a.passcode + "\n")
        XCTAssertNotEqual(alone.code, 0)
        XCTAssertTrue(alone.stderr.contains("current recovery key"), alone.stderr)
        XCTAssertFalse(FileManager.default.fileExists(atPath: rk2), "no key is handed out when refused")
        let rot = keybagfs(
            [
                "recovery-key", "rotate", a.store, "--device-key", a.deviceKey, "--passcode-stdin",
                "--recovery-key-file", rk2, "--current-recovery-key-file", rk,
            ],
            stdin: a.passcode + "\n")
        XCTAssertEqual(rot.code, 0, rot.stderr)
        for m in [b, c] {
            catchUp(m, from: a)
            try m.mount()
            m.unlock()  // its own passcode: no recovery key, old or new
            XCTAssertEqual(m.status()["keySet"] as? Int, 2, "\(m.status())")
            writeEveryClass(m, "after-\(id(m).prefix(4))")
            m.unmount()
            XCTAssertEqual(m.fsck().code, 0, "\(m.fsck().out)")
        }
        deliverOwnKeybag(b, to: [a, c])
        deliverOwnKeybag(c, to: [a, b])
        // Every device's escrow now opens with the new key only: a device added from C's
        // replica needs it, and then reads what the others wrote before and after.
        let d = try MountFixture(replicaOf: c, passcode: "host-d passcode")
        defer { d.close() }
        for (key, ok) in [(rk, false), (rk2, true)] {
            let add = keybagfs(
                [
                    "device", "add", d.store, "--device-key", d.deviceKey, "--recovery-key-file", key, "--stdin",
                    "--kdf", "interactive",
                ], stdin: d.passcode + "\n")
            XCTAssertEqual(add.code == 0, ok, "\(key): \(add.stderr)")
        }
        try d.mount()
        d.unlock()
        for cls in Self.classes {
            XCTAssertEqual(try? readFile(d.path("before-\(cls)")).get(), bytes("before \(cls)"), cls)
            let name = "after-\(id(c).prefix(4))-\(cls)"
            XCTAssertEqual(
                try? readFile(d.path(name)).get(), bytes(name.replacingOccurrences(of: "-\(cls)", with: " \(cls)")))
        }
        d.unmount()

        // A thief with the old recovery key and the old keybag: the files from before open,
        // none written after the rotation does, on any device.
        let thief = try MountFixture(replicaOf: c, passcode: "thief passcode")
        defer { thief.close() }
        try oldKeybag.write(to: URL(fileURLWithPath: thief.store + "/keybag"))
        let rec = keybagfs(
            [
                "recover", thief.store, "--device-key", thief.deviceKey, "--new-device-key", "--recovery-key-file", rk,
                "--stdin", "--first-device",
            ], stdin: thief.passcode + "\n")
        XCTAssertEqual(rec.code, 0, rec.stderr)
        try thief.mount()
        thief.unlock()
        for cls in Self.classes {
            XCTAssertEqual(try? readFile(thief.path("before-\(cls)")).get(), bytes("before \(cls)"), cls)
            // The thief's replica is C's: C's files written after the rotation (B's stay on B's).
            XCTAssertEqual(errnoOf(readFile(thief.path("after-\(id(c).prefix(4))-\(cls)"))), EACCES, cls)
        }
    }

    /// The code a `device add --approval` step printed ("" when it printed none).
    private func pairingCode(_ out: String) -> String {
        guard let r = out.range(of: "pairing code: ") else { return "" }
        return String(out[r.upperBound...].prefix(6))
    }

    /// `device remove TARGET` on `m`'s replica with the recovery key `rk` (and `--keep`).
    private func remove(_ target: String, on m: MountFixture, rk: String, keep: String? = nil) -> ToolResult {
        keybagfs(
            ["device", "remove", m.store, target, "--device-key", m.deviceKey, "--recovery-key-file", rk, "--stdin"]
                + (keep.map { ["--keep", $0] } ?? []), stdin: m.passcode + "\n")
    }

    /// The record of key set `n` in `m`'s replica, as JSON.
    private func recordJSON(of m: MountFixture, _ n: Int) throws -> [String: Any] {
        try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: recordPath(m, n))))
            as? [String: Any]
            ?? [:]
    }

    /// Copies device `id`'s certificate and keybag from one replica to another.
    private func carryDevice(_ id: String, from src: MountFixture, to dst: MountFixture) {
        for kind in ["identity", "keybag"] { carry(id, kind, from: src, to: dst) }
    }

    /// The path of the record of key set `n` in `m`'s replica (its maker's id in its name).
    private func recordPath(_ m: MountFixture, _ n: Int) -> String {
        let names = (try? FileManager.default.contentsOfDirectory(atPath: m.store + "/devices")) ?? []
        return m.store + "/devices/" + (names.first { $0.hasPrefix("keyset-\(n).") } ?? "keyset-\(n).missing")
    }

    /// Copies one pairing file (`devices/ID.kind`) from one replica to another.
    private func carry(_ id: String, _ kind: String, from src: MountFixture, to dst: MountFixture) {
        let rel = "devices/\(id).\(kind)"
        XCTAssertEqual(MountFixture.run("/bin/cp", ["-a", src.store + "/" + rel, dst.store + "/" + rel]).code, 0, rel)
    }

    func testADeviceAddedByApprovalReadsEverythingTheApproverCan() throws {
        let (a, b, c, _) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        try a.mount()
        a.unlock()
        writeEveryClass(a, "by-a")
        a.unmount()
        let n = try MountFixture(replicaOf: a, passcode: "host-n passcode")
        defer { n.close() }
        func newcomer(_ extra: [String] = [], stdin: String? = nil) -> ToolResult {
            keybagfs(
                ["device", "add", n.store, "--device-key", n.deviceKey, "--approval", "--kdf", "interactive"] + extra,
                stdin: stdin)
        }
        func approve(_ id: String, _ extra: [String] = [], stdin: String? = nil) -> ToolResult {
            keybagfs(["device", "approve", a.store, id, "--device-key", a.deviceKey] + extra, stdin: stdin)
        }
        XCTAssertEqual(newcomer(["--stdin"], stdin: n.passcode + "\n").code, 0)
        let idN = id(n)
        carry(idN, "request", from: n, to: a)
        XCTAssertEqual(approve(idN).code, 0)
        carry(idN, "challenge", from: a, to: n)
        let shown = newcomer()
        let code = pairingCode(shown.stdout)
        XCTAssertEqual(code.count, 6, shown.stdout + shown.stderr)
        carry(idN, "reveal", from: n, to: a)
        // The approver refuses a code that is not this pairing's, and approves with the right one.
        let wrongCode = code == "000000" ? "000001" : "000000"
        XCTAssertNotEqual(approve(idN, ["--code", wrongCode, "--stdin"], stdin: a.passcode + "\n").code, 0)
        XCTAssertFalse(FileManager.default.fileExists(atPath: a.store + "/devices/\(idN).grant"))
        let ok = approve(idN, ["--code", code, "--stdin"], stdin: a.passcode + "\n")
        XCTAssertEqual(ok.code, 0, ok.stderr)
        let confirmation =
            ok.stdout.range(of: "confirmation code: ").map { String(ok.stdout[$0.upperBound...].prefix(6)) } ?? ""
        XCTAssertEqual(confirmation.count, 6, ok.stdout)
        carry(idN, "grant", from: a, to: n)
        // The newcomer takes the grant only with the code the approver showed once it approved:
        // not its own pairing code, not another.
        for bad in [code, wrongCode] {
            XCTAssertNotEqual(newcomer(["--code", bad, "--stdin"], stdin: n.passcode + "\n").code, 0, bad)
        }
        let done = newcomer(["--code", confirmation, "--stdin"], stdin: n.passcode + "\n")
        XCTAssertEqual(done.code, 0, done.stderr)
        XCTAssertFalse(done.stdout.contains(n.passcode) || done.stderr.contains(n.passcode))

        // N reads every class A wrote, writes its own, and A reads those.
        try n.mount()
        n.unlock()
        for cls in Self.classes {
            XCTAssertEqual(try? readFile(n.path("by-a-\(cls)")).get(), bytes("by-a \(cls)"), cls)
        }
        writeEveryClass(n, "by-n")
        n.unmount()
        XCTAssertEqual(n.fsck().code, 0, "\(n.fsck().out)")
        mirror("data", from: n, to: a)
        for kind in ["identity", "keybag"] { carry(idN, kind, from: n, to: a) }
        XCTAssertEqual(approve(idN).code, 0, "the approver cleans up its pairing files")
        XCTAssertFalse(FileManager.default.fileExists(atPath: a.store + "/devices/\(idN).grant"))
        try a.mount()
        a.unlock()
        for cls in Self.classes {
            XCTAssertEqual(try? readFile(a.path("by-n-\(cls)")).get(), bytes("by-n \(cls)"), cls)
        }
        let trusted = (a.status()["refusedRecords"] as? [String]) ?? ["?"]
        XCTAssertEqual(trusted, [], "A trusts the device it approved")
        a.unmount()
    }

    /// A store writer who swaps the newcomer's request for one with its own keys: the approver
    /// shows no code the newcomer shows, so nothing is approved.
    func testASwappedPairingRequestGivesAnotherCodeAndIsNotApproved() throws {
        let (a, b, c, _) = try threeDevices()
        defer { [a, b, c].forEach { $0.close() } }
        let n = try MountFixture(replicaOf: a, passcode: "host-n passcode")
        let m = try MountFixture(replicaOf: a, passcode: "mallory passcode")  // the writer's own machine
        defer { n.close(); m.close() }
        for x in [n, m] {
            XCTAssertEqual(
                keybagfs(
                    [
                        "device", "add", x.store, "--device-key", x.deviceKey, "--approval", "--kdf", "interactive",
                        "--stdin",
                    ], stdin: x.passcode + "\n"
                ).code, 0)
        }
        let idN = id(n), idM = id(m)
        // The writer puts its request under N's name (its keys, its commitment) into A's replica.
        var forged =
            try JSONSerialization.jsonObject(
                with: Data(contentsOf: URL(fileURLWithPath: m.store + "/devices/\(idM).request")))
            as! [String: Any]
        forged["deviceID"] = idN
        try JSONSerialization.data(withJSONObject: forged).write(
            to: URL(fileURLWithPath: a.store + "/devices/\(idN).request"))
        XCTAssertEqual(
            keybagfs(["device", "approve", a.store, idN, "--device-key", a.deviceKey]).code, 0)
        carry(idN, "challenge", from: a, to: n)
        let shown = keybagfs(["device", "add", n.store, "--device-key", n.deviceKey, "--approval"])
        let code = pairingCode(shown.stdout)
        XCTAssertEqual(code.count, 0, "N's request is not the one A answered: no code yet: \(shown.stdout)")
        // Even the writer's own reveal, under N's name, gives a code N never shows.
        let challenge = try Data(contentsOf: URL(fileURLWithPath: a.store + "/devices/\(idN).challenge"))
        try challenge.write(to: URL(fileURLWithPath: m.store + "/devices/\(idM).challenge"))
        _ = keybagfs(["device", "add", m.store, "--device-key", m.deviceKey, "--approval"])
        XCTAssertFalse(FileManager.default.fileExists(atPath: m.store + "/devices/\(idM).reveal"), "challenge names N")
        XCTAssertFalse(FileManager.default.fileExists(atPath: a.store + "/devices/\(idN).grant"))
    }
}
