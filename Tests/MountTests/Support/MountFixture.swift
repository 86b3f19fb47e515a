import CFuse
import Foundation
import Glibc
import KeybagProtocol
import XCTest

/// An errno value as an Error.
struct Errno: Error, Equatable {
    let rawValue: Int32
    init(_ v: Int32) { rawValue = v }
}

/// Result of running a command-line tool.
struct ToolResult {
    let code: Int32
    let stdout: String
    let stderr: String
}

/// Runs a shell command as another user (no supplementary groups).
func asUser(_ uid: Int, _ script: String) -> ToolResult {
    MountFixture.run(
        "/usr/bin/setpriv", ["--reuid=\(uid)", "--regid=\(uid)", "--clear-groups", "/bin/sh", "-c", script])
}

/// A temporary store mounted by the real daemon binary in its own process. Tests act on
/// `mnt` with real syscalls; `close()` always unmounts and reaps the daemon.
final class MountFixture {
    /// Folder holding the built `keybagfs` and `keybagctl` (beside the test bundle).
    static let binDir: String = {
        let exe =
            (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/exe")) ?? CommandLine.arguments[0]
        var dir = URL(fileURLWithPath: exe).deletingLastPathComponent()
        while dir.path != "/" && !FileManager.default.fileExists(atPath: dir.appendingPathComponent("keybagfs").path) {
            dir = dir.deletingLastPathComponent()
        }
        return dir.path
    }()

    let root: String
    let store: String
    let mnt: String
    let socket: String
    let deviceKey: String
    let passcode: String
    var grace: Double
    var defaultClass: String?
    private(set) var daemon: Process?
    /// The daemon `mount -t fuse.keybagfs` started (it detaches), by the pid it reports.
    private var detachedDaemon: pid_t?
    private var closed = false

    /// Creates a store (Argon2id interactive, for speed) and mounts it in the foreground.
    /// `cipher`: `init --cipher` (nil: the default of this machine).
    /// `initArgs`: more arguments of `keybagfs init` (`--tpm2 on --tpm2-device …`).
    convenience init(
        passcode: String = "correct horse battery", grace: Double = 0, defaultClass: String? = nil,
        kdf: String = "interactive",
        cipher: String? = nil, initArgs: [String] = [], mount: Bool = true
    ) throws {
        guard FileManager.default.fileExists(atPath: "/dev/fuse") else {
            throw NSError(
                domain: "/dev/fuse is missing: the mount tests need FUSE (they fail rather than skip)", code: 1)
        }
        try self.init(root: try Self.makeRoot(), passcode: passcode, grace: grace, defaultClass: defaultClass)
        let r = Self.run(
            Self.binDir + "/keybagfs",
            ["init", store, "--passcode-stdin", "--device-key", deviceKey, "--kdf", kdf]
                + (cipher.map { ["--cipher", $0] } ?? []) + initArgs, stdin: passcode + "\n")
        guard r.code == 0 else { throw NSError(domain: "keybagfs init failed: \(r.stderr)", code: Int(r.code)) }
        if mount { try self.mount() }
    }

    /// A second device's replica of `other`'s store (as a sync engine would copy it; with
    /// `copy` false the store is left for a real sync engine to fill), with its own mount
    /// point, socket and (not yet made) device key; not mounted.
    convenience init(replicaOf other: MountFixture, passcode: String, copy: Bool = true) throws {
        try self.init(root: try Self.makeRoot(), passcode: passcode, grace: 0, defaultClass: nil)
        guard copy else { return }
        let r = Self.run("/bin/cp", ["-a", other.store, store])
        guard r.code == 0 else { throw NSError(domain: "cp -a failed: \(r.stderr)", code: Int(r.code)) }
    }

    /// The paths of a fixture in `root`, its mount point made. Key-set floors (`KeySetFloor`)
    /// of the tools and daemons it starts go to the test's state folder, not /var/lib.
    private init(root: String, passcode: String, grace: Double, defaultClass: String?) throws {
        setenv("STATE_DIRECTORY", "/tmp/kbfs-test-state", 1)
        self.root = root
        store = root + "/store"
        mnt = root + "/mnt"
        socket = root + "/ctl.sock"
        deviceKey = root + "/device.key"
        self.passcode = passcode
        self.grace = grace
        self.defaultClass = defaultClass
        try FileManager.default.createDirectory(atPath: mnt, withIntermediateDirectories: true)
    }

    deinit { close() }

    /// A new temporary folder for one fixture (mode 0755: other users' tests reach the mount).
    static func makeRoot() throws -> String {
        var buf = Array("/tmp/kbfs-test.XXXXXX".utf8CString)
        guard let p = mkdtemp(&buf) else { throw NSError(domain: "mkdtemp", code: Int(errno)) }
        let root = String(cString: p)
        chmod(root, 0o755)
        return root
    }

    /// Path inside the mount.
    func path(_ rel: String) -> String { mnt + "/" + rel }

    /// The backing file in the store of a path in the (mounted) mount, found by inode
    /// number, since names in the store are encrypted.
    func backing(_ rel: String) -> String {
        var st = stat()
        guard lstat(path(rel), &st) == 0 else { return "/nonexistent-backing-of-" + rel }
        let data = store + "/data"
        let e = FileManager.default.enumerator(atPath: data)!
        while let r = e.nextObject() as? String {
            var b = stat()
            if lstat(data + "/" + r, &b) == 0 && b.st_ino == st.st_ino && b.st_dev != st.st_dev {
                return data + "/" + r
            }
        }
        return "/nonexistent-backing-of-" + rel
    }

    /// Starts the daemon (`--foreground`) and waits until the mount is live.
    func mount(extra: [String] = [], launcher: [String] = [], environment: [String: String] = [:]) throws {
        let p = Process()
        if !environment.isEmpty { p.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 } }
        var args = [
            "mount", store, mnt, "--foreground", "--socket", socket, "--device-key", deviceKey, "--grace",
            String(grace),
        ]
        if let defaultClass { args += ["--default-class", defaultClass] }
        if let first = launcher.first {
            p.executableURL = URL(fileURLWithPath: first)
            p.arguments = Array(launcher.dropFirst()) + [Self.binDir + "/keybagfs"] + args + extra
        } else {
            p.executableURL = URL(fileURLWithPath: Self.binDir + "/keybagfs")
            p.arguments = args + extra
        }
        let log =
            FileManager.default.createFile(atPath: root + "/daemon.log", contents: nil)
            ? Foundation.FileHandle(forWritingAtPath: root + "/daemon.log") : nil
        p.standardError = log
        p.standardOutput = log
        p.standardInput = Foundation.FileHandle.nullDevice
        try p.run()
        daemon = p
        let deadline = Date().addingTimeInterval(15)
        while Date() < deadline {
            if isMounted && FileManager.default.fileExists(atPath: socket) { return }
            if !p.isRunning { break }
            usleep(20_000)
        }
        let logText = (try? String(contentsOfFile: root + "/daemon.log", encoding: .utf8)) ?? ""
        throw NSError(domain: "mount did not come up: \(logText)", code: 1)
    }

