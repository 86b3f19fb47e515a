import Foundation
import Glibc
import XCTest

/// The holes in "the TPM limits guesses" that an attacker outside the product found (issue
/// "Hardware keys II"), each tried as that attacker: clearing the TPM's lockout without its
/// authorization, a boot state that changed under a PCR-bound secret, and a keybag copied
/// before `tpm2 enroll` guessed off the TPM. Debian's swtpm per test; tpm2-tools play the attacker.
final class TPMLockoutTests: XCTestCase {
    private func keybagfs(_ args: [String], stdin: String? = nil, state: String? = nil) -> ToolResult {
        MountFixture.run(
            MountFixture.binDir + "/keybagfs", args, stdin: stdin,
            environment: state.map { ["STATE_DIRECTORY": $0] } ?? [:])
    }

    /// A simulator for one test, stopped and removed in teardown.
    private func swtpm(maxTries: Int = 3, recoveryTime: Int = 1000, lockoutRecovery: Int? = nil) throws -> Swtpm {
        let root = try MountFixture.makeRoot()
        let tpm = try Swtpm(
            root: root, maxTries: maxTries, recoveryTime: recoveryTime, lockoutRecovery: lockoutRecovery)
        addTeardownBlock {
            tpm.stop(); try? FileManager.default.removeItem(atPath: root)
        }
        return tpm
    }

