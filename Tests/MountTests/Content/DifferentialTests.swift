import CFuse
import CSystem
import Foundation
import Glibc
import XCTest

/// A seeded random sequence of operations run on the mount and on a plain directory side
/// by side; after every step the results (errno, bytes, sizes, listings, modes) must agree.
/// `KEYBAGFS_DIFF_OPS=1000000 KEYBAGFS_DIFF_SEED=N swift test --filter DifferentialTests`
/// runs a long sequence and prints the seed and step of any divergence.
final class DifferentialTests: XCTestCase {
    /// What one operation returned.
    struct Outcome: Equatable, CustomStringConvertible {
        var err: Int32 = 0
        var data: [UInt8] = []
        var description: String {
            err != 0 ? "errno \(err) (\(String(cString: strerror(err))))" : "ok \(data.count) bytes \(data.prefix(16))"
        }
    }

    static let names = ["a", "b", "c", "déjà", String(repeating: "n", count: 220), ".dot"]

    /// A random relative path of depth 1 to 3.
    static func randomPath(_ r: inout SeededBytes) -> String {
        (0..<r.int(1..<4)).map { _ in names[r.int(0..<names.count)] }.joined(separator: "/")
    }

    /// One step: a description and the operation against a root.
    static func randomOp(_ r: inout SeededBytes) -> (String, (String) -> Outcome) {
        let p = randomPath(&r), q = randomPath(&r)
        let off = r.int(0..<20_000), len = r.int(0..<9000)
        let data = r.bytes(r.int(1..<9000))
        let mode = mode_t([0o644, 0o600, 0o755, 0o400, 0o151][r.int(0..<5)])
        func e(_ rc: Int32) -> Outcome { Outcome(err: rc == 0 ? 0 : errno) }
        switch r.int(0..<15) {
        case 0, 1:
            return (
                "write \(p) @\(off) +\(data.count)",
                { root in
                    let fd = open(root + "/" + p, O_WRONLY | O_CREAT | O_CLOEXEC, 0o644)
                    if fd < 0 { return Outcome(err: errno) }
                    defer { close(fd) }
                    let n = pwrite(fd, data, data.count, off_t(off))
                    return n < 0 ? Outcome(err: errno) : Outcome(data: [UInt8(truncatingIfNeeded: n)])
                }
            )
        case 2, 3:
            return (
                "read \(p) @\(off) +\(len)",
                { root in
                    let fd = open(root + "/" + p, O_RDONLY | O_CLOEXEC)
                    if fd < 0 { return Outcome(err: errno) }
                    defer { close(fd) }
                    var buf = [UInt8](repeating: 0, count: len)
                    let n = pread(fd, &buf, len, off_t(off))
                    return n < 0 ? Outcome(err: errno) : Outcome(data: Array(buf[0..<n]))
                }
            )
        case 4: return ("truncate \(p) \(off)", { root in e(truncate(root + "/" + p, off_t(off))) })
        case 5: return ("rename \(p) \(q)", { root in e(rename(root + "/" + p, root + "/" + q)) })
        case 6: return ("link \(p) \(q)", { root in e(link(root + "/" + p, root + "/" + q)) })
        case 7: return ("unlink \(p)", { root in e(unlink(root + "/" + p)) })
        case 8: return ("mkdir \(p) \(String(mode, radix: 8))", { root in e(mkdir(root + "/" + p, mode)) })
        case 9: return ("rmdir \(p)", { root in e(rmdir(root + "/" + p)) })
        case 10: return ("chmod \(p) \(String(mode, radix: 8))", { root in e(chmod(root + "/" + p, mode)) })
        case 11:
            let v = Array(data.prefix(64))
            return (
                "setxattr \(p)",
                { root in
                    e(setxattr(root + "/" + p, "user.t", v, v.count, 0))
                }
            )
        case 12:
            return (
                "getxattr \(p)",
                { root in
                    var buf = [UInt8](repeating: 0, count: 128)
                    let n = getxattr(root + "/" + p, "user.t", &buf, buf.count)
                    return n < 0 ? Outcome(err: errno) : Outcome(data: Array(buf[0..<n]))
                }
            )
        case 13:
            let fmode: Int32 = [0, 0x01, 0x03, 0x10, 0x11][r.int(0..<5)]
            return (
                "fallocate \(p) mode \(fmode) @\(off) +\(len + 1)",
                { root in
                    let fd = open(root + "/" + p, O_RDWR | O_CLOEXEC)
                    if fd < 0 { return Outcome(err: errno) }
                    defer { close(fd) }
                    return e(kbfs_fallocate(fd, fmode, Int64(off), Int64(len + 1)))
                }
            )
        default:
            let target = names[r.int(0..<names.count)]
            return (
                "symlink \(target) \(p)",
                { root in
                    let rc = symlink(target, root + "/" + p)
                    if rc != 0 { return Outcome(err: errno) }
                    var buf = [CChar](repeating: 0, count: 512)
                    let n = readlink(root + "/" + p, &buf, buf.count)
                    return Outcome(data: buf[0..<max(n, 0)].map { UInt8(bitPattern: $0) })
                }
            )
        }
    }

