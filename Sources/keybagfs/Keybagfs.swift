import ArgumentParser
import CSystem
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// `keybagfs`: create a store, mount it.
@main
struct Keybagfs: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "keybagfs",
        abstract: "iOS-style Data Protection for a directory: an encrypted FUSE filesystem with four protection classes.",
        discussion: """
        Create a store once with `keybagfs init`, mount it with `keybagfs mount`, then unlock and lock it \
        with `keybagctl`. Each file's class is the xattr user.protection (none, \
        completeUntilFirstUserAuthentication, completeUnlessOpen, complete).
        """,
        subcommands: [Init.self, Mount.self, Fsck.self, Recover.self, RecoveryKeyCommand.self, CipherCommand.self])

    /// Runs the command; usage errors exit 2, refusals 1.
    static func main() {
        _ = kbfs_set_nondumpable()   // passcodes and recovery keys pass through this process
        runWithContractExitCodes(tool: "keybagfs", arguments: Self.mountHelperArguments(Array(CommandLine.arguments.dropFirst())))
    }

    /// `mount -t fuse.keybagfs STORE DIR -o OPTS` runs `keybagfs STORE DIR -o OPTS` (fuse3's
    /// mount.fuse3): arguments that start with neither a subcommand nor an option are a mount.
    static func mountHelperArguments(_ args: [String]) -> [String] {
        let names = configuration.subcommands.map { $0._commandName } + ["help"]
        guard args.count >= 2, let first = args.first, !first.hasPrefix("-"), !names.contains(first) else { return args }
        return ["mount"] + args
    }
}

/// Parses a class name or Apple alias for an option.
extension ProtectionClass: ExpressibleByArgument {
    public init?(argument: String) { self.init(name: argument) }
    public static var allValueStrings: [String] { allCases.map(\.name) }
}

extension KDFStrength: ExpressibleByArgument {}

/// Parses a content cipher name for `init --cipher`.
extension ContentCipher: ExpressibleByArgument {
    public init?(argument: String) { self.init(name: argument) }
    public static var allValueStrings: [String] { allCases.map(\.name) }
}

/// `keybagfs init`.
struct Init: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Create a new store: keybag, class keys and the device key.",
        discussion: "The passcode is asked on the terminal (twice), or read as one line from stdin with --passcode-stdin. It is never taken from the command line.")

    @Argument(help: "The store directory to create (must be absent or empty).")
    var store: String

    @Flag(help: "Read the passcode as one line from standard input.")
    var passcodeStdin = false

    @Option(help: "Device key file (default /var/lib/keybagfs/<store-id>.key). An existing 32-byte key is reused.")
    var deviceKey: String?

    @Option(help: "Argon2id cost: interactive, moderate or sensitive.")
    var kdf: KDFStrength = .moderate

    @Option(help: "Content cipher: xaes256gcm (the default where the CPU has AES instructions), xchacha20poly1305 (the default elsewhere) or aes256gcm (at most 2^32 block writes per file key; for compatibility only).")
    var cipher: ContentCipher = .default

    @Option(help: "Write the recovery key to this new file (mode 0600) instead of printing it.")
    var recoveryKeyFile: String?

    @Flag(help: "Make no recovery key: a lost passcode or device key then loses the store.")
    var noRecoveryKey = false

    func run() throws {
        let fm = FileManager.default
        var isDir: ObjCBool = false
        if fm.fileExists(atPath: store, isDirectory: &isDir) {
            guard isDir.boolValue else { throw KeybagError.invalid("\(store) exists and is not a directory") }
            let items = try fm.contentsOfDirectory(atPath: store)
            guard items.isEmpty else { throw KeybagError.invalid("\(store) is not empty; refusing to initialise over existing data") }
        } else {
            try fm.createDirectory(atPath: store, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        }
        let passcode = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "New passcode: ")
        defer { passcode.wipe() }
        if !passcodeStdin {
            let again = try PasscodeInput.prompt("Repeat passcode: ")
            defer { again.wipe() }
            guard PasscodeInput.equal(passcode, again) else { throw KeybagError.invalid("the passcodes differ; nothing was created") }
        }
        let storeID = Sodium.randomArray(16).map { String(format: "%02x", $0) }.joined()
        let dkPath = deviceKey ?? DeviceKeyFile.defaultPath(storeID: storeID)
        let dk = fm.fileExists(atPath: dkPath) ? try DeviceKeyFile.load(from: dkPath) : try DeviceKeyFile.create(at: dkPath)
        defer { dk.wipe() }
        guard cipher.isAvailable else { throw KeybagError.invalid("this CPU cannot run \(cipher.name)") }
        guard !(noRecoveryKey && recoveryKeyFile != nil) else { throw ValidationError("--no-recovery-key and --recovery-key-file exclude each other") }
        let recovery = noRecoveryKey ? nil : RecoveryKey.generate()
        defer { recovery?.wipe() }
        // The recovery key is handed out first: if that fails, no store exists whose key nobody has.
        if let recovery { try RecoveryKeyOutput.give(recovery, file: recoveryKeyFile) }
        let kb = try Keybag.create(storePath: store, storeID: storeID, passcode: passcode, deviceKey: dk, strength: kdf, cipher: cipher, recovery: recovery)
        try fm.createDirectory(atPath: store + "/" + Keybag.dataDirName, withIntermediateDirectories: false, attributes: [.posixPermissions: 0o755])
        print("initialised store \(store)")
        print("  store id:   \(kb.file.storeID)")
        print("  cipher:     \(kb.file.cipher)")
        print("  device key: \(dkPath)  (keep it; without it the store cannot be opened)")
    }
}

