import Foundation
import Glibc
import XCTest

/// Two hosts, each with its own store replica, device key, passcode and keybagfs mount,
/// synced by two real Syncthing instances in a network namespace with no route out
/// (`SyncthingGroup`). What a user with a laptop and a desktop would check.
final class SyncthingTests: XCTestCase {
    private func keybagfs(_ args: [String], stdin: String? = nil) -> ToolResult {
        MountFixture.run(MountFixture.binDir + "/keybagfs", args, stdin: stdin)
    }

    /// Every entry under `root` (a mount): relative path → kind, and a hash of the content
    /// for files; nil for a file that does not read.
    private func tree(_ root: String) -> [String: String] {
        var out: [String: String] = [:]
        guard let e = FileManager.default.enumerator(atPath: root) else { return out }
        while let rel = e.nextObject() as? String {
            var st = stat()
            guard lstat(root + "/" + rel, &st) == 0 else { out[rel] = "vanished"; continue }
            if st.st_mode & S_IFMT == S_IFDIR { out[rel] = "dir"; continue }
            switch readFile(root + "/" + rel) {
            case .success(let b):
                var h: UInt64 = 0xcbf2_9ce4_8422_2325
                for x in b { h = (h ^ UInt64(x)) &* 0x100_0000_01b3 }
                out[rel] = "file \(b.count) \(String(h, radix: 16))"
            case .failure(let e): out[rel] = "error \(e.rawValue)"
            }
        }
        return out
    }

    /// What a failure message needs: both stores' backing trees and both daemons' and
    /// Syncthing's last log lines.
    private func diagnosis(_ mounts: [MountFixture], _ sync: SyncthingGroup) -> String {
        var out = sync.logs(lines: 15)
        for m in mounts {
            out +=
                "\n--- store \(m.store):\n"
                + MountFixture.run("/usr/bin/find", [m.store + "/data", "-printf", "%P %s %y %i %TT\\n"]).stdout
            // Each backing file's class byte (from the slot in use): what the engine delivered.
            for rel in (FileManager.default.enumerator(atPath: m.store + "/data")?.allObjects as? [String]) ?? [] {
                guard let d = FileManager.default.contents(atPath: m.store + "/data/" + rel), d.count >= 320 else {
                    continue
                }
                let b = [UInt8](d)
                out += "class of \(rel): \(b[0] == 0x4b ? b[8] : b[168])\n"
            }
            out +=
                "mount: "
                + tree(m.mnt).map { "\($0.key)=\((try? getXattr(m.mnt + "/" + $0.key).get()) ?? "-")" }.joined(
                    separator: " ") + "\n"
            let log = (try? String(contentsOfFile: m.root + "/daemon.log", encoding: .utf8)) ?? ""
            out += "--- daemon \(m.root):\n" + log.split(separator: "\n").suffix(15).joined(separator: "\n")
        }
        return out
    }

    /// The readable contents of the entries of `dir` whose names start with `stem`.
    private func versions(_ dir: String, _ stem: String) -> Set<[UInt8]> {
        let names = (try? FileManager.default.contentsOfDirectory(atPath: dir)) ?? []
        return Set(names.filter { $0.hasPrefix(stem) }.compactMap { try? readFile(dir + "/" + $0).get() })
    }