    /// Mounts as fstab does: `mount -t fuse.keybagfs STORE MNT -o OPTIONS` runs fuse3's
    /// `mount.fuse3 STORE MNT -t fuse.keybagfs -o OPTIONS`, which runs `keybagfs STORE MNT
    /// -o …` from PATH (mount(8) itself resets PATH, so the test calls mount.fuse3 with the
    /// built binaries first in PATH); keybagfs' own settings go inside `-o`. The daemon
    /// detaches; teardown waits for it by the pid it reports.
    func mountWithMountCommand(options: String) throws {
        var o = "device-key=\(deviceKey),socket=\(socket),grace=\(grace)"
        if !options.isEmpty { o += "," + options }
        let path = Self.binDir + ":" + (ProcessInfo.processInfo.environment["PATH"] ?? "/usr/sbin:/usr/bin:/sbin:/bin")
        let r = Self.run(
            "/sbin/mount.fuse3", [store, mnt, "-t", "fuse.keybagfs", "-o", o], environment: ["PATH": path])
        guard r.code == 0 else {
            throw NSError(domain: "mount.fuse3 -t fuse.keybagfs failed: \(r.stderr)", code: Int(r.code))
        }
        guard let pid = status()["pid"] as? Int else {
            throw NSError(domain: "no pid in the status of \(mnt)", code: 1)
        }
        detachedDaemon = pid_t(pid)
    }

    /// Whether `mnt` is a mount point now.
    /// The daemon's pid while one runs (foreground or detached).
    var daemonPID: pid_t? { daemon?.processIdentifier ?? detachedDaemon }