/// `keybagfs mount`.
struct Mount: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Mount a store. Returns once the mount is usable (or stays in the foreground with --foreground).",
        discussion: "The mount starts in state beforeFirstUnlock: only class none files are readable until `keybagctl unlock`. Unmount with `fusermount3 -u MOUNTPOINT`; the daemon then exits.")

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

    @Option(help: "Policy file: one `PATTERN CLASS` per line; a directory created at a matching path (relative to the mount root, `*` within a name, leading `**/` for any depth) gets CLASS as its default. The last matching rule wins.")
    var policy: String?

    @Option(name: .customLong("policy-rule"), help: "One more policy rule, PATTERN=CLASS (e.g. Documents=complete); after the file's rules.")
    var policyRules: [String] = []

    @Option(help: "User (name or uid) who may lock, unlock and passwd besides root (default: the user who mounts).")
    var owner: String?

    @Option(help: "Hours locked (suspend included) after which class completeUntilFirstUserAuthentication goes too and the state returns to beforeFirstUnlock (iOS: 72). Default: never.")
    var inactivityRelock: Double?

    @Flag(help: "Stay in the foreground (for systemd Type=notify).")
    var foreground = false

    @Flag(help: "Send every write to the daemon at once instead of through the kernel's write-back cache (slower; a full disk then fails the write() itself rather than the later fsync() or close()).")
    var noWritebackCache = false

    @Option(help: "Most threads serving FUSE requests at once (1-256); each waits in its own clone of /dev/fuse.")
    var threads: Int = MountConfiguration.defaultThreads

    @Option(name: .customShort("o"), help: "FUSE mount options, comma separated (e.g. allow_other; suid,dev: set-ID programs and device files work, root only, as on ext4; without them the mount is nosuid,nodev).")
    var options: [String] = []

    @Option(help: .hidden)
    var readyFd: Int32?

    /// `-o acl` / `-o noacl` (nil: ACLs where the kernel checks permissions).
    var posixACL: Bool? = nil

    /// keybagfs' own settings inside `-o` (fstab and mount.fuse3 pass everything there):
    /// `device-key=`, `socket=`, `default-class=`, `grace=`, `policy=`, `owner=`,
    /// `inactivity-relock=`, `no-writeback-cache`, `threads=`, `acl`, `noacl`; mount(8)'s own words are dropped; the rest goes to FUSE.
    mutating func takeOwnOptions() throws {
        var fuse: [String] = []
        for o in options.flatMap({ $0.split(separator: ",").map(String.init) }) where !o.isEmpty {
            let (key, value) = o.firstIndex(of: "=").map { (String(o[..<$0]), String(o[o.index(after: $0)...])) } ?? (o, "")
            switch key {
            case "device-key": deviceKey = value
            case "socket": socket = value
            case "policy": policy = value
            case "owner": owner = value
            case "default-class":
                guard let c = ProtectionClass(name: value) else { throw ValidationError("-o default-class=\(value): unknown class") }
                defaultClass = c
            case "grace":
                guard let g = Double(value) else { throw ValidationError("-o grace=\(value): not a number of seconds") }
                grace = g
            case "no-writeback-cache": noWritebackCache = true
            case "acl": posixACL = true
            case "noacl": posixACL = false
            case "threads":
                guard let n = Int(value) else { throw ValidationError("-o threads=\(value): not a number") }
                threads = n
            case "inactivity-relock":
                guard let h = Double(value) else { throw ValidationError("-o inactivity-relock=\(value): not a number of hours") }
                inactivityRelock = h
            // mount(8) and systemd words that are not FUSE's (mount.fuse3 passes some through).
            // `suid` and `dev` go on to FUSE: the mount is nosuid,nodev unless they are given.
            case "defaults", "auto", "noauto", "user", "nouser", "users", "_netdev", "nofail", "rw", "exec", "atime", "relatime":
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
        _ = try Keybag.load(storePath: store)   // a clear error before any daemon starts
        let policy = try classPolicy()
        let socketPath = socket ?? ControlPaths.defaultSocket(forMountpoint: mountpoint)
        let fuseOptions = options.flatMap { $0.split(separator: ",").map(String.init) }.filter { !$0.isEmpty }
        if foreground {
            if let readyFd {
                setsid()
                Launcher.closeInheritedDescriptors(keeping: readyFd)
            }
            var cfg = MountConfiguration(store: store, mountpoint: mountpoint, socketPath: socketPath, deviceKeyPath: deviceKey,
                                         defaultClass: defaultClass, grace: grace, fuseOptions: fuseOptions, readyFD: readyFd)
            cfg.policy = policy
            cfg.owner = try ownerUID()
            cfg.inactivityRelock = inactivityRelock.map { $0 * 3600 }
            cfg.writebackCache = !noWritebackCache
            cfg.posixACL = posixACL
            cfg.threads = threads
            let rc = MountDaemon.run(cfg)
            if rc != 0 { throw ExitCode(rc) }
            return
        }
        try Launcher.spawnDaemon(arguments: Array(CommandLine.arguments.dropFirst()) + ["--foreground", "--ready-fd", "3"])
    }
}

/// `keybagfs fsck`.
struct Fsck: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Check an unmounted store; with --repair, fix what can be fixed.",
        discussion: """
        Checks the keybag, every directory's metadata, names and long-name side files, every file header \
        (both slots), every block of files whose class key is at hand, and the xattr and symlink-target \
        folders. Without the passcode, classes A, B and C are checked for structure only. --repair fixes \
        what loses no data; repairs that drop data (torn or damaged blocks) also need --yes. \
        Exit status: 0 clean, 1 problems found (or the check failed), 2 usage.
        """)

    @OptionGroup var target: UnmountedStore

    @Flag(help: "Read the passcode as one line from standard input, to check the contents of classes A, B and C.")
    var passcodeStdin = false

    @Flag(help: "Ask for the passcode on the terminal.")
    var askPasscode = false

    @Flag(help: "Repair what can be repaired without losing data.")
    var repair = false

    @Flag(help: "With --repair: also repairs that drop data (cut torn tails, zero damaged blocks).")
    var yes = false

    @Flag(help: "Print the result as JSON.")
    var json = false

    func run() throws {
        let lock = try lockUnmountedStore(target.store)
        defer { close(lock) }
        let kb = try Keybag.load(storePath: target.store)
        let dk = try DeviceKeyFile.load(from: target.deviceKeyPath(kb))
        defer { dk.wipe() }
        let passcode: SecureKey? = passcodeStdin || askPasscode ? try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Passcode: ") : nil
        defer { passcode?.wipe() }
        let check = try StoreCheck(storePath: target.store, deviceKey: dk, passcode: passcode, options: .init(repair: repair, dropData: repair && yes))
        defer { check.wipe() }
        if isatty(2) == 1 && !json {
            check.progress = { FileHandle.standardError.write(Data("\rchecked \($0) files…".utf8)) }
        }
        try check.run()
        if isatty(2) == 1 && !json && check.files >= 500 { FileHandle.standardError.write(Data("\r\u{1b}[K".utf8)) }
        if json {
            let o: [String: Any] = [
                "clean": check.isClean, "directories": check.directories, "files": check.files, "blocks": check.blocks,
                "filesWithoutKey": check.keyless,
                "problems": check.problems.map { p -> [String: Any] in
                    var d: [String: Any] = ["kind": p.kind, "path": p.path, "detail": p.detail, "repair": p.repair]
                    if let n = p.name { d["name"] = n }
                    return d
                },
            ]
            let data = try JSONSerialization.data(withJSONObject: o, options: [.sortedKeys])
            print(String(decoding: data, as: UTF8.self))
        } else {
            for p in check.problems {
                print("\(p.kind): \(p.path)\(p.name.map { " (\($0))" } ?? ""): \(p.detail) [\(p.repair)]")
            }
            let summary = "\(check.directories) directories, \(check.files) files, \(check.blocks) blocks checked"
                + (check.keyless > 0 ? "; \(check.keyless) files of classes A/B/C checked for structure only (no passcode)" : "")
            if check.isClean {
                print("clean: " + summary)
            } else {
                let fixed = check.problems.filter { $0.repair == "repaired" }.count
                print("\(check.problems.count) problem(s), \(fixed) repaired: " + summary)
            }
        }
        if !check.isClean { throw ExitCode(1) }
    }
}