    /// A minute of mixed operations, alternating between the two mounts, each in its own folder.
    private func mixedWrites(_ mounts: [MountFixture], seconds: Double) {
        var rng = SeededBytes(seed: 0x5eed_25)
        var files: [[String]] = [[], []]
        for (i, m) in mounts.enumerated() { mkdir(m.path("mix-\(i)"), 0o755) }
        let end = Date().addingTimeInterval(seconds)
        var n = 0
        while Date() < end {
            let i = n % 2, m = mounts[i], dir = m.path("mix-\(i)")
            n += 1
            switch files[i].isEmpty ? 0 : rng.int(0..<6) {
            case 0, 1:
                let name = "f\(n).bin"
                XCTAssertEqual(writeFile(dir + "/" + name, rng.bytes(rng.int(0..<150_000))), 0)
                files[i].append(name)
            case 2:
                let name = files[i][rng.int(0..<files[i].count)]
                XCTAssertEqual(writeFile(dir + "/" + name, rng.bytes(rng.int(0..<80_000))), 0, "overwrite")
            case 3:
                let k = rng.int(0..<files[i].count), to = "r\(n).bin"
                XCTAssertEqual(rename(dir + "/" + files[i][k], dir + "/" + to), 0)
                files[i][k] = to
            case 4:
                let k = rng.int(0..<files[i].count)
                XCTAssertEqual(unlink(dir + "/" + files[i].remove(at: k)), 0)
            default:
                let sub = "d\(n)"
                XCTAssertEqual(mkdir(dir + "/" + sub, 0o755), 0)
                let name = sub + "/inner.txt"
                XCTAssertEqual(writeFile(dir + "/" + name, bytes("inside \(sub)")), 0)
                files[i].append(name)
            }
            usleep(UInt32(rng.int(30_000..<150_000)))
        }
    }

