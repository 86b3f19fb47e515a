import CSodium
import CTPM
import Foundation
import Glibc
import XCTest

/// The passcode bound to a TPM 2.0 (Debian's swtpm on loopback, one per test): the TPM's own
/// lockout counts every wrong passcode and throttles; the store and device key elsewhere open
/// nothing; `recover` enrolls another TPM; an older keybag is refused; nothing the TPM gave is
/// in the daemon's memory after a lock. What the TPM says is read with tpm2-tools.
final class TPMTests: XCTestCase {
    private func keybagfs(_ args: [String], stdin: String? = nil, state: String? = nil) -> ToolResult {
        MountFixture.run(
            MountFixture.binDir + "/keybagfs", args, stdin: stdin,
            environment: state.map { ["STATE_DIRECTORY": $0] } ?? [:])
    }

    /// This device's TPM enrollment file: `STATE/DEVICEID.tpm2` (the fixtures' STATE is
    /// /tmp/kbfs-test-state unless a test gives a machine its own).
    private func enrollment(_ m: MountFixture, state: String = "/tmp/kbfs-test-state") -> String {
        let id = keybagfs(["device", "id", m.store, "--device-key", m.deviceKey]).stdout.trimmingCharacters(
            in: .whitespacesAndNewlines)
        return state + "/" + id + ".tpm2"
    }

    /// A store whose passcode is bound to `tpm`, with its recovery key in `root/recovery.txt`; not mounted.
    private func storeOnTPM(_ tpm: Swtpm, root: String? = nil) throws -> MountFixture {
        let m = try MountFixture(
            initArgs: ["--tpm2", "on", "--tpm2-device", tpm.tcti, "--no-recovery-key"], mount: false)
        let rk = m.root + "/recovery.txt"
        let r = keybagfs(
            [
                "recovery-key", "rotate", m.store, "--device-key", m.deviceKey, "--passcode-stdin",
                "--recovery-key-file", rk,
            ],
            stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 0, "recovery-key rotate with the TPM: \(r.stderr)")
        return m
    }

    /// The `tpm2` object of the daemon's status.
    private func tpmStatus(_ m: MountFixture) -> [String: Any] { m.status()["tpm2"] as? [String: Any] ?? [:] }

