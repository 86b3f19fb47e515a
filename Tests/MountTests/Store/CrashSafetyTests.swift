import Foundation
import Glibc
import XCTest

/// Kill points: the daemon is SIGKILLed at random instants of a mixed workload (create
/// storms with fsync, 1 MiB appends, renames to long names, class changes, passwd). After
/// each kill `fsck` may report only what a cut-off write leaves (FORMAT.md, "Crashes"),
/// `fsck --repair --yes` fixes it, every byte the workload saw fsync'd (or a rename and a
/// class change return) is intact, and every file reads. Rounds: KEYBAGFS_KILL_ROUNDS
/// (default 30; the long run in docs/TESTING.md uses 500).
final class CrashSafetyTests: XCTestCase {
    /// The workload: journals each durable fact (JSON lines, fsync'd) outside the mount.
    static let workload = #"""
        import hashlib, json, os, random, subprocess, sys
        mnt, journal, seed, ctl, sock, pa, pb = sys.argv[1:8]
        rnd = random.Random(int(seed))
        j = open(journal, "a")
        def note(**kw):
            j.write(json.dumps(kw) + "\n"); j.flush(); os.fsync(j.fileno())
        def sha(b): return hashlib.sha256(b).hexdigest()
        tag = "r%s" % seed
        classes = ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"]
        os.makedirs(os.path.join(mnt, "storm"), exist_ok=True)
        big = os.path.join(mnt, "big-" + tag)
        print("ready", flush=True)  # the kill's random instant counts from here
        i = 0
        while True:
            i += 1
            op = rnd.random()
            if op < 0.55:
                name = "storm/%s-%d" % (tag, i)
                data = os.urandom(rnd.choice([0, 1, 100, 4095, 4096, 5000, 20000, 70000]))
                fd = os.open(os.path.join(mnt, name), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                os.write(fd, data); os.fsync(fd); os.close(fd)
                note(op="file", name=name, sha=sha(data), len=len(data))
            elif op < 0.70:
                fd = os.open(big, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
                os.write(fd, os.urandom(1 << 20)); os.fsync(fd); os.close(fd)
                with open(big, "rb") as f: b = f.read()
                note(op="big", name=os.path.relpath(big, mnt), sha=sha(b), len=len(b))
            elif op < 0.85:
                src = "storm/%s-%d" % (tag, i - 1)
                dst = "storm/" + ("L" * 200) + "-%s-%d" % (tag, i)
                if os.path.exists(os.path.join(mnt, src)):
                    note(op="rename-begin", src=src, dst=dst)  # a kill may land after it took effect
                    os.rename(os.path.join(mnt, src), os.path.join(mnt, dst))
                    note(op="rename", src=src, dst=dst)
            elif op < 0.97:
                name = "storm/%s-%d" % (tag, i - 1)
                if os.path.exists(os.path.join(mnt, name)):
                    c = rnd.choice(classes)
                    note(op="class-begin", name=name, cls=c)
                    os.setxattr(os.path.join(mnt, name), "user.protection", c.encode())
                    note(op="class", name=name, cls=c)
            else:
                cur = json.load(open(journal + ".passcode"))["current"]
                new = pb if cur == pa else pa
                note(op="passwd-begin", new=new)
                r = subprocess.run([ctl, "--socket", sock, "passwd", "--passcode-stdin"], input=(cur + "\n" + new + "\n").encode(), capture_output=True)
                if r.returncode == 0:
                    json.dump({"current": new}, open(journal + ".passcode", "w"))
                    note(op="passwd-done", new=new)
        """#

    /// What a daemon kill may leave for fsck (never a lost header, name or inner block).
    static let allowedAfterKill: Set<String> = [
        "torn-tail", "torn-fragment", "end-not-sealed", "temporary", "side-file-orphan", "header-superseded-slot",
    ]

    func testDaemonKillsLoseNothingFsyncedAndLeaveNoPermanentEIO() throws {
        let rounds = Int(ProcessInfo.processInfo.environment["KEYBAGFS_KILL_ROUNDS"] ?? "") ?? 30
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        let pa = m.passcode, pb = "another passcode 2"
        var passcode = pa
        let journal = m.root + "/journal"
        try JSONSerialization.data(withJSONObject: ["current": pa]).write(
            to: URL(fileURLWithPath: journal + ".passcode"))
        let script = m.root + "/workload.py"
        try Self.workload.write(toFile: script, atomically: true, encoding: .utf8)
        var seen: [String: Int] = [:]
        var rng = SystemRandomNumberGenerator()
        for round in 0..<rounds {
            // The passcode: the last passwd may or may not have happened.
            let unlocked = [passcode, passcode == pa ? pb : pa].first {
                m.ctl(["unlock", "--passcode-stdin"], stdin: $0 + "\n").code == 0
            }
            passcode = try XCTUnwrap(unlocked, "round \(round): neither passcode unlocks")
            try JSONSerialization.data(withJSONObject: ["current": passcode]).write(
                to: URL(fileURLWithPath: journal + ".passcode"))
            let w = Process()
            w.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
            w.arguments = [script, m.mnt, journal, String(round), MountFixture.binDir + "/keybagctl", m.socket, pa, pb]
            w.standardError = FileHandle.nullDevice
            let ready = Pipe()
            w.standardOutput = ready
            try w.run()
            // A slow start (a cold cache, a busy machine) must not let the kill land before
            // the workload has begun: its random instant counts from the workload's "ready".
            let said = ready.fileHandleForReading.availableData
            XCTAssertTrue(
                String(decoding: said, as: UTF8.self).hasPrefix("ready"), "round \(round): the workload did not start")
            usleep(UInt32.random(in: 150_000...900_000, using: &rng))
            let pid = try XCTUnwrap(m.daemon?.processIdentifier)
            kill(pid, SIGKILL)
            // The workload goes before the unmount: it must never write into the bare mount point.
            kill(w.processIdentifier, SIGKILL)
            w.waitUntilExit()
            m.unmount()
            unlink(m.socket)
            // fsck: only what a cut-off write leaves, then repaired.
            let check = fsck(m, passcode: passcode, pa: pa, pb: pb)
            let found = check.map(\.kind)
            for k in found { seen[k, default: 0] += 1 }
            XCTAssertTrue(Set(found).isSubset(of: Self.allowedAfterKill), "round \(round): fsck found \(check)")
            let repaired = fsck(m, passcode: passcode, pa: pa, pb: pb, ["--repair", "--yes"])
            XCTAssertTrue(repaired.allSatisfy { $0.repair == "repaired" }, "round \(round): \(repaired)")
            XCTAssertEqual(
                fsck(m, passcode: passcode, pa: pa, pb: pb).count, 0, "round \(round): not clean after repair")
            try m.mount()
            let again = [passcode, passcode == pa ? pb : pa].first {
                m.ctl(["unlock", "--passcode-stdin"], stdin: $0 + "\n").code == 0
            }
            passcode = try XCTUnwrap(again)
            try verify(m, journal: journal, round: round)
            m.lock()
        }
        let facts = ((try? String(contentsOfFile: journal, encoding: .utf8)) ?? "").split(separator: "\n")
        let ops = Dictionary(
            grouping: facts.compactMap { l in
                ((try? JSONSerialization.jsonObject(with: Data(l.utf8))) as? [String: Any])?["op"] as? String
            }, by: { $0 }
        ).mapValues(\.count)
        print(
            "kill rounds: \(rounds); durable facts: \(ops.sorted { $0.key < $1.key }); fsck findings over all rounds: \(seen.sorted { $0.key < $1.key })"
        )
        // Everything can be removed.
        XCTAssertEqual(m.ctl(["unlock", "--passcode-stdin"], stdin: passcode + "\n").code, 0)
        let rm = MountFixture.run(
            "/bin/rm",
            ["-rf", m.path("storm")]
                + ((try? FileManager.default.contentsOfDirectory(atPath: m.mnt)) ?? []).filter { $0 != "storm" }.map {
                    m.path($0)
                })
        XCTAssertEqual(rm.code, 0, rm.stderr)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.mnt), [])
    }

    /// fsck --json with whichever passcode opens the keybag; the problems (kind, repair).
    func fsck(_ m: MountFixture, passcode: String, pa: String, pb: String, _ extra: [String] = []) -> [(
        kind: String, repair: String
    )] {
        for p in [passcode, passcode == pa ? pb : pa] {
            let r = MountFixture.run(
                MountFixture.binDir + "/keybagfs",
                ["fsck", m.store, "--device-key", m.deviceKey, "--json", "--passcode-stdin"] + extra, stdin: p + "\n")
            guard let o = (try? JSONSerialization.jsonObject(with: Data(r.stdout.utf8))) as? [String: Any] else {
                continue
            }
            return (o["problems"] as? [[String: Any]] ?? []).map {
                ($0["kind"] as? String ?? "?", $0["repair"] as? String ?? "?")
            }
        }
        XCTFail("fsck ran with neither passcode")
        return [("fsck-failed", "")]
    }

    /// Replays the journal (in Python, for hashing): every recorded file has its recorded
    /// bytes under its latest name and its latest class; then every file in the mount reads.
    static let verifier = #"""
        import hashlib, json, os, sys
        mnt, journal = sys.argv[1:3]
        files, classes, bad = {}, {}, []
        # A rename or class change the kill cut off (begun, its return never seen) may or may not
        # have happened: either outcome is right.
        renaming, changing = {}, {}
        def rename(src, dst):
            if src in files: files[dst] = files.pop(src)
            if src in classes: classes[dst] = classes.pop(src)
        for line in open(journal):
            o = json.loads(line)
            op = o["op"]
            if op == "file": files[o["name"]] = (o["sha"], o["len"], False); classes.pop(o["name"], None)
            elif op == "big": files[o["name"]] = (o["sha"], o["len"], True)
            elif op == "rename-begin": renaming[o["src"]] = o["dst"]
            elif op == "rename": renaming.pop(o["src"], None); rename(o["src"], o["dst"])
            elif op == "class-begin": changing[o["name"]] = o["cls"]
            elif op == "class": changing.pop(o["name"], None); classes[o["name"]] = o["cls"]
        for src, dst in renaming.items():
            if not os.path.lexists(os.path.join(mnt, src)) and os.path.lexists(os.path.join(mnt, dst)): rename(src, dst)
        for name, c in changing.items():
            try:
                if os.getxattr(os.path.join(mnt, name), "user.protection").decode() == c: classes[name] = c
            except OSError:
                pass
        for name, (h, n, prefix) in files.items():
            try:
                b = open(os.path.join(mnt, name), "rb").read()
            except OSError as e:
                bad.append("%s: %s" % (name, e)); continue
            if prefix: b = b[:n]
            if len(b) != n or hashlib.sha256(b).hexdigest() != h: bad.append("%s: %d bytes, want %d with the recorded hash" % (name, len(b), n))
        for name, c in classes.items():
            try:
                v = os.getxattr(os.path.join(mnt, name), "user.protection").decode()
            except OSError as e:
                v = str(e)
            if v != c: bad.append("%s: class %s, want %s" % (name, v, c))
        count = 0
        for root, dirs, fs in os.walk(mnt):
            for f in fs:
                p = os.path.join(root, f)
                count += 1
                try:
                    open(p, "rb").read()
                except OSError as e:
                    bad.append("%s: unreadable: %s" % (os.path.relpath(p, mnt), e))
        print(json.dumps({"checked": len(files), "files": count, "bad": bad}))
        """#

    /// Runs the verifier; fails the test with each mismatch.
    func verify(_ m: MountFixture, journal: String, round: Int) throws {
        let script = m.root + "/verify.py"
        if !FileManager.default.fileExists(atPath: script) {
            try Self.verifier.write(toFile: script, atomically: true, encoding: .utf8)
        }
        let r = MountFixture.run("/usr/bin/python3", [script, m.mnt, journal])
        let o = try XCTUnwrap(
            (try? JSONSerialization.jsonObject(with: Data(r.stdout.utf8))) as? [String: Any], "verifier: \(r.stderr)")
        let bad = o["bad"] as? [String] ?? ["no result"]
        XCTAssertEqual(bad, [], "round \(round)")
        XCTAssertGreaterThan(o["files"] as? Int ?? 0, 0)
    }
}
