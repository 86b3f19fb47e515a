import Foundation
import Glibc
import XCTest

/// A replica written by someone else (issue 49): while the store is mounted and between
/// mounts, a writer damages its files at random — bit flips, cuts, huge sparse growth, swaps,
/// symlinks out of the store, FIFOs and folders where files were, a folder's metadata, the
/// xattr sets, the journal, files of another store. The daemon never exits; every file the
/// writer did not touch reads back byte-exact; a touched one reads its old bytes (a swapped
/// one its partner's, "Swaps and rollback") or an error, never other bytes — but for the two
/// limits docs/FORMAT.md states ("What a store writer can do"): a backing cut to 0 bytes or
/// to its header reads as an empty file, and one grown past a full last block reads its
/// bytes and then zeros (a hole); after `fsck --repair`, a damaged block reads as zeros and
/// a torn tail is cut, as its report says. Lock and unlock keep working; fsck names the damage and
/// `--repair` leaves a store that mounts.
final class HostileReplicaTests: XCTestCase {
    /// What the writer did in a run.
    struct Tally { var rounds = 0, mutations = 0, damaged = Set<String>(), exits = 0, untouchedChanged = 0 }

    /// The files of the store: relative path → contents (`dir/…` files share one folder).
    static func makeFiles(_ m: MountFixture, _ rng: inout SeededBytes) -> [String: [UInt8]] {
        XCTAssertEqual(mkdir(m.path("dir"), 0o755), 0)
        var files: [String: [UInt8]] = [:]
        for i in 0..<16 {
            let rel = (i % 2 == 0 ? "" : "dir/") + "f\(i)"
            let b = rng.bytes([0, 1, 4095, 4096, 4097, 10_000, 70_000][i % 7])
            XCTAssertEqual(writeFile(m.path(rel), b), 0)
            if i % 4 == 1 { XCTAssertEqual(setXattr(m.path(rel), "complete"), 0) }
            if i % 4 == 3 { XCTAssertEqual(setXattr(m.path(rel), "none"), 0) }
            files[rel] = b
        }
        XCTAssertEqual(setXattr(m.path("f0"), "a note", "user.note"), 0)
        // Durable before the writer comes: it damages what a replica holds, not writes still
        // in the page cache (a change underneath drops those, as a second writer's would).
        for rel in files.keys {
            let fd = open(m.path(rel), O_RDONLY)
            XCTAssertEqual(fsync(fd), 0)
            close(fd)
        }
        return files
    }

    /// Reads at most `limit` bytes of `path` without blocking on a FIFO: the bytes, or errno.
    static func readSome(_ path: String, _ limit: Int) -> Result<[UInt8], Errno> {
        let fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { return .failure(Errno(errno)) }
        defer { close(fd) }
        var st = stat()
        guard fstat(fd, &st) == 0, st.st_mode & S_IFMT == S_IFREG else { return .failure(Errno(EINVAL)) }
        var out: [UInt8] = []
        while out.count < limit {
            switch sysPread(fd, min(65536, limit - out.count), out.count) {
            case .success(let b): if b.isEmpty { return .success(out) } else { out += b }
            case .failure(let e): return .failure(e)
            }
        }
        return .success(out)
    }