/// The store and device key of a command on an unmounted store.
struct UnmountedStore: ParsableArguments {
    @Argument(help: "The store directory (not mounted).")
    var store: String

    @Option(help: "Device key file (default /var/lib/keybagfs/<store-id>.key).")
    var deviceKey: String?

    /// The device key path for a keybag.
    func deviceKeyPath(_ kb: Keybag) -> String { deviceKey ?? DeviceKeyFile.defaultPath(storeID: kb.file.storeID) }
}

/// Hands a new recovery key to the user: into a new 0600 file, or printed once.
enum RecoveryKeyOutput {
    static func give(_ recovery: RecoveryKey, file: String?) throws {
        let text = try recovery.text()
        defer { text.wipe() }
        if let file {
            let fd = open(file, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
            guard fd >= 0 else { throw KeybagError.system("cannot create the recovery key file \(file)", errno) }
            defer { close(fd) }
            let ok = try text.withBytes { t in write(fd, t.baseAddress!, t.count) == t.count } && write(fd, "\n", 1) == 1 && fsync(fd) == 0
            guard ok else { throw KeybagError.system("cannot write the recovery key file \(file)", errno) }
            print("recovery key: written to \(file)  (keep it offline; it opens the store without passcode and device key)")
            return
        }
        // Every byte must reach stdout, or the caller saves nothing (a closed pipe is an error, not a signal).
        signal(SIGPIPE, SIG_IGN)
        let intro = "recovery key (shown once; keep it offline, it opens the store without passcode and device key):\n    "
        func put(_ p: UnsafeRawPointer, _ n: Int) -> Bool {
            var off = 0
            while off < n {
                let w = write(1, p + off, n - off)
                if w < 0 && errno == EINTR { continue }
                if w <= 0 { return false }
                off += w
            }
            return true
        }
        fflush(nil)
        let ok = try Array(intro.utf8).withUnsafeBytes { put($0.baseAddress!, $0.count) }
            && text.withBytes { put($0.baseAddress!, $0.count) } && put("\n", 1)
        guard ok else { throw KeybagError.system("cannot show the recovery key on standard output; nothing was changed", errno) }
    }

    /// Reads a recovery key from a file's first line, from stdin, or from the terminal.
    static func read(file: String?, fromStdin: Bool) throws -> RecoveryKey {
        let text: SecureKey
        if let file {
            let fd = open(file, O_RDONLY | O_CLOEXEC)
            guard fd >= 0 else { throw KeybagError.system("cannot read the recovery key file \(file)", errno) }
            defer { close(fd) }
            guard let t = try PasscodeInput.readLine(fd: fd) else { throw KeybagError.invalid("the recovery key file \(file) is empty") }
            text = t
        } else {
            text = try PasscodeInput.read(fromStdin: fromStdin, prompt: "Recovery key: ")
        }
        defer { text.wipe() }
        return try RecoveryKey.parse(text)
    }
}

/// Takes the store's lock the daemon holds while mounted; refuses a mounted store.
func lockUnmountedStore(_ store: String) throws -> Int32 {
    let lock = open(store, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    guard lock >= 0 else { throw KeybagError.invalid("cannot open the store \(store): \(String(cString: strerror(errno)))") }
    guard flock(lock, LOCK_EX | LOCK_NB) == 0 else {
        close(lock)
        throw KeybagError.invalid("the store \(store) is mounted (a keybagfs daemon holds it); unmount it first")
    }
    return lock
}

/// `keybagfs cipher`: shows or changes the cipher of new files.
struct CipherCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "cipher",
        abstract: "Show the cipher new files get, or change it; the store must not be mounted to change it.",
        discussion: """
        Each file names its cipher in its header, so files keep theirs and keep reading. After a change, new \
        files and files saved by replacing them (how editors and most programs save) get the new one. \
        xaes256gcm and xchacha20poly1305 can replace each other; aes256gcm stores keep aes256gcm (its blocks \
        have another layout). The name is authenticated with the device key: a keybag edited offline is \
        refused at mount, and this command sets it again. A keybagfs older than xaes256gcm refuses to mount \
        a store set to it ("keybag field cipher: unknown cipher"); it changes nothing in the store.
        """)

