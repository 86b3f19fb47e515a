import CFuse
import Foundation
import Glibc
import XCTest

/// `keybagctl protect -R` and `keybagctl report` on a real mount: counts, bytes, what is
/// unreadable in each state, differing directory defaults, and symlinks never followed.
final class TreeToolsTests: XCTestCase {
    func xattr(_ path: String) -> String? {
        var buf = [UInt8](repeating: 0, count: 128)
        let n = getxattr(path, "user.protection", &buf, buf.count)
        return n >= 0 ? String(decoding: buf[0..<n], as: UTF8.self) : nil
    }

    func report(_ m: MountFixture, _ path: String) throws -> [String: Any] {
        let r = m.ctl(["report", path, "--json"])
        XCTAssertEqual(r.code, 0, r.stderr)
        return try XCTUnwrap(JSONSerialization.jsonObject(with: Data(r.stdout.utf8)) as? [String: Any], r.stdout)
    }

    func files(_ o: [String: Any], _ cls: String) -> Int {
        ((o["classes"] as? [String: Any])?[cls] as? [String: Any])?["files"] as? Int ?? 0
    }
    func bytes(_ o: [String: Any], _ cls: String) -> Int {
        ((o["classes"] as? [String: Any])?[cls] as? [String: Any])?["bytes"] as? Int ?? 0
    }

    func testProtectRecursivelyAndReport() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        // 20 directories of 50 files each (1,000 files of 100 bytes), default class C.
        XCTAssertEqual(mkdir(m.path("t"), 0o755), 0)
        for d in 0..<20 {
            XCTAssertEqual(mkdir(m.path("t/d\(d)"), 0o755), 0)
            for f in 0..<50 {
                try Data(repeating: 0x61, count: 100).write(to: URL(fileURLWithPath: m.path("t/d\(d)/f\(f)")))
            }
        }
        // A symlink out of the mount, to a folder with a file: never followed.
        let outside = m.root + "/outside"
        XCTAssertEqual(mkdir(outside, 0o755), 0)
        try Data("x".utf8).write(to: URL(fileURLWithPath: outside + "/victim"))
        XCTAssertEqual(symlink(outside, m.path("t/escape")), 0)

        let p = m.ctl(["protect", "-R", "complete", m.path("t/d0"), m.path("t/d1")])
        XCTAssertEqual(p.code, 0, p.stderr)
        XCTAssertTrue(p.stdout.contains("set complete on 100 files and 2 directories"), p.stdout)
        XCTAssertEqual(xattr(m.path("t/d1/f49")), "complete")
        XCTAssertEqual(xattr(m.path("t/d2/f0")), "completeUntilFirstUserAuthentication")
        XCTAssertEqual(
            m.ctl(["protect", "NSFileProtectionNone", m.path("t/d2/f0")]).code, 0, "Apple constants are accepted")
        let all = m.ctl(["protect", "-R", "completeUnlessOpen", m.path("t/escape")])
        XCTAssertEqual(all.code, 1, "a symlink takes no class: \(all.stdout)")
        XCTAssertNil(xattr(outside + "/victim"), "nothing outside the mount was touched")
        XCTAssertEqual(m.ctl(["protect", "bogus", m.path("t")]).code, 2)

        var o = try report(m, m.path("t"))
        XCTAssertEqual(o["state"] as? String, "unlocked")
        XCTAssertEqual(files(o, "complete"), 100)
        XCTAssertEqual(bytes(o, "complete"), 10_000)
        XCTAssertEqual(files(o, "none"), 1)
        XCTAssertEqual(files(o, "completeUntilFirstUserAuthentication"), 899)
        XCTAssertEqual(o["unreadableNowCount"] as? Int, 0)
        XCTAssertEqual(o["otherEntries"] as? Int, 1, "the symlink, counted and not followed")
        let differing = (o["differingDirectories"] as? [[String: String]])?.map { $0["path"]! }.sorted()
        XCTAssertEqual(differing, [m.path("t/d0"), m.path("t/d1")])
        // Directories without a default of their own are counted under what they inherit.
        let dirs = o["directories"] as? [String: Int] ?? [:]
        XCTAssertNil(dirs["unknown"], "\(dirs)")
        XCTAssertEqual(
            dirs["completeUntilFirstUserAuthentication"], 19, "t and d2…d19 inherit the mount's default: \(dirs)")
        XCTAssertEqual(dirs["complete"], 2)
        XCTAssertEqual(o["directoriesInheriting"] as? Int, 19)

        XCTAssertEqual(m.ctl(["lock", "--grace", "0"]).code, 0)
        o = try report(m, m.path("t"))
        XCTAssertEqual(o["state"] as? String, "locked")
        XCTAssertEqual(o["unreadableNowCount"] as? Int, 100, "the complete files")
        XCTAssertTrue((o["unreadableNow"] as? [String])?.contains(m.path("t/d0/f7")) ?? false)
        // Before the first unlock class C is unreadable too.
        try m.restart()
        o = try report(m, m.path("t"))
        XCTAssertEqual(o["state"] as? String, "beforeFirstUnlock")
        XCTAssertEqual(o["unreadableNowCount"] as? Int, 999)
        // Human output names the classes and the counts.
        let text = m.ctl(["report", m.path("t")])
        XCTAssertEqual(text.code, 0, text.stderr)
        XCTAssertTrue(text.stdout.contains("unreadable now: 999 files"), text.stdout)
        XCTAssertTrue(text.stdout.contains("directories whose default differs from their parent's: 2"), text.stdout)
    }
}