    func testTwoHostsSyncedBySyncthingKeepTheirOwnLocksAndConverge() throws {
        let a = try MountFixture(passcode: "host A passcode", mount: false)
        defer { a.close() }
        let b = try MountFixture(replicaOf: a, passcode: "host B passcode", copy: false)
        defer { b.close() }
        let rk = a.root + "/recovery.txt"
        XCTAssertEqual(
            keybagfs(
                [
                    "recovery-key", "rotate", a.store, "--device-key", a.deviceKey, "--passcode-stdin",
                    "--recovery-key-file", rk,
                ], stdin: a.passcode + "\n"
            ).code, 0)
        let sync = try SyncthingGroup(root: a.root, folders: [a.store, b.store])
        defer { sync.close() }
        XCTAssertEqual(
            sync.routes().trimmingCharacters(in: .whitespacesAndNewlines), "", "the namespace has no route out")
        try sync.start(0)
        try sync.start(1)

        // Host B receives the store, then joins as a device of its own.
        XCTAssertTrue(
            waitUntil(90) {
                FileManager.default.fileExists(atPath: b.store + "/keybag")
                    && FileManager.default.fileExists(atPath: b.store + "/data")
            }, "the store reached host B")
        let add = keybagfs(
            [
                "device", "add", b.store, "--device-key", b.deviceKey, "--recovery-key-file", rk, "--stdin", "--kdf",
                "interactive", "--name", "host-b",
            ], stdin: b.passcode + "\n")
        XCTAssertEqual(add.code, 0, add.stderr)
        let idB = keybagfs(["device", "id", b.store, "--device-key", b.deviceKey]).stdout.trimmingCharacters(
            in: .whitespacesAndNewlines)
        XCTAssertTrue(
            waitUntil(60) { FileManager.default.fileExists(atPath: a.store + "/devices/\(idB).keybag") },
            "B's keybag reached host A")
        try a.mount()
        a.unlock()
        try b.mount()
        b.unlock()

        // Write on A; the file appears on B, byte-exact.
        var rng = SeededBytes(seed: 2511)
        let report = rng.bytes(200_000), secret = bytes("class A on host A")
        XCTAssertEqual(mkdir(a.path("docs"), 0o755), 0)
        XCTAssertEqual(writeFile(a.path("docs/report.txt"), report), 0)
        XCTAssertEqual(writeFile(a.path("secret.txt"), secret), 0)
        XCTAssertEqual(setXattr(a.path("secret.txt"), "complete"), 0)
        XCTAssertTrue(
            waitUntil(60) { (try? readFile(b.path("docs/report.txt")).get()) == report },
            "report.txt on B: \(diagnosis([a, b], sync))")
        XCTAssertTrue(
            waitUntil(60) {
                (try? getXattr(b.path("secret.txt")).get()) == "complete"
                    && (try? readFile(b.path("secret.txt")).get()) == secret
            }, "secret.txt on B, class A")

        // Change the class on A; the class shows on B.
        XCTAssertEqual(setXattr(a.path("docs/report.txt"), "completeUnlessOpen"), 0)
        XCTAssertTrue(
            waitUntil(60) { (try? getXattr(b.path("docs/report.txt")).get()) == "completeUnlessOpen" },
            "class change on B: \(diagnosis([a, b], sync))")
        XCTAssertEqual(try readFile(b.path("docs/report.txt")).get(), report)

        // Lock A: B still reads its complete files, A does not.
        a.lock()
        XCTAssertEqual(errnoOf(readFile(a.path("secret.txt"))), EACCES)
        XCTAssertEqual(try readFile(b.path("secret.txt")).get(), secret, "A's lock leaves B alone")
        // A class B file created while A is locked syncs to B and reads there after B's unlock.
        XCTAssertEqual(mkdir(a.path("inbox"), 0o755), 0)
        XCTAssertEqual(setXattr(a.path("inbox"), "completeUnlessOpen"), 0)
        let mail = bytes("arrived while host A was locked")
        XCTAssertEqual(writeFile(a.path("inbox/mail.eml"), mail), 0)
        b.lock()
        XCTAssertTrue(
            waitUntil(60) { FileManager.default.fileExists(atPath: b.path("inbox/mail.eml")) },
            "mail.eml on B: \(diagnosis([a, b], sync))")
        XCTAssertEqual(errnoOf(readFile(b.path("inbox/mail.eml"))), EACCES, "B is locked")
        b.unlock()
        XCTAssertEqual(try readFile(b.path("inbox/mail.eml")).get(), mail)
        a.unlock()

        // Edit the same file on both while the link is cut; after it heals both versions read on both.
        sync.stop(1)
        let fromA = bytes("edited on host A while apart"), fromB = bytes("edited on host B while apart, later")
        XCTAssertEqual(writeFile(a.path("docs/report.txt"), fromA), 0)
        sleep(1)
        XCTAssertEqual(writeFile(b.path("docs/report.txt"), fromB), 0)
        // The same folder made on both while apart: two name IVs, one of them kept by
        // Syncthing as a conflict copy of the folder's metadata; no name may go missing.
        let noteA = bytes("note made on A"), noteB = bytes("note made on B")
        for (m, own, note) in [(a, "from-a.txt", noteA), (b, "from-b.txt", noteB)] {
            XCTAssertEqual(mkdir(m.path("shared"), 0o755), 0)
            XCTAssertEqual(writeFile(m.path("shared/" + own), note), 0)
            XCTAssertEqual(writeFile(m.path("shared/note.txt"), note), 0)
        }
        try sync.start(1)
        for m in [a, b] {
            XCTAssertTrue(
                waitUntil(90) { versions(m.path("docs"), "report") == [fromA, fromB] },
                "both versions on \(m.root): \((try? FileManager.default.contentsOfDirectory(atPath: m.path("docs"))) ?? [])"
            )
            XCTAssertTrue(
                waitUntil(90) {
                    (try? readFile(m.path("shared/from-a.txt")).get()) == noteA
                        && (try? readFile(m.path("shared/from-b.txt")).get()) == noteB
                        && versions(m.path("shared"), "note") == [noteA, noteB]
                },
                "both folders' names on \(m.root): \((try? FileManager.default.contentsOfDirectory(atPath: m.path("shared"))) ?? []) \(diagnosis([a, b], sync))"
            )
        }
        // The conflict copy's id is the short id of the device whose change won (the version
        // still under the file's name), as docs/DEVICES.md says: Syncthing names the copy after the
        // change it lost to, so on that device's own mount the copy carries its own id.
        let winner = (try? readFile(a.path("docs/report.txt")).get()) == fromB ? 1 : 0
        for m in [a, b] {
            let copies = ((try? FileManager.default.contentsOfDirectory(atPath: m.path("docs"))) ?? []).filter {
                $0.hasPrefix("report (conflict ")
            }
            XCTAssertEqual(copies.count, 1, "one conflict copy on \(m.root): \(copies)")
            XCTAssertTrue(
                copies.first?.hasSuffix(" \(sync.peers[winner].id.prefix(7))).txt") == true,
                "the copy names the winning device \(sync.peers[winner].id.prefix(7)): \(copies)")
        }
        XCTAssertEqual(
            Set((try? FileManager.default.contentsOfDirectory(atPath: a.path("shared"))) ?? ["a"]),
            Set((try? FileManager.default.contentsOfDirectory(atPath: b.path("shared"))) ?? ["b"]),
            "the same names on both")
        let sharedBacking = (try? FileManager.default.contentsOfDirectory(atPath: a.backing("shared"))) ?? []
        XCTAssertTrue(
            sharedBacking.contains { MetadataCopyName.matches($0) },
            "Syncthing kept the losing folder metadata as a conflict copy: \(sharedBacking)")

        // A minute of mixed writes: both mounts end with identical trees.
        mixedWrites([a, b], seconds: 60)
        var last: ([String: String], [String: String]) = ([:], [:])
        let converged = waitUntil(120) {
            last = (tree(a.mnt), tree(b.mnt))
            return last.0 == last.1 && !last.0.values.contains { !$0.hasPrefix("file") && $0 != "dir" }
        }
        XCTAssertTrue(
            converged,
            "trees differ: \(last.0.filter { last.1[$0.key] != $0.value }) vs \(last.1.filter { last.0[$0.key] != $0.value })"
        )
        // fsck is clean on both (the mounts stop for it; Syncthing keeps running).
        a.unmount()
        b.unmount()
        for m in [a, b] {
            let f = m.fsck()
            XCTAssertEqual(f.code, 0, "fsck \(m.root): \(f.out)")
        }

        // Remove device B on A: a file written afterwards on A cannot be opened on B, whose
        // daemon (as a thief's would) keeps the keybag it read at start.
        try b.mount()
        b.unlock()
        let rm = keybagfs(
            ["device", "remove", a.store, idB, "--device-key", a.deviceKey, "--recovery-key-file", rk, "--stdin"],
            stdin: a.passcode + "\n")
        XCTAssertEqual(rm.code, 0, rm.stderr)
        try a.mount()
        a.unlock()
        let after = bytes("written on A after B was removed")
        XCTAssertEqual(writeFile(a.path("docs/after.txt"), after), 0)
        XCTAssertTrue(
            waitUntil(60) { FileManager.default.fileExists(atPath: b.path("docs/after.txt")) }, "after.txt reached B")
        XCTAssertEqual(
            errnoOf(readFile(b.path("docs/after.txt"))), EACCES, "B cannot open a file written after its removal")
        XCTAssertEqual(
            try readFile(b.path("secret.txt")).get(), secret, "what B could read before stays readable to it")
        XCTAssertEqual(try readFile(a.path("docs/after.txt")).get(), after)
        // B's own daemon, started again with the removal synced, refuses to mount.
        b.unmount()
        XCTAssertTrue(waitUntil(60) { FileManager.default.fileExists(atPath: b.store + "/devices/\(idB).removed") })
        XCTAssertThrowsError(try b.mount(), "a removed device is told so")
    }
}

/// Syncthing's name for its copy of a folder's `.kbfs-dir`: `.sync-conflict-YYYYMMDD-HHMMSS-DEVICE.kbfs-dir`.
enum MetadataCopyName {
    static func matches(_ name: String) -> Bool {
        name.range(of: #"^\.sync-conflict-[0-9]{8}-[0-9]{6}-[A-Z2-7]{7}\.kbfs-dir$"#, options: .regularExpression)
            != nil
    }
}