    /// The thief of "no guessable keybag": a copy of `m`'s store with `keybag` put back at `at` (a path
    /// inside the store), `m`'s device key, mounted where none of the device's state is (no TPM
    /// enrollment, no key-set floor), and unlocked with `m`'s passcode (the guess that came out right).
    private func mountAsThief(of m: MountFixture, keybag: Data, at: String = "/keybag") throws -> MountFixture {
        let thief = try MountFixture(replicaOf: m, passcode: m.passcode)
        addTeardownBlock { thief.close() }
        try keybag.write(to: URL(fileURLWithPath: thief.store + at))
        XCTAssertEqual(MountFixture.run("/bin/cp", [m.deviceKey, thief.deviceKey]).code, 0)
        let state = thief.root + "/state"
        XCTAssertEqual(mkdir(state, 0o700), 0)
        try thief.mount(environment: ["STATE_DIRECTORY": state])
        XCTAssertEqual(
            thief.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n").code, 0, "the old keybag opens")
        return thief
    }

    /// The `tpm2` object of the daemon's status.
    private func tpmStatus(_ m: MountFixture) -> [String: Any] { m.status()["tpm2"] as? [String: Any] ?? [:] }

    func testKeybagfsOwnsTheLockoutSoOnlyTheRecoveryKeyClearsIt() throws {
        let tpm = try swtpm(maxTries: 3, recoveryTime: 1000, lockoutRecovery: 2)
        XCTAssertFalse(tpm.lockoutAuthSet, "swtpm starts with an empty lockout authorization")
        let rk = try MountFixture.makeRoot() + "/recovery.txt"
        let m = try MountFixture(
            initArgs: ["--tpm2", "on", "--tpm2-device", tpm.tcti, "--recovery-key-file", rk], mount: false)
        addTeardownBlock { m.close() }
        XCTAssertTrue(tpm.lockoutAuthSet, "init set a lockout authorization")
        try m.mount()
        XCTAssertEqual(tpmStatus(m)["lockoutAuthority"] as? String, "keybagfs")
        for n in 1...3 { XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: "wrong \(n)\n").code, 1) }
        XCTAssertEqual(tpm.lockoutCounter, 3)
        func rightIsThrottled(_ when: String) {
            let r = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
            XCTAssertEqual(r.code, 1, "\(when): unlocked in TPM lockout")
            XCTAssertTrue(r.stderr.contains("throttled"), "\(when): \(r.stderr)")
        }
        rightIsThrottled("in lockout")
        // The attacker with root: the TPM's own tool, without the authorization keybagfs set.
        let clear = tpm.tool("tpm2_dictionarylockout", ["-c"])
        XCTAssertNotEqual(clear.code, 0, "tpm2_dictionarylockout -c cleared the lockout without its authorization")
        XCTAssertEqual(tpm.lockoutCounter, 3, "the counter stays")
        rightIsThrottled("after tpm2_dictionarylockout -c")
        let change = tpm.tool("tpm2_changeauth", ["-c", "lockout", "mine"])
        XCTAssertNotEqual(change.code, 0, "the attacker took over the lockout authorization")
        rightIsThrottled("after tpm2_changeauth -c lockout")
        // The owner: the recovery key clears it (once the TPM takes its lockout authorization
        // again, `lockoutRecovery` seconds after the attacker's wrong ones).
        m.unmount()
        let wrongKey = try MountFixture.makeRoot() + "/wrong.txt"
        let other = keybagfs(
            [
                "init", m.root + "/other", "--passcode-stdin", "--device-key", m.root + "/other.key",
                "--kdf", "interactive", "--tpm2", "off", "--recovery-key-file", wrongKey,
            ], stdin: "x\n")
        XCTAssertEqual(other.code, 0, other.stderr)
        let refused = keybagfs(
            ["tpm2", "clear-lockout", m.store, "--device-key", m.deviceKey, "--recovery-key-file", wrongKey])
        XCTAssertEqual(refused.code, 1, "another store's recovery key cleared the lockout")
        XCTAssertEqual(tpm.lockoutCounter, 3)
        var cleared = ToolResult(code: -1, stdout: "", stderr: "")
        for _ in 0..<20 {
            cleared = keybagfs(
                ["tpm2", "clear-lockout", m.store, "--device-key", m.deviceKey, "--recovery-key-file", rk])
            if cleared.code == 0 || !cleared.stderr.contains("after a wrong one") { break }
            sleep(1)
        }
        XCTAssertEqual(cleared.code, 0, cleared.stderr)
        XCTAssertEqual(tpm.lockoutCounter, 0, "the recovery key cleared the TPM's lockout")
        try m.mount()
        m.unlock()
        XCTAssertEqual(writeFile(m.path("after.txt"), bytes("unlocked again")), 0)
        m.unmount()
        // Taking the device off its TPM gives the machine its empty lockout authorization back; not
        // while the TPM refuses it after a wrong one (the record would be lost): then nothing changes.
        XCTAssertNotEqual(tpm.tool("tpm2_dictionarylockout", ["-c"]).code, 0)
        let early = keybagfs(
            ["tpm2", "remove", m.store, "--device-key", m.deviceKey, "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(early.code, 1, "removed while the TPM refused its lockout authorization")
        XCTAssertTrue(early.stderr.contains("refuses its lockout authorization"), early.stderr)
        XCTAssertTrue(tpm.lockoutAuthSet)
        try m.mount()
        XCTAssertEqual(tpmStatus(m)["lockoutAuthority"] as? String, "keybagfs", "still enrolled")
        m.unmount()
        sleep(3)
        let rm = keybagfs(
            ["tpm2", "remove", m.store, "--device-key", m.deviceKey, "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(rm.code, 0, rm.stderr)
        XCTAssertTrue(
            rm.stdout.contains("guessed off this machine"), "remove says the keybag is guessable: \(rm.stdout)")
        XCTAssertFalse(tpm.lockoutAuthSet, "the lockout authorization keybagfs set is empty again")
    }

    func testAnAuthorizationSetByAnotherToolIsRefusedUnlessGivenOrAccepted() throws {
        let tpm = try swtpm()
        XCTAssertEqual(tpm.tool("tpm2_changeauth", ["-c", "lockout", "admin-secret"]).code, 0)
        let root = try MountFixture.makeRoot()
        func initStore(_ name: String, _ extra: [String]) -> ToolResult {
            keybagfs(
                [
                    "init", root + "/" + name, "--passcode-stdin", "--device-key", root + "/" + name + ".key", "--kdf",
                    "interactive", "--no-recovery-key", "--tpm2", "on", "--tpm2-device", tpm.tcti,
                ] + extra,
                stdin: "p\n")
        }
        let refused = initStore("a", [])
        XCTAssertEqual(refused.code, 1)
        XCTAssertTrue(
            refused.stderr.contains("--tpm2-lockout-auth-file")
                && refused.stderr.contains("--tpm2-accept-clearable-lockout"),
            "says what to do: \(refused.stderr)")
        XCTAssertEqual(refused.stderr.split(separator: "\n").count, 1, refused.stderr)
        let file = root + "/lockout.txt"
        try "wrong-secret\n".write(toFile: file, atomically: true, encoding: .utf8)
        XCTAssertEqual(initStore("b", ["--tpm2-lockout-auth-file", file]).code, 1, "a wrong authorization was kept")
        try "admin-secret\n".write(toFile: file, atomically: true, encoding: .utf8)
        // The wrong one above locks the lockout authorization for lockoutRecovery (1000 s): accepted instead.
        let accepted = initStore("c", ["--tpm2-accept-clearable-lockout"])
        XCTAssertEqual(accepted.code, 0, accepted.stderr)
        XCTAssertTrue(accepted.stdout.contains("clearable"), accepted.stdout)
    }

    func testAPCRBoundSecretRefusesOnceTheBootStateChangesAndRecoverReEnrolls() throws {
        let tpm = try swtpm(maxTries: 5)
        let rk = try MountFixture.makeRoot() + "/recovery.txt"
        let m = try MountFixture(
            initArgs: ["--tpm2", "on", "--tpm2-device", tpm.tcti, "--tpm2-pcrs", "7", "--recovery-key-file", rk],
            mount: false)
        addTeardownBlock { m.close() }
        try m.mount()
        XCTAssertEqual(tpmStatus(m)["pcrs"] as? [Int], [7])
        m.unlock()
        XCTAssertEqual(writeFile(m.path("a.txt"), bytes("class A under PCR 7")), 0)
        XCTAssertEqual(setXattr(m.path("a.txt"), "complete"), 0)
        m.lock()
        // Unrelated PCRs do not matter; PCR 7 (the Secure Boot policy) does.
        XCTAssertEqual(tpm.tool("tpm2_pcrextend", ["8:sha256=" + String(repeating: "11", count: 32)]).code, 0)
        m.unlock()
        m.lock()
        XCTAssertEqual(tpm.tool("tpm2_pcrextend", ["7:sha256=" + String(repeating: "22", count: 32)]).code, 0)
        let r = m.ctl(["unlock", "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(r.code, 1, "unlocked in another boot state")
        XCTAssertTrue(r.stderr.contains("boot state") && r.stderr.contains("keybagfs recover"), r.stderr)
        XCTAssertEqual(r.stderr.split(separator: "\n").count, 1, "one line: \(r.stderr)")
        XCTAssertEqual(tpm.lockoutCounter, 0, "the right passcode in another boot state is not a failure")
        XCTAssertNotEqual(m.state, "unlocked")
        m.unmount()
        let newPasscode = "after the firmware update"
        let rec = keybagfs(
            [
                "recover", m.store, "--device-key", m.deviceKey, "--recovery-key-file", rk, "--stdin", "--tpm2-device",
                tpm.tcti,
            ], stdin: newPasscode + "\n")
        XCTAssertEqual(rec.code, 0, rec.stderr)
        try m.mount()
        XCTAssertEqual(tpmStatus(m)["pcrs"] as? [Int], [7], "re-enrolled with the same PCRs")
        XCTAssertEqual(tpmStatus(m)["lockoutAuthority"] as? String, "keybagfs", "and the same lockout authorization")
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: newPasscode + "\n").code, 0)
        XCTAssertEqual(try readFile(m.path("a.txt")).get(), bytes("class A under PCR 7"))
    }

    func testAKeybagCopiedBeforeEnrollmentOpensNothingWrittenOrRewrappedSince() throws {
        let tpm = try swtpm(maxTries: 5)
        let rk = try MountFixture.makeRoot() + "/recovery.txt"
        let m = try MountFixture(initArgs: ["--tpm2", "off", "--recovery-key-file", rk], mount: false)
        addTeardownBlock { m.close() }
        let classes = ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"]
        try m.mount()
        m.unlock()
        XCTAssertEqual(mkdir(m.path("dir"), 0o755), 0)
        for c in classes {
            XCTAssertEqual(writeFile(m.path("dir/old-\(c)"), bytes("before enrollment, \(c)")), 0)
            XCTAssertEqual(setXattr(m.path("dir/old-\(c)"), c), 0)
        }
        XCTAssertEqual(link(m.path("dir/old-complete"), m.path("old-link")), 0)
        m.unmount()
        // The thief's copy: the keybag as it was before enrollment (a backup, a sync engine's version).
        let oldKeybag = try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))
        let en = keybagfs(
            [
                "tpm2", "enroll", m.store, "--device-key", m.deviceKey, "--tpm2-device", tpm.tcti, "--passcode-stdin",
                "--recovery-key-file", rk,
            ], stdin: m.passcode + "\n")
        XCTAssertEqual(en.code, 0, en.stderr)
        XCTAssertTrue(en.stdout.contains("files rewrapped for it: 4"), en.stdout)
        try m.mount()
        m.unlock()
        for c in classes {
            XCTAssertEqual(try readFile(m.path("dir/old-\(c)")).get(), bytes("before enrollment, \(c)"))
            XCTAssertEqual(writeFile(m.path("dir/new-\(c)"), bytes("after enrollment, \(c)")), 0)
            XCTAssertEqual(setXattr(m.path("dir/new-\(c)"), c), 0)
        }
        m.unmount()
        // A second run finds every file on the new set.
        let again = keybagfs(
            ["rewrap", m.store, "--device-key", m.deviceKey, "--passcode-stdin"], stdin: m.passcode + "\n")
        XCTAssertEqual(again.code, 0, again.stderr)
        XCTAssertTrue(again.stdout.contains("rewrapped 0 files"), again.stdout)
        // The thief: today's store with the old keybag, on a machine with no state of this device,
        // guessed right (the old keybag needs no TPM): it unlocks, and opens no file.
        let thief = try mountAsThief(of: m, keybag: oldKeybag)
        XCTAssertEqual(
            (try? FileManager.default.contentsOfDirectory(atPath: thief.path("dir")))?.count, 8, "names stay readable")
        for c in classes where c != "none" {
            for name in ["old-\(c)", "new-\(c)"] {
                guard case .failure = readFile(thief.path("dir/" + name)) else {
                    XCTFail("the keybag from before enrollment opens \(name)"); continue
                }
            }
        }
        guard case .failure = readFile(thief.path("old-link")) else { return XCTFail("opens the hard link") }
    }

    func testADeviceAddedWithItsTPMHasNoGuessableKeybagAndOneEnrolledLaterStartsANewKeySet() throws {
        let tpm = try swtpm(maxTries: 5)
        let rk = try MountFixture.makeRoot() + "/recovery.txt"
        let a = try MountFixture(initArgs: ["--tpm2", "off", "--recovery-key-file", rk], mount: false)
        addTeardownBlock { a.close() }
        func add(_ m: MountFixture, _ tpmArgs: [String]) -> String {
            let r = keybagfs(
                [
                    "device", "add", m.store, "--device-key", m.deviceKey, "--recovery-key-file", rk, "--stdin",
                    "--kdf",
                    "interactive",
                ] + tpmArgs, stdin: m.passcode + "\n")
            XCTAssertEqual(r.code, 0, r.stderr)
            let id = keybagfs(["device", "id", m.store, "--device-key", m.deviceKey]).stdout
            return m.store + "/devices/" + id.trimmingCharacters(in: .whitespacesAndNewlines) + ".keybag"
        }
        // B joins with its TPM: its keybag is bound from its first write (no copy of it opens off the TPM).
        let b = try MountFixture(replicaOf: a, passcode: "device B")
        addTeardownBlock { b.close() }
        let keybagB = add(b, ["--tpm2", "on", "--tpm2-device", tpm.tcti])
        let jsonB =
            try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: keybagB))) as? [String: Any]
        XCTAssertEqual(jsonB?["tpm2"] as? Bool, true, "B's keybag is TPM-bound from its first write")
        // C joins without one, a copy of its keybag is kept, then C enrolls.
        let c = try MountFixture(replicaOf: a, passcode: "device C")
        addTeardownBlock { c.close() }
        let keybagC = add(c, ["--tpm2", "off"])
        try c.mount()
        c.unlock()
        XCTAssertEqual(writeFile(c.path("old-complete"), bytes("written on C before its enrollment")), 0)
        XCTAssertEqual(setXattr(c.path("old-complete"), "complete"), 0)
        c.unmount()
        let oldC = try Data(contentsOf: URL(fileURLWithPath: keybagC))
        func enroll(_ extra: [String]) -> ToolResult {
            keybagfs(
                [
                    "tpm2", "enroll", c.store, "--device-key", c.deviceKey, "--tpm2-device", tpm.tcti,
                    "--passcode-stdin",
                    "--recovery-key-file", rk, "--tpm2-accept-clearable-lockout",
                ] + extra, stdin: c.passcode + "\n")
        }
        let asked = enroll([])
        XCTAssertEqual(asked.code, 1, "enrolled on a store of several devices without saying what of the others")
        XCTAssertTrue(asked.stderr.contains("--new-key-set") && asked.stderr.contains("--keep-key-set"), asked.stderr)
        let en = enroll(["--new-key-set"])
        XCTAssertEqual(en.code, 0, en.stderr)
        try c.mount()
        c.unlock()
        for cls in ["complete", "completeUnlessOpen", "completeUntilFirstUserAuthentication"] {
            XCTAssertEqual(writeFile(c.path("new-\(cls)"), bytes("written on C after its enrollment")), 0)
            XCTAssertEqual(setXattr(c.path("new-\(cls)"), cls), 0)
        }
        c.unmount()
        // The thief with C's keybag from before its enrollment, C's device key and the passcode.
        let thief = try mountAsThief(of: c, keybag: oldC, at: "/devices/" + (keybagC as NSString).lastPathComponent)
        // The other devices still need set 0, so C's older files stay on it (and open for the thief:
        // a store of several devices is as strong as its weakest keybag until they move).
        XCTAssertEqual(try readFile(thief.path("old-complete")).get(), bytes("written on C before its enrollment"))
        for cls in ["complete", "completeUnlessOpen", "completeUntilFirstUserAuthentication"] {
            guard case .failure = readFile(thief.path("new-\(cls)")) else {
                XCTFail("C's keybag from before its enrollment opens new-\(cls)"); continue
            }
        }
    }

    func testRecoverOntoATPMAlsoLeavesTheKeybagFromBeforeWithNothingToOpen() throws {
        let tpm = try swtpm(maxTries: 5)
        let rk = try MountFixture.makeRoot() + "/recovery.txt"
        let m = try MountFixture(initArgs: ["--tpm2", "off", "--recovery-key-file", rk], mount: false)
        addTeardownBlock { m.close() }
        try m.mount()
        m.unlock()
        XCTAssertEqual(writeFile(m.path("a.txt"), bytes("class A, before the TPM")), 0)
        XCTAssertEqual(setXattr(m.path("a.txt"), "complete"), 0)
        m.unmount()
        let oldKeybag = try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))
        let newPasscode = "recovered onto the TPM"
        let rec = keybagfs(
            [
                "recover", m.store, "--device-key", m.deviceKey, "--recovery-key-file", rk, "--stdin", "--tpm2", "on",
                "--tpm2-device", tpm.tcti,
            ], stdin: newPasscode + "\n")
        XCTAssertEqual(rec.code, 0, rec.stderr)
        XCTAssertTrue(rec.stdout.contains("new key set 1, 1 files rewrapped"), rec.stdout)
        try m.mount()
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: newPasscode + "\n").code, 0)
        XCTAssertEqual(try readFile(m.path("a.txt")).get(), bytes("class A, before the TPM"))
        m.unmount()
        let thief = try mountAsThief(of: m, keybag: oldKeybag)
        guard case .failure = readFile(thief.path("a.txt")) else {
            return XCTFail("the keybag from before recover bound the TPM opens a.txt")
        }
    }

    func testAnEnrollmentCutShortLeavesNoOpenLockoutAndRunningItAgainFinishesIt() throws {
        let tpm = try swtpm(maxTries: 5, recoveryTime: 1000, lockoutRecovery: 2)
        let rk = try MountFixture.makeRoot() + "/recovery.txt"
        let m = try MountFixture(initArgs: ["--tpm2", "off", "--recovery-key-file", rk], mount: false)
        addTeardownBlock { m.close() }
        try m.mount()
        m.unlock()
        let files = 700  // more than one rewrap batch (512)
        for i in 0..<files {
            XCTAssertEqual(writeFile(m.path("f\(i)"), bytes("file \(i)")), 0)
            if i % 2 == 0 { XCTAssertEqual(setXattr(m.path("f\(i)"), "complete"), 0) }
        }
        m.unmount()
        let before = try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))
        let enrollArgs = [
            "tpm2", "enroll", m.store, "--device-key", m.deviceKey, "--tpm2-device", tpm.tcti, "--passcode-stdin",
            "--recovery-key-file", rk,
        ]
        // Root tries a wrong lockout authorization first: the TPM then refuses it for a while, and
        // the enrollment stops before it writes anything (it cannot take the lockout now).
        XCTAssertNotEqual(tpm.tool("tpm2_dictionarylockout", ["-c", "-p", "str:wrong"]).code, 0)
        let refused = keybagfs(enrollArgs, stdin: m.passcode + "\n")
        XCTAssertEqual(refused.code, 1)
        XCTAssertTrue(refused.stderr.contains("refuses its lockout authorization"), refused.stderr)
        XCTAssertEqual(try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag")), before, "nothing written")
        sleep(3)
        // Killed in the middle of the rewrap (after a batch's new slots are durable).
        let p = Process()
        p.executableURL = URL(fileURLWithPath: MountFixture.binDir + "/keybagfs")
        p.arguments = enrollArgs
        p.environment = ProcessInfo.processInfo.environment.merging(
            ["KEYBAGFS_TEST_FAILPOINTS": "rewrap-between-slots=stop"]) { $1 }
        let input = Pipe()
        p.standardInput = input
        p.standardOutput = FileHandle.nullDevice
        try p.run()
        input.fileHandleForWriting.write(Data((m.passcode + "\n").utf8))
        try input.fileHandleForWriting.close()
        let pid = p.processIdentifier
        var stopped = false
        for _ in 0..<1000 where !stopped {
            let stat = (try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8)) ?? ""
            stopped = stat.split(separator: ")").last?.split(separator: " ").first == "T"
            if !stopped { usleep(20_000) }
        }
        XCTAssertTrue(stopped, "enroll reached the rewrap")
        kill(pid, SIGKILL)
        p.waitUntilExit()
        XCTAssertTrue(tpm.lockoutAuthSet, "the lockout was taken before the rewrap")
        XCTAssertNotEqual(tpm.tool("tpm2_dictionarylockout", ["-c"]).code, 0)
        try m.mount()
        XCTAssertEqual(tpmStatus(m)["rewrapPending"] as? Int, 1, "status says the enrollment was cut short")
        m.unlock()
        for i in stride(from: 0, to: files, by: 37) {
            XCTAssertEqual(try readFile(m.path("f\(i)")).get(), bytes("file \(i)"), "f\(i) after the cut")
        }
        m.unmount()
        let again = keybagfs(enrollArgs, stdin: m.passcode + "\n")
        XCTAssertEqual(again.code, 0, again.stderr)
        XCTAssertTrue(again.stdout.contains("finished"), again.stdout)
        try m.mount()
        XCTAssertNil(tpmStatus(m)["rewrapPending"], "done")
        m.unmount()
        // The keybag from before opens none of them.
        let thief = try mountAsThief(of: m, keybag: before)
        var opened = 0
        for i in 0..<files { if case .success = readFile(thief.path("f\(i)")) { opened += 1 } }
        XCTAssertEqual(opened, 0, "files the keybag from before still opens")
    }

    func testRecoverWithANewDeviceKeyKeepsTheLockoutAuthorizationItSet() throws {
        let tpm = try swtpm(maxTries: 3)
        let rk = try MountFixture.makeRoot() + "/recovery.txt"
        let m = try MountFixture(
            initArgs: ["--tpm2", "on", "--tpm2-device", tpm.tcti, "--recovery-key-file", rk], mount: false)
        addTeardownBlock { m.close() }
        XCTAssertTrue(tpm.lockoutAuthSet)
        XCTAssertEqual(unlink(m.deviceKey), 0, "the device key is lost")
        let rec = keybagfs(
            [
                "recover", m.store, "--device-key", m.deviceKey, "--recovery-key-file", rk, "--stdin",
                "--new-device-key",
                "--tpm2", "on", "--tpm2-device", tpm.tcti,
            ], stdin: "new passcode\n")
        XCTAssertEqual(rec.code, 0, rec.stderr)
        try m.mount()
        XCTAssertEqual(tpmStatus(m)["lockoutAuthority"] as? String, "keybagfs", "the record followed the device")
        for n in 1...3 { XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: "wrong \(n)\n").code, 1) }
        m.unmount()
        let clear = keybagfs(
            ["tpm2", "clear-lockout", m.store, "--device-key", m.deviceKey, "--recovery-key-file", rk])
        XCTAssertEqual(clear.code, 0, "the recovery key clears the lockout the first device id took: \(clear.stderr)")
        XCTAssertEqual(tpm.lockoutCounter, 0)
    }

    /// Root makes the TPM refuse its lockout authorization after the enrollment checked it and
    /// before it takes it (found by review: enroll then said "nothing was changed", owed no rewrap,
    /// and a second run said "finished" with every file still on the old key set).
    func testALockoutRefusedAfterTheKeybagIsBoundIsFinishedWithTheRewrapOnTheNextRun() throws {
        let tpm = try swtpm(maxTries: 5, recoveryTime: 1000, lockoutRecovery: 2)
        let rk = try MountFixture.makeRoot() + "/recovery.txt"
        let m = try MountFixture(initArgs: ["--tpm2", "off", "--recovery-key-file", rk], mount: false)
        addTeardownBlock { m.close() }
        try m.mount()
        m.unlock()
        XCTAssertEqual(writeFile(m.path("secret.txt"), bytes("class A before enrollment")), 0)
        XCTAssertEqual(setXattr(m.path("secret.txt"), "complete"), 0)
        m.unmount()
        let before = try Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag"))
        let args = [
            "tpm2", "enroll", m.store, "--device-key", m.deviceKey, "--tpm2-device", tpm.tcti, "--passcode-stdin",
            "--recovery-key-file", rk,
        ]
        let p = Process()
        p.executableURL = URL(fileURLWithPath: MountFixture.binDir + "/keybagfs")
        p.arguments = args
        p.environment = ProcessInfo.processInfo.environment.merging(
            ["KEYBAGFS_TEST_FAILPOINTS": "enroll-before-lockout=stop"]) { $1 }
        let input = Pipe(), errors = Pipe()
        p.standardInput = input
        p.standardOutput = FileHandle.nullDevice
        p.standardError = errors
        try p.run()
        input.fileHandleForWriting.write(Data((m.passcode + "\n").utf8))
        try input.fileHandleForWriting.close()
        var stopped = false
        for _ in 0..<1000 where !stopped {
            let stat = (try? String(contentsOfFile: "/proc/\(p.processIdentifier)/stat", encoding: .utf8)) ?? ""
            stopped = stat.split(separator: ")").last?.split(separator: " ").first == "T"
            if !stopped { usleep(20_000) }
        }
        XCTAssertTrue(stopped, "enroll reached the point after the keybag's save")
        XCTAssertNotEqual(tpm.tool("tpm2_dictionarylockout", ["-c", "-p", "str:wrong"]).code, 0)
        kill(p.processIdentifier, SIGCONT)
        p.waitUntilExit()
        let said = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        XCTAssertEqual(p.terminationStatus, 1)
        XCTAssertTrue(said.contains("tpm2 enroll STORE` again") && !said.contains("nothing was changed"), said)
        sleep(3)
        let again = keybagfs(args, stdin: m.passcode + "\n")
        XCTAssertEqual(again.code, 0, again.stderr)
        XCTAssertTrue(again.stdout.contains("files rewrapped for key set 1: 1"), again.stdout)
        XCTAssertTrue(tpm.lockoutAuthSet, "the lockout is taken")
        // The keybag from before opens nothing.
        let thief = try mountAsThief(of: m, keybag: before)
        guard case .failure = readFile(thief.path("secret.txt")) else {
            return XCTFail("the keybag from before enrollment opens secret.txt")
        }
    }
}