    @Argument(help: "The store directory.")
    var store: String

    @Argument(help: "The cipher for new files: xaes256gcm or xchacha20poly1305.")
    var cipher: ContentCipher?

    @Option(help: "Device key file (default /var/lib/keybagfs/<store-id>.key): the cipher's name is authenticated with it.")
    var deviceKey: String?

    func run() throws {
        guard let cipher else {
            print(try Keybag.load(storePath: store).cipher.name)
            return
        }
        let lock = try lockUnmountedStore(store)
        defer { close(lock) }
        var kb = try Keybag.load(storePath: store)
        let dk = try DeviceKeyFile.load(from: deviceKey ?? DeviceKeyFile.defaultPath(storeID: kb.file.storeID))
        defer { dk.wipe() }
        try kb.unwrapDeviceKeySlot("D", deviceKey: dk).wipe()   // the right device key, or badDeviceKey
        let old = kb.cipher
        let authentic = try kb.cipherIsAuthentic(deviceKey: dk)
        // An edited name (its MAC fails) says nothing about the store's layout: any cipher may be set back.
        guard authentic == false || cipher.sharesLayout(with: old) else {
            throw KeybagError.invalid("\(old.name) stores cannot change to \(cipher.name): their blocks have another layout; copy the files into a new store instead")
        }
        guard cipher.isAvailable else { throw KeybagError.invalid("this CPU cannot run \(cipher.name)") }
        guard cipher != old || authentic != true else { print("new files already get \(cipher.name)"); return }
        try kb.setCipherOfNewFiles(cipher, deviceKey: dk)
        print("new files get \(cipher.name) (was \(old.name)); existing files keep theirs")
    }
}