    var isMounted: Bool {
        let info = ProcFile.read("/proc/self/mountinfo") ?? ""
        return info.split(separator: "\n").contains {
            $0.split(separator: " ").count > 4 && $0.split(separator: " ")[4] == Substring(mnt)
        }
    }

    /// Unmounts and reaps the daemon (SIGKILL after 10 s).
    func unmount() {
        if isMounted { _ = Self.run("/bin/fusermount3", ["-u", mnt]) }
        if let p = daemon {
            let deadline = Date().addingTimeInterval(10)
            while p.isRunning && Date() < deadline { usleep(20_000) }
            if p.isRunning { kill(p.processIdentifier, SIGKILL); p.waitUntilExit() }
        }
        if let pid = detachedDaemon {
            let deadline = Date().addingTimeInterval(10)
            while kill(pid, 0) == 0 && Date() < deadline { usleep(20_000) }
            if kill(pid, 0) == 0 { kill(pid, SIGKILL) }
        }
        detachedDaemon = nil
        if isMounted { _ = Self.run("/bin/umount", ["-l", mnt]) }
        daemon = nil
    }

    /// Unmounts, then mounts again: a daemon restart ("reboot").
    func restart() throws {
        unmount()
        try mount()
    }

    /// Unmounts and deletes everything.
    func close() {
        guard !closed else { return }
        closed = true
        unmount()
        try? FileManager.default.removeItem(atPath: root)
    }

    /// `keybagfs fsck --json` of the store (with the passcode unless told not to): the exit
    /// code, the problems (kind, repair) sorted by kind, and the whole report.
    func fsck(_ extra: [String] = [], passcode: Bool = true) -> (
        code: Int32, problems: [(kind: String, repair: String)], out: [String: Any]
    ) {
        var args = ["fsck", store, "--device-key", deviceKey, "--json"] + extra
        if passcode { args.append("--passcode-stdin") }
        let r = Self.run(Self.binDir + "/keybagfs", args, stdin: passcode ? self.passcode + "\n" : nil)
        let o = (try? JSONSerialization.jsonObject(with: Data(r.stdout.utf8))) as? [String: Any] ?? ["stderr": r.stderr]
        let ps = (o["problems"] as? [[String: Any]] ?? []).map {
            ($0["kind"] as? String ?? "?", $0["repair"] as? String ?? "?")
        }
        return (r.code, ps.sorted { $0.0 < $1.0 }, o)
    }

    /// Runs keybagctl against this mount's socket.
    @discardableResult
    func ctl(_ args: [String], stdin: String? = nil) -> ToolResult {
        Self.run(Self.binDir + "/keybagctl", ["--socket", socket] + args, stdin: stdin)
    }

    /// Unlocks with the passcode; fails the test on refusal.
    func unlock(file: StaticString = #filePath, line: UInt = #line) {
        let r = ctl(["unlock", "--passcode-stdin"], stdin: passcode + "\n")
        XCTAssertEqual(r.code, 0, "unlock failed: \(r.stderr)", file: file, line: line)
    }

    /// Locks with a grace period.
    func lock(grace: Double = 0, file: StaticString = #filePath, line: UInt = #line) {
        let r = ctl(["lock", "--grace", String(grace)])
        XCTAssertEqual(r.code, 0, "lock failed: \(r.stderr)", file: file, line: line)
    }

    /// The daemon's status object.
    func status() -> [String: Any] {
        let r = ctl(["status", "--json"])
        guard r.code == 0, let d = r.stdout.data(using: .utf8),
            let o = try? JSONSerialization.jsonObject(with: d) as? [String: Any]
        else { return [:] }
        return o
    }

    /// The lock state name.
    var state: String { status()["state"] as? String ?? "?" }

    /// Runs a tool in a mount namespace of its own in which `mount` is the only keybagfs
    /// mount: the others are detached in that namespace only, and the machine's mounts are
    /// not touched. Tests of discovery (`keybagctl` without `--mount`, `pam-unlock`) then
    /// pass whatever keybagfs mounts the user has up.
    static func runAlone(
        mount: String, _ exe: String, _ args: [String], stdin: String? = nil, environment: [String: String] = [:]
    ) -> ToolResult {
        let detachOthers =
            #"keep="$1"; shift; awk -v keep="$keep" '$3 == "fuse.keybagfs" && $2 != keep {print $2}' /proc/self/mounts | "#
            + #"sort -r | while read -r m; do umount -l "$(printf '%b' "$m")" || exit 97; done; exec "$@""#
        return run(
            "/usr/bin/unshare",
            ["--mount", "--propagation", "private", "/bin/sh", "-c", detachOthers, "sh", mount, exe] + args,
            stdin: stdin, environment: environment)
    }

