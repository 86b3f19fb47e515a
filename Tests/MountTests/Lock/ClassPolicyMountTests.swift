import CFuse
import Foundation
import Glibc
import XCTest

/// The mount-time class policy: directories created at matching paths get the policy's
/// class, others inherit as before; `report` shows the rules and directories off policy;
/// a bad policy stops the mount with the line named.
final class ClassPolicyMountTests: XCTestCase {
    func testDirectoriesCreatedAtPolicyPathsGetThePolicyClass() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let policyFile = m.root + "/policy"
        try "# app layout\nDocuments complete\nLibrary/Caches none\n**/tmp completeUnlessOpen\n".write(
            toFile: policyFile, atomically: true, encoding: .utf8)
        try m.mount(extra: [
            "--policy", policyFile, "--policy-rule", "Library/Caches/Thumbs=completeUntilFirstUserAuthentication",
        ])
        m.unlock()

        XCTAssertEqual(mkdir(m.path("Documents"), 0o755), 0)
        XCTAssertEqual(getXattr(m.path("Documents")), .success("complete"))
        XCTAssertEqual(writeFile(m.path("Documents/note"), bytes("secret")), 0)
        XCTAssertEqual(getXattr(m.path("Documents/note")), .success("complete"), "new files inherit the policy's class")
        XCTAssertEqual(mkdir(m.path("Documents/sub"), 0o755), 0)
        XCTAssertEqual(
            getXattr(m.path("Documents/sub")), .failure(Errno(ENODATA)),
            "below a policy path, directories inherit as usual")

        XCTAssertEqual(mkdir(m.path("Library"), 0o755), 0)
        XCTAssertEqual(getXattr(m.path("Library")), .failure(Errno(ENODATA)))
        XCTAssertEqual(mkdir(m.path("Library/Caches"), 0o755), 0)
        XCTAssertEqual(getXattr(m.path("Library/Caches")), .success("none"))
        XCTAssertEqual(mkdir(m.path("Library/Caches/Thumbs"), 0o755), 0)
        XCTAssertEqual(
            getXattr(m.path("Library/Caches/Thumbs")), .success("completeUntilFirstUserAuthentication"),
            "the command-line rule comes last")

        // Any depth, and through an ancestor with a long (side-file) name.
        let long = String(repeating: "L", count: 240)
        XCTAssertEqual(mkdir(m.path(long), 0o755), 0)
        XCTAssertEqual(mkdir(m.path(long + "/tmp"), 0o755), 0)
        XCTAssertEqual(getXattr(m.path(long + "/tmp")), .success("completeUnlessOpen"))
        XCTAssertEqual(mkdir(m.path("Documents/sub/tmp"), 0o755), 0)
        XCTAssertEqual(getXattr(m.path("Documents/sub/tmp")), .success("completeUnlessOpen"))
        // Not at the root: an anchored rule does not match deeper down.
        XCTAssertEqual(mkdir(m.path("Documents/sub/Documents"), 0o755), 0)
        XCTAssertEqual(getXattr(m.path("Documents/sub/Documents")), .failure(Errno(ENODATA)))