/// `keybagfs recover`.
struct Recover: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Set a new passcode (and, if asked, a new device key) from the recovery key; the store must not be mounted.",
        discussion: """
        The recovery key is read from --recovery-key-file, or as the first line of stdin with --stdin \
        (the new passcode is then the second line), or asked on the terminal. No file is re-encrypted. \
        With --new-device-key a new device key is written (to --device-key or the default path; an \
        existing file there is replaced) and the old one stops working. Wrong recovery keys are \
        throttled like passcodes. The recovery key stays valid; replace it with `keybagfs recovery-key rotate`.
        """)

    @OptionGroup var target: UnmountedStore

    @Flag(help: "Write a new device key instead of using the existing one (when it was lost).")
    var newDeviceKey = false

    @Option(help: "Read the recovery key from this file's first line.")
    var recoveryKeyFile: String?

    @Flag(help: "Read the recovery key (unless --recovery-key-file) and then the new passcode as lines from stdin.")
    var stdin = false

    func run() throws {
        let lock = try lockUnmountedStore(target.store)
        defer { close(lock) }
        var kb = try Keybag.load(storePath: target.store)
        let dkPath = target.deviceKeyPath(kb)
        let wait = kb.recoveryRetryAfter(now: Date().timeIntervalSince1970)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        let recovery = try RecoveryKeyOutput.read(file: recoveryKeyFile, fromStdin: stdin)
        defer { recovery.wipe() }
        let passcode = try PasscodeInput.read(fromStdin: stdin, prompt: "New passcode: ")
        defer { passcode.wipe() }
        if !stdin {
            let again = try PasscodeInput.prompt("Repeat new passcode: ")
            defer { again.wipe() }
            guard PasscodeInput.equal(passcode, again) else { throw KeybagError.invalid("the passcodes differ; nothing was changed") }
        }
        if newDeviceKey {
            var lst = stat()
            if lstat(dkPath, &lst) == 0 && lst.st_mode & S_IFMT == S_IFLNK {
                throw KeybagError.invalid("\(dkPath) is a symlink; give the path it points to with --device-key")
            }
            // The new key is written (and its folder synced) under a staged name, the keybag is
            // saved, then the key is renamed into place and the folder synced again. A crash
            // after the keybag save leaves the store needing `<key>.new`: rename it, or run
            // `recover` again (the recovery key stays valid).
            let staged = dkPath + ".new"
            unlink(staged)
            let dk = try DeviceKeyFile.create(at: staged)
            defer { dk.wipe() }
            do { try kb.recover(with: recovery, newPasscode: passcode, deviceKey: dk) } catch { unlink(staged); throw error }
            guard rename(staged, dkPath) == 0 else { throw KeybagError.system("the store now needs the device key \(staged); moving it to \(dkPath) failed", errno) }
            DeviceKeyFile.syncFolder(of: dkPath)
            print("recovered \(target.store): new passcode set; new device key \(dkPath) (the old one no longer opens the store)")
        } else {
            let dk: SecureKey
            do { dk = try DeviceKeyFile.load(from: dkPath) } catch {
                throw KeybagError.invalid("\(error); if the device key is lost, run again with --new-device-key")
            }
            defer { dk.wipe() }
            do { try kb.unwrapDeviceKeySlot("D", deviceKey: dk).wipe() } catch {
                throw KeybagError.invalid("the device key \(dkPath) does not open this store; if the right one is lost, run again with --new-device-key")
            }
            _ = try? kb.authenticate(deviceKey: dk)
            try kb.recover(with: recovery, newPasscode: passcode, deviceKey: dk)
            print("recovered \(target.store): new passcode set")
        }
    }
}