    /// A walk of a tree: path, type, mode, size (files), nlink (non-directories), content hash.
    static func snapshot(_ root: String) -> [String] {
        var out: [String] = []
        func walk(_ rel: String) {
            let full = rel.isEmpty ? root : root + "/" + rel
            guard let names = try? FileManager.default.contentsOfDirectory(atPath: full) else { return }
            for n in names.sorted() {
                let r = rel.isEmpty ? n : rel + "/" + n
                var st = stat()
                guard lstat(root + "/" + r, &st) == 0 else { out.append("\(r) lstat failed \(errno)"); continue }
                let type = st.st_mode & S_IFMT
                var line = "\(r) type \(type) mode \(String(st.st_mode & 0o7777, radix: 8))"
                if type == S_IFREG {
                    line += " size \(st.st_size) nlink \(st.st_nlink)"
                    if let d = FileManager.default.contents(atPath: root + "/" + r) {
                        line +=
                            " sum \(d.reduce(into: UInt64(1469598103934665603)) { $0 = ($0 ^ UInt64($1)) &* 1099511628211 })"
                    }
                }
                out.append(line)
                if type == S_IFDIR { walk(r) }
            }
        }
        walk("")
        return out
    }

    func testMountAgreesWithPlainDirectory() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let env = ProcessInfo.processInfo.environment
        let opsPerSeed = Int(env["KEYBAGFS_DIFF_OPS"] ?? "") ?? 5000
        let seeds: [UInt64] = env["KEYBAGFS_DIFF_SEED"].flatMap { UInt64($0) }.map { [$0] } ?? [1, 2, 3, 4]
        let classes = ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"]
        for seed in seeds {
            let a = m.path("diff-\(seed)"), b = m.root + "/plain-\(seed)"
            XCTAssertEqual(mkdir(a, 0o755), 0)
            XCTAssertEqual(mkdir(b, 0o755), 0)
            var r = SeededBytes(seed: seed)
            var diverged = false
            for step in 0..<opsPerSeed where !diverged {
                let (what, op) = Self.randomOp(&r)
                let got = op(a), want = op(b)
                if got != want {
                    XCTFail("seed \(seed) step \(step): \(what): mount \(got), plain \(want)")
                    diverged = true
                }
                // Class changes on the mount side only: contents must not change.
                if r.int(0..<20) == 0 {
                    _ = setXattr(a + "/" + Self.randomPath(&r), classes[r.int(0..<4)])
                }
                if step % 250 == 249 || step == opsPerSeed - 1 {
                    let sa = Self.snapshot(a), sb = Self.snapshot(b)
                    if sa != sb {
                        let diff =
                            zip(sa, sb).first { $0 != $1 }.map { "mount: \($0.0)\nplain: \($0.1)" }
                            ?? "counts \(sa.count) vs \(sb.count)"
                        XCTFail("seed \(seed) step \(step): trees differ\n\(diff)")
                        diverged = true
                    }
                }
            }
            if diverged { print("DIVERGENCE with KEYBAGFS_DIFF_SEED=\(seed)") }
        }
    }
}