        // A directory renamed into a policy path keeps its class (policies apply at creation):
        // report shows it as off policy.
        XCTAssertEqual(mkdir(m.path("old"), 0o755), 0)
        XCTAssertEqual(rmdir(m.path("Documents/sub/tmp")), 0)
        XCTAssertEqual(rename(m.path("old"), m.path("Documents/sub/tmp")), 0)
        let r = m.ctl(["report", m.mnt, "--json"])
        XCTAssertEqual(r.code, 0, r.stderr)
        let o = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(r.stdout.utf8)) as? [String: Any], r.stdout)
        let rules = try XCTUnwrap(o["policy"] as? [[String: Any]], r.stdout)
        XCTAssertEqual(
            rules.map { $0["pattern"] as? String }, ["Documents", "Library/Caches", "**/tmp", "Library/Caches/Thumbs"])
        XCTAssertEqual(rules.map { $0["directories"] as? Int }, [1, 1, 2, 1])
        XCTAssertEqual(o["offPolicyDirectoryCount"] as? Int, 1, r.stdout)
        XCTAssertEqual((o["offPolicyDirectories"] as? [[String: String]])?.first?["path"], m.path("Documents/sub/tmp"))
        // A symlink where the policy wants a directory sends new files elsewhere: flagged (helper-6).
        XCTAssertEqual(mkdir(m.path("weak"), 0o755), 0)
        XCTAssertEqual(symlink("weak", m.path("Library/Caches/Thumbs2")), 0)
        XCTAssertEqual(rmdir(m.path("Library/Caches/Thumbs")), 0)
        XCTAssertEqual(symlink("../../weak", m.path("Library/Caches/Thumbs")), 0)
        let withLink = m.ctl(["report", m.mnt + "/", "--json"])
        let lo = try XCTUnwrap(
            JSONSerialization.jsonObject(with: Data(withLink.stdout.utf8)) as? [String: Any],
            withLink.stdout + withLink.stderr)
        let flagged = (lo["offPolicyDirectories"] as? [[String: String]]) ?? []
        XCTAssertTrue(
            flagged.contains { $0["path"] == m.path("Library/Caches/Thumbs") && $0["class"] == "symlink" }, "\(flagged)"
        )
        XCTAssertEqual(unlink(m.path("Library/Caches/Thumbs")), 0)
        XCTAssertEqual(unlink(m.path("Library/Caches/Thumbs2")), 0)
        XCTAssertEqual(mkdir(m.path("Library/Caches/Thumbs"), 0o755), 0)
        // From a subdirectory, paths are still taken from the mount root.
        let dot = MountFixture.run(
            "/bin/sh",
            ["-c", "cd '\(m.path("Library"))' && '\(MountFixture.binDir)/keybagctl' --socket '\(m.socket)' report ."])
        XCTAssertEqual(dot.code, 0, "report . (crashed before): " + dot.stderr)
        XCTAssertTrue(dot.stdout.contains("Library/Caches → none: 1 directories"), dot.stdout)
        let sub = m.ctl(["report", m.path("Library")])
        XCTAssertEqual(sub.code, 0, sub.stderr)
        XCTAssertTrue(sub.stdout.contains("Library/Caches → none: 1 directories"), sub.stdout)
        XCTAssertTrue(sub.stdout.contains("directories whose default is not the policy's: 0"), sub.stdout)

        // Another local user may ask status, not the policy.
        let nobody = MountFixture.run(
            "/usr/bin/setpriv",
            [
                "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                """
                import socket, sys
                s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b'{"op":"policy"}\\n'); print(s.makefile().readline().strip())
                """, m.socket,
            ])
        XCTAssertTrue(nobody.stdout.contains("\"forbidden\""), nobody.stdout + nobody.stderr)

        // The policy is the mount's, not the store's: mounted without it, nothing applies.
        m.unmount()
        try m.mount()
        m.unlock()
        XCTAssertEqual(mkdir(m.path("Library/Caches/x"), 0o755), 0)
        XCTAssertEqual(mkdir(m.path("tmp"), 0o755), 0)
        XCTAssertEqual(getXattr(m.path("tmp")), .failure(Errno(ENODATA)))
        XCTAssertEqual(getXattr(m.path("Documents")), .success("complete"), "classes set by the policy stay")
    }

    func testABadPolicyStopsTheMountWithTheLineNamed() throws {
        let m = try MountFixture(mount: false)
        addTeardownBlock { m.close() }
        let policyFile = m.root + "/policy"
        try "Documents complete\nCaches nearly-none\n".write(toFile: policyFile, atomically: true, encoding: .utf8)
        let r = MountFixture.run(
            MountFixture.binDir + "/keybagfs",
            ["mount", m.store, m.mnt, "--device-key", m.deviceKey, "--socket", m.socket, "--policy", policyFile])
        XCTAssertEqual(r.code, 2, r.stderr)
        XCTAssertTrue(r.stderr.contains("line 2"), r.stderr)
        XCTAssertTrue(r.stderr.contains("nearly-none"), r.stderr)
        let bad = MountFixture.run(
            MountFixture.binDir + "/keybagfs",
            ["mount", m.store, m.mnt, "--device-key", m.deviceKey, "--socket", m.socket, "--policy-rule", "../up=none"])
        XCTAssertEqual(bad.code, 2, bad.stderr)
        XCTAssertFalse(m.isMounted, "nothing was mounted")
    }
}