    /// Runs a program, feeding `stdin`, and collects its output.
    static func run(
        _ exe: String, _ args: [String], stdin: String? = nil, timeout: Double = 60,
        environment: [String: String] = [:],
        cwd: String? = nil
    ) -> ToolResult {
        let p = Process()
        p.executableURL = URL(fileURLWithPath: exe)
        p.arguments = args
        if let cwd { p.currentDirectoryURL = URL(fileURLWithPath: cwd) }
        if !environment.isEmpty { p.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 } }
        let out = Pipe(), err = Pipe(), inp = Pipe()
        p.standardOutput = out
        p.standardError = err
        p.standardInput = stdin == nil ? Foundation.FileHandle.nullDevice : inp
        do { try p.run() } catch { return ToolResult(code: -1, stdout: "", stderr: "\(error)") }
        if let stdin {
            inp.fileHandleForWriting.write(Data(stdin.utf8))
            try? inp.fileHandleForWriting.close()
        }
        let o = out.fileHandleForReading.readDataToEndOfFile()
        let e = err.fileHandleForReading.readDataToEndOfFile()
        p.waitUntilExit()
        return ToolResult(
            code: p.terminationStatus, stdout: String(decoding: o, as: UTF8.self),
            stderr: String(decoding: e, as: UTF8.self))
    }
}

extension XCTestCase {
    /// A new store on a tmpfs of `size` (e.g. "3m"), or on an image of that size on a loop
    /// device with `mkfs` (ext4 without a root reserve; btrfs mounted `noacl`, a filesystem
    /// without POSIX ACLs), mounted (with `mountOptions` and `environment` for the daemon) and
    /// unlocked; torn down with the test.
    /// `rootReserve`: ext4 as mkfs makes it (5 % kept for root). `mountCommandOptions`: mounted
    /// by `mount -t fuse.keybagfs` with these options instead of `keybagfs mount`.
    func mountedSmallStore(
        _ size: String, ext4: Bool = false, btrfsWithoutACLs: Bool = false, rootReserve: Bool = false,
        environment: [String: String] = [:], mountOptions: [String] = [],
        mountCommandOptions: String? = nil
    ) throws -> MountFixture {
        let m = try MountFixture(mount: false)
        XCTAssertEqual(MountFixture.run("/bin/cp", ["-a", m.store, m.root + "/store.orig"]).code, 0)
        if ext4 || btrfsWithoutACLs {
            let image = m.root + "/store.img"
            XCTAssertEqual(MountFixture.run("/usr/bin/truncate", ["-s", size, image]).code, 0)
            let made =
                ext4
                ? MountFixture.run("/sbin/mkfs.ext4", ["-q", "-F"] + (rootReserve ? [] : ["-m", "0"]) + [image])
                : MountFixture.run("/sbin/mkfs.btrfs", ["-q", "-f", image])
            XCTAssertEqual(made.code, 0, "mkfs: \(made.stderr)")
            XCTAssertEqual(
                MountFixture.run("/bin/mount", ["-o", ext4 ? "loop" : "loop,noacl", image, m.store]).code, 0,
                "an image on a loop device (needs root)")
        } else {
            XCTAssertEqual(
                MountFixture.run("/bin/mount", ["-t", "tmpfs", "-o", "size=" + size, "tmpfs", m.store]).code, 0,
                "a small store (needs root)")
        }
        addTeardownBlock {
            m.unmount()
            _ = MountFixture.run("/bin/umount", [m.store])
            m.close()
        }
        XCTAssertEqual(MountFixture.run("/bin/cp", ["-a", m.root + "/store.orig/.", m.store]).code, 0)
        if let mountCommandOptions {
            try m.mountWithMountCommand(options: mountCommandOptions)
        } else {
            try m.mount(extra: mountOptions, environment: environment)
        }
        m.unlock()
        return m
    }
}

// MARK: syscall helpers returning errno