/// `keybagfs recovery-key`.
struct RecoveryKeyCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "recovery-key",
        abstract: "Manage the store's recovery key.",
        subcommands: [Rotate.self])

    /// `keybagfs recovery-key rotate`.
    struct Rotate: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Make a new recovery key (the old one stops working); the store must not be mounted.",
            discussion: "Needs the passcode (asked on the terminal, or one line of stdin with --passcode-stdin) and the device key. Also gives a recovery key to a store made without one.")

        @OptionGroup var target: UnmountedStore

        @Flag(help: "Read the passcode as one line from standard input.")
        var passcodeStdin = false

        @Option(help: "Write the new recovery key to this new file (mode 0600) instead of printing it.")
        var recoveryKeyFile: String?

        func run() throws {
            let lock = try lockUnmountedStore(target.store)
            defer { close(lock) }
            var kb = try Keybag.load(storePath: target.store)
            let dk = try DeviceKeyFile.load(from: target.deviceKeyPath(kb))
            defer { dk.wipe() }
            let passcode = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Passcode: ")
            defer { passcode.wipe() }
            let recovery = try kb.rotateRecoveryKey(passcode: passcode, deviceKey: dk) { try RecoveryKeyOutput.give($0, file: recoveryKeyFile) }
            defer { recovery.wipe() }
            print("new recovery key for \(target.store) saved; the old one no longer works")
        }
    }
}

/// Starts the daemon as a child process and waits until it reports the mount live.
enum Launcher {
    /// Closes descriptors above stderr that a detached daemon inherited by accident
    /// (they would hold the launching program's pipes open).
    static func closeInheritedDescriptors(keeping keep: Int32) {
        let fds = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/fd"))?.compactMap { Int32($0) } ?? []
        for fd in fds where fd > 2 && fd != keep { close(fd) }
    }

    static func spawnDaemon(arguments: [String]) throws {
        var fds: [Int32] = [0, 0]
        guard pipe(&fds) == 0 else { throw KeybagError.system("pipe", errno) }
        _ = fcntl(fds[0], F_SETFD, FD_CLOEXEC)
        _ = fcntl(fds[1], F_SETFD, FD_CLOEXEC)
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_adddup2(&actions, fds[1], 3)
        posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0)
        posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0)
        posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0)
        let exe = (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/exe")) ?? CommandLine.arguments[0]
        let argv = ([exe] + arguments).map { strdup($0) } + [nil]
        defer { argv.forEach { free($0) } }
        var pid: pid_t = 0
        let rc = posix_spawn(&pid, exe, &actions, nil, argv, environ)
        close(fds[1])
        guard rc == 0 else { close(fds[0]); throw KeybagError.system("cannot start the daemon", rc) }
        var buffer: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 512)
        while true {
            let n = read(fds[0], &chunk, chunk.count)
            if n < 0 && errno == EINTR { continue }
            if n <= 0 { break }
            buffer += chunk[0..<n]
        }
        close(fds[0])
        let line = String(decoding: buffer, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        if line == "OK" { return }
        var status: Int32 = 0
        waitpid(pid, &status, 0)
        if line.hasPrefix("ERR ") { throw KeybagError.invalid(String(line.dropFirst(4))) }
        throw KeybagError.invalid("the daemon exited before the mount was ready (status \(status))")
    }
}
