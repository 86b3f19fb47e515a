import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// `keybagfs mount`.
struct Mount: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Mount a store. Returns once the mount is usable (or stays in the foreground with --foreground).",
        discussion:
            "The mount starts in state beforeFirstUnlock: only class none files are readable until `keybagctl "
            + "unlock`. Unmount with `fusermount3 -u MOUNTPOINT`; the daemon then exits."
    )

    @Argument(help: "The store directory.")
    var store: String

    @Argument(help: "Where to mount it.")
    var mountpoint: String

    @Option(help: "Control socket path (default /run/keybagfs/<escaped mountpoint>.sock).")
    var socket: String?

    @Option(help: "Device key file (default /var/lib/keybagfs/<store-id>.key).")
    var deviceKey: String?

    @Option(help: "Class of new files where no ancestor directory sets user.protection.")
    var defaultClass: ProtectionClass = .completeUntilFirstUserAuthentication

    @Option(help: "Seconds between a lock request and key eviction (0 allowed).")
    var grace: Double = 10

    @Option(
        help: ArgumentHelp(
            "Policy file: one `PATTERN CLASS` per line; a directory created at a matching path (relative to the "
                + "mount root, `*` within a name, leading `**/` for any depth) gets CLASS as its default. The last "
                + "matching rule wins.")
    )
    var policy: String?

    @Option(
        name: .customLong("policy-rule"),
        help: "One more policy rule, PATTERN=CLASS (e.g. Documents=complete); after the file's rules.")
    var policyRules: [String] = []

    @Option(help: "User (name or uid) who may lock, unlock and passwd besides root (default: the user who mounts).")
    var owner: String?

    @Option(
        help: ArgumentHelp(
            "Hours locked (suspend included) after which class completeUntilFirstUserAuthentication goes too and the "
                + "state returns to beforeFirstUnlock (iOS: 72). Default: never.")
    )
    var inactivityRelock: Double?

    @Flag(help: "Stay in the foreground (for systemd Type=notify).")
    var foreground = false

    @Flag(
        help: ArgumentHelp(
            "Send every write to the daemon at once instead of through the kernel's write-back cache (slower; a full "
                + "disk then fails the write() itself rather than the later fsync() or close()).")
    )
    var noWritebackCache = false

    @Option(
        help: ArgumentHelp(
            "Watch the store for changes another writer makes (a sync engine): auto (in full when the store has "
                + "another device or lies in a folder a sync engine marks, such as Syncthing's .stfolder; otherwise "
                + "from the first change another process makes at the store's top level), on (always: engines that "
                + "leave no " + "marker, such as rclone or Unison), off (the daemon is the only writer).")
    )
    var watchStore: StoreSharing.Mode = .auto

    @Option(help: "Most threads serving FUSE requests at once (1-256); each waits in its own clone of /dev/fuse.")
    var threads: Int = MountConfiguration.defaultThreads

    @Option(
        name: .customShort("o"),
        help: ArgumentHelp(
            "FUSE mount options, comma separated (e.g. allow_other; suid,dev: set-ID programs and device files work, "
                + "root only, as on ext4; without them the mount is nosuid,nodev).")
    )
    var options: [String] = []

    @Option(help: "The TPM's TCTI when it is not the one this device enrolled (e.g. swtpm:host=127.0.0.1,port=2321).")
    var tpm2Device: String?

    @Option(help: .hidden)
    var readyFd: Int32?

    /// `-o acl` / `-o noacl` (nil: ACLs where the kernel checks permissions).
    var posixACL: Bool? = nil

    /// keybagfs' own settings inside `-o` (fstab and mount.fuse3 pass everything there):
    /// `device-key=`, `tpm2-device=`, `socket=`, `default-class=`, `grace=`, `policy=`, `owner=`,
    /// `inactivity-relock=`, `no-writeback-cache`, `watch-store=`, `threads=`, `acl`, `noacl`; mount(8)'s own
    /// words are dropped; the rest goes to FUSE.
    mutating func takeOwnOptions() throws {
        var fuse: [String] = []
        for o in options.flatMap({ $0.split(separator: ",").map(String.init) }) where !o.isEmpty {
            let (key, value) =
                o.firstIndex(of: "=").map { (String(o[..<$0]), String(o[o.index(after: $0)...])) } ?? (o, "")
            switch key {
            case "device-key": deviceKey = value
            case "tpm2-device": tpm2Device = value
            case "socket": socket = value
            case "policy": policy = value
            case "owner": owner = value
            case "default-class":
                guard let c = ProtectionClass(name: value) else {
                    throw ValidationError("-o default-class=\(value): unknown class")
                }
                defaultClass = c
            case "grace":
                guard let g = Double(value) else { throw ValidationError("-o grace=\(value): not a number of seconds") }
                grace = g
            case "no-writeback-cache": noWritebackCache = true
            case "watch-store":
                guard let m = StoreSharing.Mode(rawValue: value) else {
                    throw ValidationError("-o watch-store=\(value): auto, on or off")
                }
                watchStore = m
            case "acl": posixACL = true
            case "noacl": posixACL = false
            case "threads":
                guard let n = Int(value) else { throw ValidationError("-o threads=\(value): not a number") }
                threads = n
            case "inactivity-relock":
                guard let h = Double(value) else {
                    throw ValidationError("-o inactivity-relock=\(value): not a number of hours")
                }
                inactivityRelock = h
            // mount(8) and systemd words that are not FUSE's (mount.fuse3 passes some through).
            // `suid` and `dev` go on to FUSE: the mount is nosuid,nodev unless they are given.
            case "defaults", "auto", "noauto", "user", "nouser", "users", "_netdev", "nofail", "rw", "exec", "atime",
                "relatime":
                continue
            default:
                if key.hasPrefix("x-") || key.hasPrefix("comment=") { continue }
                fuse.append(o)
            }
        }
        options = fuse.isEmpty ? [] : [fuse.joined(separator: ",")]
    }

    /// The owner's uid: a number or a user name.
    func ownerUID() throws -> uid_t? {
        guard let owner else { return nil }
        if let n = UInt32(owner) { return n }
        guard let pw = getpwnam(owner) else { throw ValidationError("--owner \(owner): no such user") }
        return pw.pointee.pw_uid
    }

    mutating func validate() throws {
        try takeOwnOptions()
        if let h = inactivityRelock, !(h > 0 && h.isFinite && h <= 24 * 365) {
            throw ValidationError("--inactivity-relock must be more than 0 and at most 8760 hours")
        }
        _ = try ownerUID()
        guard (1...256).contains(threads) else { throw ValidationError("--threads must be 1 to 256") }
        guard grace >= 0, grace.isFinite else { throw ValidationError("--grace must be 0 or more seconds") }
        var isDir: ObjCBool = false
        guard FileManager.default.fileExists(atPath: mountpoint, isDirectory: &isDir), isDir.boolValue else {
            throw ValidationError("mount point \(mountpoint) is not a directory")
        }
    }

    /// The policy from --policy and --policy-rule, or a usage error naming the bad line.
    func classPolicy() throws -> ClassPolicy {
        var p = ClassPolicy()
        if let policy {
            guard let text = try? String(contentsOfFile: policy, encoding: .utf8) else {
                throw ValidationError("cannot read the policy file \(policy)")
            }
            do { p = try ClassPolicy(text: text) } catch { throw ValidationError("policy file \(policy): \(error)") }
        }
        for r in policyRules {
            do { try p.add(r) } catch { throw ValidationError("--policy-rule \(r): \(error)") }
        }
        return p
    }

    func run() throws {
        _ = try Keybag.load(storePath: store)  // a clear error before any daemon starts
        let policy = try classPolicy()
        let socketPath = socket ?? ControlPaths.defaultSocket(forMountpoint: mountpoint)
        let fuseOptions = options.flatMap { $0.split(separator: ",").map(String.init) }.filter { !$0.isEmpty }
        if foreground {
            if let readyFd {
                setsid()
                Launcher.closeInheritedDescriptors(keeping: readyFd)
            }
            var cfg = MountConfiguration(
                store: store, mountpoint: mountpoint, socketPath: socketPath, deviceKeyPath: deviceKey,
                defaultClass: defaultClass, grace: grace, fuseOptions: fuseOptions, readyFD: readyFd)
            cfg.policy = policy
            cfg.owner = try ownerUID()
            cfg.inactivityRelock = inactivityRelock.map { $0 * 3600 }
            cfg.writebackCache = !noWritebackCache
            cfg.watchStore = watchStore
            cfg.posixACL = posixACL
            cfg.threads = threads
            cfg.tpm2Device = tpm2Device
            let rc = MountDaemon.run(cfg)
            if rc != 0 { throw ExitCode(rc) }
            return
        }
        try Launcher.spawnDaemon(
            arguments: Array(CommandLine.arguments.dropFirst()) + ["--foreground", "--ready-fd", "3"])
    }
}