    func testEveryWrongPasscodeCountsInTheTPMWhichThenThrottlesAcrossRestartsAndRollbacks() throws {
        let tpm = try Swtpm(root: try MountFixture.makeRoot(), maxTries: 3, recoveryTime: 600)
        addTeardownBlock {
            tpm.stop(); try? FileManager.default.removeItem(atPath: (tpm.state as NSString).deletingLastPathComponent)
        }
        let m = try storeOnTPM(tpm)
        addTeardownBlock { m.close() }
        XCTAssertTrue(
            FileManager.default.fileExists(atPath: enrollment(m)), "the enrollment lies in the device's state folder")
        XCTAssertFalse(
            try String(contentsOfFile: m.store + "/keybag", encoding: .utf8).contains("publicBlob"),
            "and not in the store")
        try m.mount()
        XCTAssertEqual(tpmStatus(m)["inUse"] as? Bool, true)
        XCTAssertEqual(tpmStatus(m)["maxTries"] as? Int, 3)
        XCTAssertEqual(tpmStatus(m)["recoveryTime"] as? Int, 600)
        m.unlock()
        XCTAssertEqual(writeFile(m.path("notes.txt"), bytes("bound to this TPM")), 0)
        m.lock()
        m.unmount()
        let beforeFailures = try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))
        try m.mount()
        XCTAssertEqual(tpm.lockoutCounter, 0)
        // Each wrong passcode is one more failure in the TPM's own counter.
        for n in 1...2 {
            let r = m.ctl(["unlock", "--passcode-stdin"], stdin: "wrong \(n)\n")
            XCTAssertEqual(r.code, 1)
            XCTAssertTrue(r.stderr.contains("wrong passcode"), r.stderr)
            XCTAssertEqual(tpm.lockoutCounter, n, "the TPM counted wrong passcode \(n)")
        }
        m.unlock()
        XCTAssertEqual(try readFile(m.path("notes.txt")).get(), bytes("bound to this TPM"))
        m.lock()
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: "wrong 3\n").code, 1)
        XCTAssertEqual(tpm.lockoutCounter, 3)
        // At the TPM's limit the right passcode is refused too, with the TPM's retry time.
        func rightIsThrottled(_ when: String) {
            let r = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
            XCTAssertEqual(r.code, 1, "\(when): unlocked in TPM lockout")
            XCTAssertTrue(
                r.stderr.contains("throttled") && r.stderr.contains("TPM") && r.stderr.contains("600"),
                "\(when): \(r.stderr)")
            XCTAssertNotEqual(m.state, "unlocked", when)
        }
        rightIsThrottled("in lockout")
        XCTAssertEqual(tpmStatus(m)["inLockout"] as? Bool, true)
        XCTAssertEqual(tpmStatus(m)["lockoutCounter"] as? Int, 3)
        try m.restart()
        rightIsThrottled("after a daemon restart")
        // A keybag put back from before the failures is refused (the TPM's NV counter), and
        // the TPM's lockout holds whatever the keybag says.
        m.unmount()
        let current = try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))
        try beforeFailures.write(to: URL(fileURLWithPath: m.store + "/keybag"))
        let rolled = keybagfs(["mount", m.store, m.mnt, "--socket", m.socket, "--device-key", m.deviceKey])
        XCTAssertEqual(rolled.code, 1, "an older keybag mounted: \(rolled.stderr)")
        XCTAssertTrue(rolled.stderr.contains("older than the one this device last wrote"), rolled.stderr)
        XCTAssertFalse(m.isMounted)
        XCTAssertEqual(
            try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag")), beforeFailures, "nothing written")
        try current.write(to: URL(fileURLWithPath: m.store + "/keybag"))
        try m.mount()
        rightIsThrottled("with the newest keybag back")
        XCTAssertEqual(tpm.lockoutCounter, 3, "no try was made in lockout")
        // The owner's way out: keybagfs set the TPM's lockout authorization, which only the
        // recovery key opens (TPMLockoutTests tries the way without it).
        m.unmount()
        let clear = keybagfs(
            [
                "tpm2", "clear-lockout", m.store, "--device-key", m.deviceKey, "--recovery-key-file",
                m.root + "/recovery.txt",
            ])
        XCTAssertEqual(clear.code, 0, clear.stderr)
        XCTAssertEqual(tpm.lockoutCounter, 0)
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("notes.txt")).get(), bytes("bound to this TPM"))
    }

    func testTheStoreAndDeviceKeyOnAnotherMachineOpenNothingUntilRecoverEnrollsItsTPM() throws {
        let base = try MountFixture.makeRoot()
        let tpmA = try Swtpm(root: base, name: "tpm-a"), tpmB = try Swtpm(root: base, name: "tpm-b")
        addTeardownBlock {
            tpmA.stop(); tpmB.stop(); try? FileManager.default.removeItem(atPath: base)
        }
        let a = try storeOnTPM(tpmA)
        addTeardownBlock { a.close() }
        try a.mount()
        a.unlock()
        XCTAssertEqual(writeFile(a.path("c.txt"), bytes("class C, bound to TPM A")), 0)
        XCTAssertEqual(writeFile(a.path("a.txt"), bytes("class A, bound to TPM A")), 0)
        XCTAssertEqual(setXattr(a.path("a.txt"), "complete"), 0)
        a.unmount()
        // Machine B (its own state folder): a copy of the store, the device key and even the enrollment file.
        let b = try MountFixture(replicaOf: a, passcode: a.passcode)
        addTeardownBlock { b.close() }
        let stateB = b.root + "/state"
        XCTAssertEqual(MountFixture.run("/bin/cp", [a.deviceKey, b.deviceKey]).code, 0)
        func mountB() -> ToolResult {
            keybagfs(
                [
                    "mount", b.store, b.mnt, "--socket", b.socket, "--device-key", b.deviceKey, "--tpm2-device",
                    tpmB.tcti,
                ], state: stateB)
        }
        let bare = mountB()
        XCTAssertEqual(bare.code, 1, "mounted without any enrollment")
        XCTAssertTrue(bare.stderr.contains("keybagfs recover"), "names the way out: \(bare.stderr)")
        XCTAssertEqual(mkdir(stateB, 0o700), 0)
        XCTAssertEqual(MountFixture.run("/bin/cp", [enrollment(a), enrollment(b, state: stateB)]).code, 0)
        let keybagBefore = try Data(contentsOf: URL(fileURLWithPath: b.store + "/keybag"))
        let other = mountB()
        XCTAssertEqual(other.code, 1, "mounted on another TPM")
        XCTAssertTrue(
            other.stderr.contains("keybagfs recover") && other.stderr.contains("cleared or replaced"), other.stderr)
        XCTAssertEqual(other.stderr.split(separator: "\n").count, 1, "one line: \(other.stderr)")
        XCTAssertFalse(b.isMounted)
        XCTAssertEqual(
            try Data(contentsOf: URL(fileURLWithPath: b.store + "/keybag")), keybagBefore, "the store was not written")
        // The offline tools that take the passcode refuse too (fsck with the right passcode).
        let fsck = keybagfs(
            ["fsck", b.store, "--device-key", b.deviceKey, "--passcode-stdin", "--tpm2-device", tpmB.tcti],
            stdin: b.passcode + "\n", state: stateB)
        XCTAssertNotEqual(fsck.code, 0, "fsck opened the class keys without TPM A")
        // The recovery key enrolls TPM B.
        let rk = a.root + "/recovery.txt"
        let newPasscode = "passcode on machine B"
        let rec = keybagfs(
            [
                "recover", b.store, "--device-key", b.deviceKey, "--recovery-key-file", rk, "--stdin", "--tpm2-device",
                tpmB.tcti,
            ],
            stdin: newPasscode + "\n", state: stateB)
        XCTAssertEqual(rec.code, 0, rec.stderr)
        XCTAssertTrue(
            try String(contentsOfFile: enrollment(b, state: stateB), encoding: .utf8).contains("\(tpmB.port)"),
            "enrolled on TPM B")
        XCTAssertTrue(
            try String(contentsOfFile: enrollment(a), encoding: .utf8).contains("\(tpmA.port)"),
            "machine A's own is untouched")
        try b.mount(environment: ["STATE_DIRECTORY": stateB])
        XCTAssertEqual(b.ctl(["unlock", "--passcode-stdin"], stdin: newPasscode + "\n").code, 0)
        XCTAssertEqual(try readFile(b.path("c.txt")).get(), bytes("class C, bound to TPM A"))
        XCTAssertEqual(try readFile(b.path("a.txt")).get(), bytes("class A, bound to TPM A"))
        XCTAssertEqual(tpmStatus(b)["inUse"] as? Bool, true)
        // And `tpm2 remove` takes machine B off its TPM: its NV counter is released.
        b.unmount()
        let before = tpmB.tool("tpm2_getcap", ["handles-nv-index"]).stdout.lowercased()
        XCTAssertTrue(before.contains("0x1c9"), "TPM B holds this device's counter: \(before)")
        let rm = keybagfs(
            ["tpm2", "remove", b.store, "--device-key", b.deviceKey, "--passcode-stdin"], stdin: newPasscode + "\n",
            state: stateB)
        XCTAssertEqual(rm.code, 0, rm.stderr)
        XCTAssertFalse(FileManager.default.fileExists(atPath: enrollment(b, state: stateB)))
        XCTAssertFalse(
            tpmB.tool("tpm2_getcap", ["handles-nv-index"]).stdout.lowercased().contains("0x1c9"),
            "the NV counter is released")
        try b.mount(environment: ["STATE_DIRECTORY": stateB])
        XCTAssertEqual(tpmStatus(b)["inUse"] as? Bool, false)
        XCTAssertEqual(b.ctl(["unlock", "--passcode-stdin"], stdin: newPasscode + "\n").code, 0)
        XCTAssertEqual(try readFile(b.path("a.txt")).get(), bytes("class A, bound to TPM A"))
        b.unmount()
        // `tpm2 enroll` binds it again.
        let en = keybagfs(
            [
                "tpm2", "enroll", b.store, "--device-key", b.deviceKey, "--tpm2-device", tpmB.tcti, "--passcode-stdin",
                "--recovery-key-file", rk,
            ],
            stdin: newPasscode + "\n", state: stateB)
        XCTAssertEqual(en.code, 0, en.stderr)
        try b.mount(environment: ["STATE_DIRECTORY": stateB])
        XCTAssertEqual(tpmStatus(b)["inUse"] as? Bool, true)
        XCTAssertEqual(b.ctl(["unlock", "--passcode-stdin"], stdin: newPasscode + "\n").code, 0)
        // passwd through the daemon seals a new secret for the new salt and drops the old one.
        let third = "third passcode, on TPM B"
        let pw = b.ctl(["passwd", "--passcode-stdin"], stdin: newPasscode + "\n" + third + "\n")
        XCTAssertEqual(pw.code, 0, pw.stderr)
        let objects =
            ((try JSONSerialization.jsonObject(
                with: Data(contentsOf: URL(fileURLWithPath: enrollment(b, state: stateB))))) as? [String: Any])?[
                "objects"] as? [String: Any]
        XCTAssertEqual(objects?.count, 1, "one sealed object after passwd: \(objects?.keys.sorted() ?? [])")
        b.lock()
        XCTAssertEqual(b.ctl(["unlock", "--passcode-stdin"], stdin: newPasscode + "\n").code, 1, "the old passcode")
        XCTAssertEqual(b.ctl(["unlock", "--passcode-stdin"], stdin: third + "\n").code, 0, "the new passcode")
        XCTAssertEqual(try readFile(b.path("a.txt")).get(), bytes("class A, bound to TPM A"))
    }

    /// An offline attacker with the store, the device key and the right passcode, but not the
    /// TPM: derives the passcode key as docs/FORMAT.md says and cannot open class A; with the
    /// secret the TPM releases (unsealed here by hand through tpm2-tss), the same derivation
    /// opens it. Then the daemon's memory after a lock holds neither the secret nor the
    /// authorization value.
    func testWithoutTheTPMTheRightPasscodeOpensNoClassKeyAndTheTPMsSecretsLeaveNoTrace() throws {
        let tpm = try Swtpm(root: try MountFixture.makeRoot(), maxTries: 32)
        addTeardownBlock {
            tpm.stop(); try? FileManager.default.removeItem(atPath: (tpm.state as NSString).deletingLastPathComponent)
        }
        let m = try storeOnTPM(tpm)
        addTeardownBlock { m.close() }
        let kb = try XCTUnwrap(
            JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag")))
                as? [String: Any])
        let storeID = try XCTUnwrap(kb["storeID"] as? String)
        let salt = [UInt8](try XCTUnwrap(Data(base64Encoded: try XCTUnwrap(kb["kdfSalt"] as? String))))
        let wrappedA = [UInt8](
            try XCTUnwrap(Data(base64Encoded: try XCTUnwrap((kb["wrapped"] as? [String: String])?["A"]))))
        let dk = [UInt8](try Data(contentsOf: URL(fileURLWithPath: m.deviceKey)))
        var stretched = [UInt8](repeating: 0, count: 32)
        XCTAssertEqual(
            crypto_pwhash(
                &stretched, 32, m.passcode, UInt64(m.passcode.utf8.count), salt,
                try XCTUnwrap(kb["kdfOpsLimit"] as? UInt64), Int(try XCTUnwrap(kb["kdfMemLimit"] as? UInt64)),
                crypto_pwhash_ALG_ARGON2ID13), 0)
        func blake(key: [UInt8], _ parts: [[UInt8]]) -> [UInt8] {
            var out = [UInt8](repeating: 0, count: 32)
            let msg = parts.flatMap { $0 }
            crypto_generichash(&out, 32, msg, UInt64(msg.count), key, key.count)
            return out
        }
        func opensA(_ kek: [UInt8]) -> Bool {
            var out = [UInt8](repeating: 0, count: 32)
            var n: UInt64 = 0
            let ad = Array("keybagfs-keybag-v1|\(storeID)|A".utf8)
            return crypto_aead_xchacha20poly1305_ietf_decrypt(
                &out, &n, nil, Array(wrappedA[24...]), UInt64(wrappedA.count - 24), ad, UInt64(ad.count), wrappedA, kek)
                == 0
        }
        let id = Array(storeID.utf8)
        XCTAssertFalse(
            opensA(blake(key: dk, [Array("keybagfs-passcode-kek-v1".utf8), id, stretched])),
            "the passcode key without the TPM")
        XCTAssertFalse(
            opensA(
                blake(
                    key: dk,
                    [Array("keybagfs-passcode-kek-tpm-v1".utf8), id, stretched, [UInt8](repeating: 0, count: 32)])),
            "with a guessed secret")
        // With the TPM: the authorization from the Argon2id output releases the secret.
        let auth = blake(key: stretched, [Array("keybagfs-tpm-auth-v1".utf8), id])
        let enrolled = try XCTUnwrap(
            JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: enrollment(m)))) as? [String: Any])
        let object = try XCTUnwrap(
            (enrolled["objects"] as? [String: [String: Any]])?[try XCTUnwrap(kb["kdfSalt"] as? String)])
        let pub = [UInt8](try XCTUnwrap(Data(base64Encoded: try XCTUnwrap(object["publicBlob"] as? String))))
        let priv = [UInt8](try XCTUnwrap(Data(base64Encoded: try XCTUnwrap(object["privateBlob"] as? String))))
        let bound = try XCTUnwrap(object["bound"] as? UInt64), epoch = try XCTUnwrap(enrolled["epochIndex"] as? UInt32)
        let nvAuth = blake(key: dk, [Array("keybagfs-tpm-nv-v1".utf8), id])
        var handle: OpaquePointer?
        var err = [CChar](repeating: 0, count: 256)
        XCTAssertEqual(
            kbfs_tpm_open(tpm.tcti, &handle, &err, err.count), 0,
            String(decoding: err.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self))
        var secret = [UInt8](repeating: 0, count: 64)
        var secretLen = secret.count
        XCTAssertEqual(
            kbfs_tpm_unseal_epoch(
                handle, pub, pub.count, priv, priv.count, auth, auth.count, epoch, nvAuth, nvAuth.count, bound, 0,
                &secret, &secretLen, &err, err.count), 0,
            String(decoding: err.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self))
        kbfs_tpm_close(handle)
        secret = Array(secret[..<secretLen])
        XCTAssertEqual(secret.count, 32)
        XCTAssertTrue(
            opensA(blake(key: dk, [Array("keybagfs-passcode-kek-tpm-v1".utf8), id, stretched, secret])),
            "the FORMAT.md derivation with the TPM's secret")

        // The daemon: unlock, a wrong passcode, passwd, unlock again, lock; then neither the
        // secret, the authorization value, nor the Argon2id output is in its memory.
        try m.mount()
        let pid = pid_t(try XCTUnwrap(m.status()["pid"] as? Int))
        m.unlock()
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: "not it\n").code, 1)
        m.lock()
        m.unlock()
        m.lock()
        XCTAssertEqual(m.state, "locked")
        let pieces: [(String, [UInt8])] = [
            ("TPM secret", secret), ("TPM authorization", auth), ("Argon2id output", stretched),
        ].flatMap { label, v in
            [("\(label) [0..<16]", Array(v[0..<16])), ("\(label) [16..<32]", Array(v[16..<32]))]
        }
        XCTAssertFalse(MemoryScan.find(pid: getpid(), pieces: pieces).isEmpty, "the scanner finds them where they are")
        XCTAssertEqual(MemoryScan.find(pid: pid, pieces: pieces), [], "the TPM's secret and authorization after a lock")
    }

    /// A thief who holds the device key (so can forge every keybag MAC), an older keybag and
    /// its enrollment from before a passcode change, and the machine with its TPM, still
    /// cannot use the old passcode: the old sealed object is bound to an epoch the TPM's
    /// counter has passed, and the TPM refuses it (without counting a failure).
    func testAnOldPasscodeStaysDeadAfterPasswdEvenWithForgedKeybagMACs() throws {
        let tpm = try Swtpm(root: try MountFixture.makeRoot(), maxTries: 32)
        addTeardownBlock {
            tpm.stop(); try? FileManager.default.removeItem(atPath: (tpm.state as NSString).deletingLastPathComponent)
        }
        let m = try storeOnTPM(tpm)
        addTeardownBlock { m.close() }
        try m.mount()
        m.unlock()
        XCTAssertEqual(writeFile(m.path("f"), bytes("secret")), 0)
        let keybagURL = URL(fileURLWithPath: m.store + "/keybag"), enrollmentURL = URL(fileURLWithPath: enrollment(m))
        let oldKeybag = try Data(contentsOf: keybagURL), oldEnrollment = try Data(contentsOf: enrollmentURL)
        let newPasscode = "the new passcode"
        XCTAssertEqual(m.ctl(["passwd", "--passcode-stdin"], stdin: m.passcode + "\n" + newPasscode + "\n").code, 0)
        m.unmount()
        // Put back the old keybag and enrollment, the keybag's generation forged past the TPM's
        // counter with its settings MAC recomputed from the device key (FORMAT.md, "Format 4").
        var kb = try XCTUnwrap(JSONSerialization.jsonObject(with: oldKeybag) as? [String: Any])
        kb["generation"] = 1_000_000
        kb["settingsMAC"] = try settingsMAC(kb, deviceKey: [UInt8](Data(contentsOf: URL(fileURLWithPath: m.deviceKey))))
        try JSONSerialization.data(withJSONObject: kb).write(to: keybagURL)
        try oldEnrollment.write(to: enrollmentURL)
        try m.mount()  // the forged generation passes the rollback check
        let before = tpm.lockoutCounter
        let r = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 1, "the old passcode unlocked a rolled-back keybag")
        XCTAssertTrue(r.stderr.contains("no longer releases"), r.stderr)
        XCTAssertEqual(tpm.lockoutCounter, before, "a stale object is refused before its authorization is checked")
        XCTAssertNotEqual(m.state, "unlocked")
    }

    /// The settings MAC of a keybag's JSON, by hand as docs/FORMAT.md gives it.
    private func settingsMAC(_ kb: [String: Any], deviceKey: [UInt8]) throws -> String {
        var counterKey = [UInt8](repeating: 0, count: 32)
        XCTAssertEqual(crypto_kdf_derive_from_key(&counterKey, 32, 2, "kbfscnt1", deviceKey), 0)
        var msg = Array("keybagfs-settings-v1|".utf8)
        func field(_ name: String, _ value: String?) {
            func put(_ b: [UInt8]) { withUnsafeBytes(of: UInt32(b.count).littleEndian) { msg += $0 }; msg += b }
            put(Array(name.utf8))
            if let value { msg.append(1); put(Array(value.utf8)) } else { msg.append(0) }
        }
        func text(_ k: String) -> String? { kb[k].map { "\($0)" } }
        for k in ["format", "storeID", "kdfOpsLimit", "kdfMemLimit", "kdfSalt", "classBPublic", "keySet"] {
            field(k, text(k))
        }
        field(
            "classBPublics",
            (kb["classBPublics"] as? [String: String]).map {
                $0.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: ",")
            })
        field("deviceID", text("deviceID"))
        field("deviceName", text("deviceName"))
        if kb["tpm2"] != nil || kb["generation"] != nil {
            field("tpm2", (kb["tpm2"] as? Bool).map { $0 ? "1" : "0" })
            field("generation", text("generation"))
        }
        var mac = [UInt8](repeating: 0, count: 32)
        crypto_generichash(&mac, 32, msg, UInt64(msg.count), counterKey, 32)
        return Data(mac).base64EncodedString()
    }
}