    /// One mutation of the backing of `rel` (or of `other` for a swap); the paths it touched.
    /// (`b`, `o`: their backing paths, found while mounted.)
    static func mutate(
        _ kind: Int, _ paths: (rel: String, b: String, other: String, o: String), _ foreign: String,
        _ rng: inout SeededBytes
    ) -> Set<String> {
        let (rel, b, other, o) = paths
        guard !b.hasPrefix("/nonexistent") else { return [] }
        var st = stat()
        lstat(b, &st)
        switch kind {
        case 0:  // bit flip at a random offset
            let fd = open(b, O_RDWR)
            if fd >= 0, st.st_size > 0 {
                let at = rng.int(0..<Int(st.st_size))
                if case .success(let x) = sysPread(fd, 1, at), let v = x.first { _ = sysPwrite(fd, [v ^ 0x10], at) }
            }
            if fd >= 0 { close(fd) }
        case 1:
            let to = rng.int(0..<max(1, Int(st.st_size)))
            truncate(b, off_t(to))
        case 2: truncate(b, 1 << 30)  // grown to 1 GiB (sparse)
        case 3:
            guard !o.hasPrefix("/nonexistent") else { return [] }
            rename(b, b + ".swap")
            rename(o, b)
            rename(b + ".swap", o)
            return [rel, other]
        case 4: unlink(b); symlink("/etc/passwd", b)
        case 5: unlink(b); mkfifo(b, 0o644)
        case 6: unlink(b); mkdir(b, 0o755)
        default: unlink(b); _ = try? FileManager.default.copyItem(atPath: foreign, toPath: b)
        }
        return [rel]
    }

    /// A file of another store, to put under this store's names.
    static func foreignFile() throws -> (MountFixture, String) {
        let f = try MountFixture(passcode: "another store")
        f.unlock()
        XCTAssertEqual(writeFile(f.path("x"), Array(repeating: 7, count: 5000)), 0)
        XCTAssertEqual(setXattr(f.path("x"), "theirs", "user.note"), 0)  // a set for its xattrs/
        let b = f.backing("x")
        f.unmount()
        return (f, b)
    }

    func testHostileReplicaCrashesNothingAndChangesNothingUntouched() throws {
        let seed = UInt64(ProcessInfo.processInfo.environment["KBFS_HOSTILE_SEED"] ?? "") ?? UInt64(time(nil))
        print("hostile replica seed: \(seed) (KBFS_HOSTILE_SEED=\(seed) repeats it)")
        var rng = SeededBytes(seed: seed)
        let (other, foreign) = try Self.foreignFile()
        addTeardownBlock { other.close() }
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let files = Self.makeFiles(m, &rng)
        var t = Tally()
        var limits = Limits()
        // A bit flip or a file of another store since the last repair: damage fsck must name
        // (a swap, a FIFO, a cut or a hole need not be: they are valid entries and contents).
        var detectableSinceRepair = false, foreignRecords = false
        let names = files.keys.sorted()
        for round in 0..<6 {
            t.rounds += 1
            let mounted = round % 2 == 0
            if !mounted { m.unmount() }
            if !mounted {
                let metaKind = rng.int(0..<5)
                t.damaged.formUnion(Self.damageMetadata(metaKind, m, other.store, names, &rng))
                // Another store's device records stay (fsck leaves them to the user): named from now on.
                if metaKind == 4 { foreignRecords = true }
                t.mutations += 1
                if try mountOrRepair(m) { limits.repaired = true; detectableSinceRepair = false }
            }
            for _ in 0..<3 {
                let rel = names[rng.int(0..<names.count)]
                let partner = names[rng.int(0..<names.count)]
                if t.damaged.contains(rel) || t.damaged.contains(partner) { continue }
                let kind = rng.int(0..<8)
                let paths = (rel, m.backing(rel), partner, m.backing(partner))
                if !mounted { m.unmount() }
                let hit = Self.mutate(kind, paths, foreign, &rng)
                print(
                    "round \(round)\(mounted ? " (mounted)" : ""): mutation \(kind) of \(rel) (\(partner)) hit \(hit.sorted())"
                )
                if !mounted, try mountOrRepair(m) { limits.repaired = true; detectableSinceRepair = false }
                if kind == 3 && hit.count == 2 { limits.swapped[rel] = partner; limits.swapped[partner] = rel }
                if kind == 1 { limits.cut.formUnion(hit) }
                if (kind == 0 || kind == 7) && !hit.isEmpty { detectableSinceRepair = true }
                if kind == 2 { limits.grown.formUnion(hit) }
                t.mutations += 1
                t.damaged.formUnion(hit)
            }
            if mounted { usleep(1_500_000) }  // the daemon follows changes underneath
            t.exits += checkRound(
                m, files, t.damaged, limits, &t.untouchedChanged)
        }
        m.unmount()
        let report = m.fsck()
        if detectableSinceRepair { XCTAssertNotEqual(report.code, 0, "fsck names the damage: \(report.out)") }
        // Refused device records are listed but left alone (exit 0): a healthy store of several
        // devices has them for a while too (a record that came before its maker's certificate).
        if foreignRecords {
            XCTAssertTrue(report.problems.contains { $0.kind == "device-record-refused" }, "\(report.out)")
        }
        print("fsck before repair: exit \(report.code), \(report.problems.count) problems")
        _ = m.fsck(["--repair", "--yes"])
        limits.repaired = true
        try m.mount()
        m.unlock()
        t.exits += checkRound(
            m, files, t.damaged, limits, &t.untouchedChanged)
        print(
            "hostile replica: \(t.rounds) rounds, \(t.mutations) mutations, \(t.damaged.count) files damaged, "
                + "\(t.exits) daemon exits, \(t.untouchedChanged) untouched files changed")
        XCTAssertEqual(t.exits, 0)
        XCTAssertEqual(t.untouchedChanged, 0)
    }