/// open(2): the descriptor or -errno.
func sysOpen(_ path: String, _ flags: Int32, _ mode: mode_t = 0o644) -> Int32 {
    let fd = open(path, flags | O_CLOEXEC, mode)
    return fd >= 0 ? fd : -errno
}

/// pread(2): the bytes or the errno.
func sysPread(_ fd: Int32, _ count: Int, _ offset: Int) -> Result<[UInt8], Errno> {
    var buf = [UInt8](repeating: 0, count: count)
    let n = pread(fd, &buf, count, off_t(offset))
    if n < 0 { return .failure(Errno(errno)) }
    return .success(Array(buf[0..<n]))
}

/// pwrite(2): bytes written or the errno.
func sysPwrite(_ fd: Int32, _ bytes: [UInt8], _ offset: Int) -> Result<Int, Errno> {
    let n = pwrite(fd, bytes, bytes.count, off_t(offset))
    if n < 0 { return .failure(Errno(errno)) }
    return .success(n)
}

/// The errno of a Result, or 0.
func errnoOf<T>(_ r: Result<T, Errno>) -> Int32 {
    if case .failure(let e) = r { return e.rawValue }
    return 0
}

/// Reads a whole file, or the errno.
func readFile(_ path: String) -> Result<[UInt8], Errno> {
    let fd = open(path, O_RDONLY | O_CLOEXEC)
    guard fd >= 0 else { return .failure(Errno(errno)) }
    defer { close(fd) }
    var out: [UInt8] = []
    var buf = [UInt8](repeating: 0, count: 65536)
    while true {
        let n = read(fd, &buf, buf.count)
        if n < 0 { return .failure(Errno(errno)) }
        if n == 0 { break }
        out += buf[0..<n]
    }
    return .success(out)
}

/// Creates a file with content; returns 0 or errno.
@discardableResult
func writeFile(_ path: String, _ bytes: [UInt8], mode: mode_t = 0o644) -> Int32 {
    let fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode)
    guard fd >= 0 else { return errno }
    defer { close(fd) }
    var off = 0
    while off < bytes.count {
        let n = write(fd, Array(bytes[off...]), bytes.count - off)
        if n < 0 { return errno }
        off += n
    }
    return 0
}

/// getxattr of user.protection (or another name): the value or the errno.
func getXattr(_ path: String, _ name: String = "user.protection") -> Result<String, Errno> {
    let size = getxattr(path, name, nil, 0)
    if size < 0 { return .failure(Errno(errno)) }
    var buf = [UInt8](repeating: 0, count: max(size, 1))
    let n = getxattr(path, name, &buf, buf.count)
    if n < 0 { return .failure(Errno(errno)) }
    return .success(String(decoding: buf[0..<n], as: UTF8.self))
}

/// setxattr: 0 or errno.
func setXattr(_ path: String, _ value: String, _ name: String = "user.protection", flags: Int32 = 0) -> Int32 {
    let b = Array(value.utf8)
    return setxattr(path, name, b, b.count, flags) == 0 ? 0 : errno
}

/// fsetxattr: 0 or errno.
func fsetXattr(_ fd: Int32, _ value: String, _ name: String = "user.protection") -> Int32 {
    let b = Array(value.utf8)
    return fsetxattr(fd, name, b, b.count, 0) == 0 ? 0 : errno
}

/// Bytes of a string.
func bytes(_ s: String) -> [UInt8] { Array(s.utf8) }

/// Deterministic pseudo-random bytes (xorshift) for content tests.
struct SeededBytes {
    var state: UInt64
    init(seed: UInt64) { state = seed | 1 }
    mutating func next() -> UInt64 {
        state ^= state << 13; state ^= state >> 7; state ^= state << 17
        return state
    }
    mutating func bytes(_ n: Int) -> [UInt8] { (0..<n).map { _ in UInt8(truncatingIfNeeded: next()) } }
    mutating func int(_ range: Range<Int>) -> Int { range.lowerBound + Int(next() % UInt64(range.count)) }
}

/// Polls `condition` every 20 ms for up to `seconds`; true once it holds.
func waitUntil(_ seconds: Double = 5, _ condition: () -> Bool) -> Bool {
    let deadline = Date().addingTimeInterval(seconds)
    while !condition() {
        if Date() >= deadline { return false }
        usleep(20_000)
    }
    return true
}