    /// Between mounts, damage to the store's metadata: a folder's `.kbfs-dir`, the xattr sets,
    /// the journal, one of the keybag's siblings deleted, another store's device records and
    /// xattr sets copied in. Returns the files whose reading it may change.
    static func damageMetadata(
        _ kind: Int, _ m: MountFixture, _ otherStore: String, _ names: [String], _ rng: inout SeededBytes
    ) -> Set<String> {
        let fm = FileManager.default
        print("round between mounts: metadata damage \(kind)")
        switch kind {
        case 0:
            let fd = open(m.store + "/data/" + Self.folderBacking(m) + "/.kbfs-dir", O_RDWR)
            if fd >= 0 { _ = sysPwrite(fd, [0xff], 20); close(fd) }
            return Set(names.filter { $0.hasPrefix("dir/") })
        case 1:
            for x in (try? fm.contentsOfDirectory(atPath: m.store + "/xattrs")) ?? [] {
                truncate(m.store + "/xattrs/" + x, 3)
            }
        case 2:
            for j in (try? fm.contentsOfDirectory(atPath: m.store)) ?? [] where j.hasPrefix(".kbfs-journal-") {
                let fd = open(m.store + "/" + j, O_RDWR)
                if fd >= 0 { _ = sysPwrite(fd, rng.bytes(64), 8); close(fd) }
            }
        case 3:
            let siblings = ((try? fm.contentsOfDirectory(atPath: m.store)) ?? []).filter {
                $0 != "keybag" && $0 != "data"
            }
            if !siblings.isEmpty {
                let gone = siblings.sorted()[rng.int(0..<siblings.count)]
                print("deleting the keybag's sibling \(gone)")
                try? fm.removeItem(atPath: m.store + "/" + gone)
            }
        default:
            for folder in ["devices", "xattrs"] {
                try? fm.createDirectory(atPath: m.store + "/" + folder, withIntermediateDirectories: true)
                for x in (try? fm.contentsOfDirectory(atPath: otherStore + "/" + folder)) ?? [] {
                    try? fm.copyItem(
                        atPath: otherStore + "/" + folder + "/" + x, toPath: m.store + "/" + folder + "/" + x)
                }
            }
        }
        return []
    }

    /// Mounts; a refused mount must say why, then `fsck --repair` must make it mount (true).
    func mountOrRepair(_ m: MountFixture) throws -> Bool {
        do { try m.mount() } catch {
            let log = (try? String(contentsOfFile: m.root + "/daemon.log", encoding: .utf8)) ?? ""
            XCTAssertFalse(log.isEmpty, "a refused mount names its reason in the log")
            _ = m.fsck(["--repair", "--yes"])
            try m.mount()
            m.unlock()
            return true
        }
        m.unlock()
        return false
    }

    /// The backing name of the folder `dir`.
    static func folderBacking(_ m: MountFixture) -> String {
        ((try? FileManager.default.contentsOfDirectory(atPath: m.store + "/data")) ?? []).first {
            var st = stat()
            return lstat(m.store + "/data/" + $0, &st) == 0 && st.st_mode & S_IFMT == S_IFDIR
        } ?? "?"
    }

    /// What a damaged file may read besides an error and its own bytes.
    struct Limits {
        var swapped: [String: String] = [:], cut = Set<String>(), grown = Set<String>()
        /// `fsck --repair` ran: it cuts a torn tail back to the good blocks, turns a damaged
        /// inner block into a hole (zeros, as its report says), or empties a file whose key
        /// is lost; every other block keeps its bytes.
        var repaired = false

        /// Whether `got` is an allowed reading of damaged `rel` (original `want`).
        func allows(_ rel: String, _ got: [UInt8], _ want: [UInt8], _ files: [String: [UInt8]]) -> Bool {
            if got == want { return true }
            let partner = files[swapped[rel] ?? ""].map { Array($0.prefix(want.count + 8192)) }
            if got == partner { return true }
            if repaired
                && (HostileReplicaTests.blocksOrHoles(got, want)
                    || partner.map { HostileReplicaTests.blocksOrHoles(got, $0) } == true)
            {
                return true
            }
            if cut.contains(rel) && got.isEmpty { return true }
            return grown.contains(rel) && got.count > want.count && Array(got.prefix(want.count)) == want
                && got.dropFirst(want.count).allSatisfy { $0 == 0 } && want.count % 4096 == 0
        }
    }

    /// Whether `got` is `want` cut anywhere, with some of its 4 KiB blocks read as zeros.
    static func blocksOrHoles(_ got: [UInt8], _ want: [UInt8]) -> Bool {
        guard got.count <= want.count else { return false }
        return stride(from: 0, to: got.count, by: 4096).allSatisfy { at in
            let g = got[at..<min(at + 4096, got.count)]
            return g.elementsEqual(want[at..<at + g.count]) || g.allSatisfy { $0 == 0 }
        }
    }

    /// Checks every file, a lock and an unlock; returns 1 when the daemon is gone.
    func checkRound(
        _ m: MountFixture, _ files: [String: [UInt8]], _ damaged: Set<String>, _ limits: Limits, _ changed: inout Int
    ) -> Int {
        guard let pid = m.daemonPID, kill(pid, 0) == 0 else { XCTFail("the daemon exited"); return 1 }
        for (rel, want) in files.sorted(by: { $0.key < $1.key }) {
            let got = Self.readSome(m.path(rel), want.count + 8192)
            if !damaged.contains(rel) {
                if case .success(let b) = got, b == want { continue }
                changed += 1
                XCTFail("\(rel), untouched, read \(got.map(\.count)) instead of its \(want.count) bytes")
            } else if case .success(let b) = got, !limits.allows(rel, b, want, files) {
                XCTFail(
                    "\(rel), damaged, read \(b.count) other bytes instead of an error: \(b.prefix(8)) for \(want.prefix(8))"
                )
            }
        }
        m.lock()
        let aFile = files.keys.sorted().first { rel in
            !damaged.contains(rel) && (try? getXattr(m.path(rel)).get()) == "complete"
        }
        if let a = aFile {
            XCTAssertEqual(errnoOf(readFile(m.path(a))), EACCES, "\(a) is class complete and the device is locked")
        }
        m.unlock()
        if let a = aFile { XCTAssertTrue((try? readFile(m.path(a)).get()) == files[a], "\(a) after unlock") }
        return 0
    }
}
