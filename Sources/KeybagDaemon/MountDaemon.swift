import CFuse
import CSystem
import Foundation
import Glibc
import KeybagCore

/// What `keybagfs mount` was asked to do.
public struct MountConfiguration: Sendable {
    public var store: String
    public var mountpoint: String
    public var socketPath: String
    public var deviceKeyPath: String?
    public var defaultClass: ProtectionClass
    public var grace: Double
    public var fuseOptions: [String]
    /// Default classes of new directories by path.
    public var policy = ClassPolicy()
    /// Uid allowed to lock, unlock and passwd besides root (default: the daemon's uid).
    public var owner: uid_t? = nil
    /// Seconds locked after which class C keys go too (nil: never).
    public var inactivityRelock: Double? = nil
    /// Whether the kernel may cache writes (write-back) for handles that are not class A.
    public var writebackCache = true
    /// Whether the store is watched for changes another writer makes (`StoreSharing.Mode`).
    public var watchStore = StoreSharing.Mode.auto
    /// Whether the kernel enforces POSIX ACLs (`-o acl` / `-o noacl`); nil: where it checks
    /// permissions anyway (`needsKernelPermissionChecks`).
    public var posixACL: Bool? = nil
    /// Most FUSE loop threads (`fuse_loop_cfg_set_max_threads`).
    public var threads = MountConfiguration.defaultThreads
    /// The TCTI of this device's TPM when it is not the one its enrollment names (nil: that one).
    public var tpm2Device: String? = nil
    /// The loop's thread limit unless `--threads` says otherwise.
    public static let defaultThreads = 16
    /// Descriptor to report readiness on ("OK" or "ERR message"), from the launching parent.
    public var readyFD: Int32?

    public init(
        store: String, mountpoint: String, socketPath: String, deviceKeyPath: String?, defaultClass: ProtectionClass,
        grace: Double, fuseOptions: [String], readyFD: Int32?
    ) {
        self.store = store; self.mountpoint = mountpoint; self.socketPath = socketPath;
        self.deviceKeyPath = deviceKeyPath
        self.defaultClass = defaultClass; self.grace = grace; self.fuseOptions = fuseOptions; self.readyFD = readyFD
    }
}

/// The daemon's life: open the store, bind the control socket, mount, serve until
/// unmounted or signalled, then zero every key.
public enum MountDaemon {
    /// Seconds the kernel may cache entries and attributes. A change through this daemon
    /// replies new attributes and lets the kernel drop what it changed, and a change another
    /// writer makes in the store (a sync engine) is reported by the `StoreWatcher`, which makes
    /// the kernel drop what it made stale; so the cache can be long.
    static let cacheTimeout = 30.0
    /// The cache time where the store should be watched but cannot be (no fanotify for this
    /// process): a change underneath shows after at most this long.
    static let unwatchedCacheTimeout = 1.0

    /// Whether the kernel must check modes (`default_permissions`): always, unless the mount
    /// is root's alone (no allow_other / allow_root), where every caller is root and the
    /// checks would pass anyway but cost a GETATTR of the directory after each change in it.
    static func needsKernelPermissionChecks(euid: uid_t, options: [String]) -> Bool {
        euid != 0 || options.contains { $0 == "allow_other" || $0 == "allow_root" || $0 == "default_permissions" }
    }

    /// A systemd credential (`LoadCredential=`, `LoadCredentialEncrypted=`) of this
    /// service, when one of that name was passed.
    static func credentialPath(_ name: String) -> String? {
        guard let dir = ProcessInfo.processInfo.environment["CREDENTIALS_DIRECTORY"], !dir.isEmpty else { return nil }
        let p = dir + "/" + name
        return access(p, R_OK) == 0 ? p : nil
    }

    /// The systemd STATUS= text for a state.
    static func statusLine(_ state: LockState) -> String { "mounted, \(state.rawValue)" }

    /// Where the daemon and every part it makes write their notes (stderr).
    static let log = EventLog.standardError

    /// Tells the launching parent (and systemd) how the start went.
    static func report(_ cfg: MountConfiguration, _ line: String) {
        if let fd = cfg.readyFD {
            let b = Array((line + "\n").utf8)
            _ = b.withUnsafeBytes { Glibc.write(fd, $0.baseAddress!, $0.count) }
            close(fd)
        }
    }

    /// Sends `message` (READY=1, STATUS=…) to systemd when started as a Type=notify service.
    static func notifySystemd(_ message: String) {
        guard let path = ProcessInfo.processInfo.environment["NOTIFY_SOCKET"], !path.isEmpty else { return }
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return }
        defer { close(fd) }
        var addr = sockaddr_un()
        addr.sun_family = sa_family_t(AF_UNIX)
        var bytes = Array(path.utf8)
        if bytes.first == UInt8(ascii: "@") { bytes[0] = 0 }  // abstract namespace
        guard bytes.count < MemoryLayout.size(ofValue: addr.sun_path) else { return }
        withUnsafeMutableBytes(of: &addr.sun_path) { p in for (i, b) in bytes.enumerated() { p[i] = b } }
        let msg = Array(message.utf8)
        let len = socklen_t(MemoryLayout<sa_family_t>.size + bytes.count)
        _ = withUnsafePointer(to: &addr) { a in
            msg.withUnsafeBytes { m in
                sendto(
                    fd, m.baseAddress!, m.count, Int32(MSG_NOSIGNAL),
                    UnsafeRawPointer(a).assumingMemoryBound(to: sockaddr.self), len)
            }
        }
    }

    /// A start that cannot go on, with the message for the log and the launching parent.
    struct StartFailure: Error { let message: String }

    /// What a started daemon holds: the keys' owner, the filesystem and the control socket.
    private struct Started {
        let fs: Filesystem
        let controller: Controller
        let server: ControlServer
        /// Changes another writer makes in the store; nil where they cannot be watched.
        let watcher: StoreWatcher?
        /// The store's lock (its directory, flock'd), released once the session has ended.
        let storeLock: Int32
    }

    /// Runs the daemon in this process; returns the exit code.
    public static func run(_ cfg: MountConfiguration) -> Int32 {
        prepareProcess()
        do {
            let started = try start(cfg)
            let (se, userdata) = try mountSession(cfg, started)
            return serve(cfg, started, se, userdata)
        } catch {
            let m = (error as? StartFailure)?.message ?? "\(error)"
            log(m); report(cfg, "ERR " + m)
            return 1
        }
    }

    /// Process-wide settings made before anything else: no core dumps, descriptors, malloc
    /// behaviour, libsodium and OpenSSL (whose allocator must be in place first).
    private static func prepareProcess() {
        _ = kbfs_set_nondumpable()
        _ = kbfs_raise_nofile()
        _ = kbfs_limit_malloc_arenas(2)  // 16 loop threads with an arena each inflate RSS
        // Request buffers of exiting loop threads go back by munmap (the mmap threshold). The
        // trim threshold holds two retirements of overwrite-journal records (pending blocks,
        // sealed): freed after each retirement and allocated again, trimmed they were faulted
        // back in page by page (sysmalloc and page faults: ~8 % of a random write's CPU).
        _ = kbfs_fix_malloc_thresholds(128 * 1024, Int32(OverwriteJournal.defaultRingSize / 2))
        umask(0)
        Sodium.ensureInitialized()
        HardwareAES.start()  // OpenSSL's allocator must be in place before its first allocation
        if !HardwareAES.ownsMemory {
            log(
                "warning: OpenSSL was set up before keybagfs' allocator: its key schedules live in memory that may "
                    + "be swapped (freed contexts are still zeroed)"
            )
        }
    }

    /// Takes the store (one daemon per store: the lock lives as long as this process), its
    /// keys and folders; builds the filesystem, the controller and the control socket.
    private static func start(_ cfg: MountConfiguration) throws -> Started {
        let storeLock = try lockStore(cfg.store)
        let (keybag, deviceKey, classD, names) = try loadKeys(cfg)
        let data = try openFolder(cfg.store, Keybag.dataDirName, create: false)
        let targets = try openFolder(cfg.store, Keybag.targetsDirName, create: true)
        let xattrs = try openFolder(cfg.store, Keybag.xattrsDirName, create: true)
        let behind = DeviceTrust.newestKeySet(keybag) > keybag.currentKeySet
        let keyring = ClassKeyring(classD: classD, current: UInt8(keybag.currentKeySet), behind: behind)
        let cipher = keybag.cipher.isAvailable ? keybag.cipher : .xchacha20poly1305
        let fs = try Filesystem(
            dataFD: data, targetsFD: targets, xattrsFD: xattrs, names: names, keyring: keyring,
            cipher: cipher, defaultClass: cfg.defaultClass, policy: cfg.policy,
            threads: cfg.threads, kernel: KernelNotifier(log: log),
            journaling: try openJournal(cfg, keybag, deviceKey),
            log: log)
        _ = try fs.directories.meta(of: fs.table.root)  // the root's name IV exists before the first request
        let mountpoint = URL(fileURLWithPath: cfg.mountpoint).standardizedFileURL.path
        let owner = cfg.owner ?? getuid()
        let controller = Controller(
            keybag: keybag, deviceKey: deviceKey, keyring: keyring, fs: fs, grace: cfg.grace,
            mountpoint: mountpoint, owner: owner, inactivityRelock: cfg.inactivityRelock
        ) { state in
            notifySystemd("STATUS=\(statusLine(state))")
        }
        do {
            let server = try ControlServer(path: cfg.socketPath, controller: controller, owner: owner)
            return Started(
                fs: fs, controller: controller, server: server,
                watcher: startWatcher(cfg, fs, controller), storeLock: storeLock)
        } catch {
            controller.shutdown()
            throw error
        }
    }

    /// Watches the store as `cfg.watchStore` says (logged); nil when it is off or impossible.
    private static func startWatcher(_ cfg: MountConfiguration, _ fs: Filesystem, _ controller: Controller)
        -> StoreWatcher?
    {
        let full: Bool
        switch cfg.watchStore {
        case .off:
            log("not watching the store for changes underneath (--watch-store off): the daemon is its only writer")
            return nil
        case .on:
            full = true
        case .auto:
            if let why = StoreSharing.evidence(storePath: cfg.store) {
                log("watching the store for changes underneath: " + why)
                full = true
            } else {
                log(
                    "watching the store's top level only (no other device or sync engine marker found; a sync "
                        + "engine that leaves none needs --watch-store on)")
                full = false
            }
        }
        return StoreWatcher.start(fs: fs, storePath: cfg.store, full: full) { [controller] in
            controller.keySetStanding()
        }
    }

    /// The store's overwrite journal, its live records (a power cut, a kill) replayed into
    /// their files first. A journal that cannot be replayed refuses the mount (writing in
    /// place meanwhile, the records would later be replayed over newer data); one that cannot
    /// be made (a full or read-only store) leaves blocks rewritten in place, logged.
    private static func openJournal(_ cfg: MountConfiguration, _ kb: Keybag, _ deviceKey: SecureKey) throws
        -> Journaling?
    {
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: kb.file.storeID)
        let replayed: JournalSuperblock?
        do { replayed = try JournalReplay.replay(storePath: cfg.store, deviceID: id) { log($0) } } catch {
            throw StartFailure(
                message: "the overwrite journal \(JournalReplay.fileName(deviceID: id)) could not be replayed "
                    + "(\(error)); nothing was mounted: free space or fix the error, then mount again")
        }
        do {
            var fs = statvfs()
            let bytes = statvfs(cfg.store, &fs) == 0 ? Int(fs.f_blocks) * Int(fs.f_frsize) : 0
            let journal = try JournalReplay.open(
                storePath: cfg.store, deviceID: id, ringSize: OverwriteJournal.ringSize(storeBytes: bytes),
                replayed: .some(replayed)
            ) { log($0) }
            return Journaling(journal: journal, storePath: cfg.store, log: log)
        } catch {
            // A journal that was there and cannot be used now is not left behind for a later
            // replay over newer data: nothing is mounted.
            if replayed != nil {
                throw StartFailure(message: "the overwrite journal could not be opened (\(error)); nothing was mounted")
            }
            log("no overwrite journal (\(error)): blocks are rewritten in place, and a power cut can tear one")
            return nil
        }
    }

    /// Locks the store against a second daemon (the descriptor stays open until exit).
    private static func lockStore(_ store: String) throws -> Int32 {
        let fd = open(store, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else {
            throw StartFailure(message: "cannot open the store \(store): \(String(cString: strerror(errno)))")
        }
        do {
            try StoreLock.acquire(fd: fd) { log($0) }
            return fd
        } catch StoreLock.Refusal.heldByLiveProcess(let pid) {
            close(fd)
            throw StartFailure(
                message: "the store \(store) is already mounted by another keybagfs daemon"
                    + (pid.map { " (pid \($0))" } ?? ""))
        } catch StoreLock.Refusal.exitingHolderStayed(let pid) {
            close(fd)
            throw StartFailure(
                message: "the store \(store) is still held by process \(pid), which has been exiting for "
                    + "\(Int(StoreLock.exitingHolderWait)) s")
        } catch {
            close(fd)
            throw StartFailure(message: "cannot lock the store \(store): \(error)")
        }
    }

    /// Gives a keybag bound to a TPM its sealer (this device's enrollment) and refuses a keybag older than the TPM's counter; before anything saves the keybag.
    /// A missing enrollment, an unreachable, cleared or replaced TPM: one line naming the way out.
    private static func attachTPM(_ kb: inout Keybag, _ cfg: MountConfiguration, deviceKey: SecureKey) throws {
        guard kb.file.tpm2 == true else { return }
        // Seal and unseal in a child process of this binary: tpm2-tss frees copies of the
        // authorization without wiping them, and this process's memory must not keep them.
        let helper = TPMHelperProcess(executable: "/proc/self/exe"), tcti = cfg.tpm2Device
        do { try TPMBinding.attach(&kb, tcti: tcti, deviceKey: deviceKey, helper: helper) } catch let e as KeybagError {
            throw StartFailure(message: e.description)
        }
        guard let sealer = kb.sealer as? TPMSealer else { return }
        log("passcode bound to the TPM at \(sealer.tcti)")
        if (try? sealer.lockoutUnfinished()) == true {
            log(
                "warning: the TPM's lockout authorization is empty, so any root user can clear its lockout and keep "
                    + "guessing: run `keybagfs tpm2 enroll STORE` again (unmounted) to take it")
        }
        if let n = sealer.pendingRewrap {
            log("warning: an enrollment was cut short: not every file is on key set \(n) yet (`keybagfs rewrap STORE`)")
        }
    }

    /// This device's keybag, the device key, the class D key of each key set and the name
    /// cipher (volume key).
    private static func loadKeys(
        _ cfg: MountConfiguration
    ) throws -> (Keybag, SecureKey, [UInt8: SecureKey], NameCipher) {
        let any = try Keybag.load(storePath: cfg.store)
        let dkPath =
            cfg.deviceKeyPath ?? Self.credentialPath("device-key")
            ?? DeviceKeyFile.defaultPath(storeID: any.file.storeID)
        let deviceKey = try DeviceKeyFile.load(from: dkPath)
        var kb = try Keybag.load(storePath: cfg.store, deviceKey: deviceKey)
        try Self.attachTPM(&kb, cfg, deviceKey: deviceKey)
        guard kb.cipher.isAvailable || kb.cipher.sharesLayout(with: .xchacha20poly1305) else {
            throw KeybagError.invalid("this CPU cannot run the store's cipher \(kb.cipher.name)")
        }
        let classD = try kb.classDKeys(deviceKey: deviceKey)
        switch try kb.authenticate(deviceKey: deviceKey) {
        case .authentic: break
        case .upgraded: log("keybag upgraded to format \(Keybag.currentFormat) (authenticated failed-attempt counter)")
        case .tampered:
            log(
                "the keybag's failed-attempt counter does not authenticate (edited offline?): unlock refused for "
                    + "\(Controller.seconds(PasscodeAttempts.retryAfter(kb, now: Date().timeIntervalSince1970))) s"
            )
        }
        // Only an authenticated keybag may raise the floor (a forged key set would lock the device out).
        try KeySetFloor.checkAndRecord(kb, deviceKey: deviceKey)
        let trust = DeviceTrust.of(kb)
        for refused in trust?.refused ?? [] { log("refused in \(StoreDevices.dirName)/: \(refused)") }
        let newest = trust?.newestSet ?? StoreDevices.newestKeySet(storePath: cfg.store)
        if newest > kb.currentKeySet {
            let me = kb.deviceID ?? ""
            let handed = trust.map { t in
                ((kb.currentKeySet + 1)...newest).allSatisfy { t.records[$0]?.grants[me] != nil }
            }
            log(
                "a device was removed from this store (key set \(newest)) and this device holds key set "
                    + "\(kb.currentKeySet): new files and class changes are refused (the removed device could open "
                    + "them) until this device takes up the new keys "
                    + (handed == true ? "(at the next unlock: they were handed to it)" : "with `keybagfs recover`"))
        }
        let volume = try kb.unwrapDeviceKeySlot("volume", deviceKey: deviceKey)
        defer { volume.wipe() }
        return (kb, deviceKey, classD, try NameCipher(volumeKey: volume))
    }

    /// An `O_PATH` descriptor of one of the store's folders, made first when `create`.
    private static func openFolder(_ store: String, _ name: String, create: Bool) throws -> Int32 {
        if create { mkdirat(AT_FDCWD, store + "/" + name, 0o700) }
        let fd = open(store + "/" + name, kbfs_O_PATH | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else {
            throw StartFailure(message: "cannot open \(store)/\(name): \(String(cString: strerror(errno)))")
        }
        return fd
    }

    /// Creates the FUSE session with the mount's options and mounts it; undoes what the start
    /// made when it cannot. Returns the session and the context handed to the handlers.
    private static func mountSession(
        _ cfg: MountConfiguration, _ s: Started
    ) throws -> (OpaquePointer, UnsafeMutableRawPointer) {
        func fail(_ m: String) -> StartFailure {
            s.watcher?.stop(); s.server.stop(); s.controller.shutdown(); return StartFailure(message: m)
        }
        let fsname = cfg.store.replacingOccurrences(of: ",", with: "_")
        var opts = ["fsname=\(fsname)", "subtype=keybagfs"]
        let kernelChecks = Self.needsKernelPermissionChecks(euid: geteuid(), options: cfg.fuseOptions)
        let posixACL = cfg.posixACL ?? kernelChecks
        if kernelChecks || posixACL { opts.append("default_permissions") }  // ACLs imply it (the kernel sets it too)
        opts += cfg.fuseOptions
        let argv: [String] = ["keybagfs", "-o", opts.joined(separator: ",")]
        let cargs = argv.map { strdup($0) }
        defer { cargs.forEach { free($0) } }
        var cArgv: [UnsafeMutablePointer<CChar>?] = cargs + [nil]
        let context = FuseContext(
            fs: s.fs,
            cacheTimeout: s.watcher == nil && cfg.watchStore != .off ? Self.unwatchedCacheTimeout : Self.cacheTimeout,
            writebackCache: cfg.writebackCache, posixACL: posixACL)
        let userdata = Unmanaged.passRetained(context).toOpaque()
        var ops = FuseBridge.operations()
        let se: OpaquePointer? = cArgv.withUnsafeMutableBufferPointer { buf in
            var args = fuse_args(argc: Int32(argv.count), argv: buf.baseAddress, allocated: 0)
            let s = fuse_session_new(&args, &ops, MemoryLayout<fuse_lowlevel_ops>.size, userdata)
            fuse_opt_free_args(&args)
            return s
        }
        guard let se else { throw fail("cannot create the FUSE session (bad -o options?)") }
        guard fuse_set_signal_handlers(se) == 0 else { throw fail("cannot install signal handlers") }
        guard fuse_session_mount(se, s.controller.mountpoint) == 0 else {
            fuse_remove_signal_handlers(se); fuse_session_destroy(se)
            throw fail("cannot mount on \(s.controller.mountpoint) (does it exist? is /dev/fuse usable?)")
        }
        return (se, userdata)
    }

    /// Serves the mounted session until unmount or a signal, then zeroes every key and
    /// unmounts. Returns the exit code.
    private static func serve(
        _ cfg: MountConfiguration, _ s: Started, _ se: OpaquePointer, _ userdata: UnsafeMutableRawPointer
    ) -> Int32 {
        FuseChannel.noteReadaheadFile(mountpoint: s.controller.mountpoint)
        if let file = FuseChannel.readAheadFile.withLock({ $0 }) {
            s.fs.io.space.attach(bdi: String(file.dropLast("/read_ahead_kb".count)))
        } else {
            log("cannot find the mount's device number; a full store may be reported only at fsync or close")
        }
        if !FuseChannel.install(se) { log("cannot install the FUSE I/O hooks; class A handles keep page-cache I/O") }
        s.fs.kernel.attach(se)
        s.server.start()
        HeapTrimmer.shared.start()
        report(cfg, "OK")
        notifySystemd("READY=1\nMAINPID=\(getpid())\nSTATUS=\(Self.statusLine(.beforeFirstUnlock))")
        if cfg.readyFD != nil {
            // Detached: stdio no longer belongs to the launching terminal.
            let null = open("/dev/null", O_RDWR)
            if null >= 0 { dup2(null, 0); dup2(null, 1); dup2(null, 2); close(null) }
        }

        let loopCfg = fuse_loop_cfg_create()
        fuse_loop_cfg_set_max_threads(loopCfg, UInt32(cfg.threads))
        fuse_loop_cfg_set_clone_fd(loopCfg, 1)
        let rc = fuse_session_loop_mt(se, loopCfg)
        fuse_loop_cfg_destroy(loopCfg)

        s.watcher?.stop()
        s.fs.io.journaling?.committing.withLock { $0 = false }
        do { try s.fs.io.journaling?.journal.checkpoint() } catch {
            log("the overwrite journal could not be emptied (\(error)): it is replayed at the next mount")
        }
        // Every request is answered and nothing writes the store any more: the next daemon
        // (`umount` then `mount` at once) may take it while this one wipes and exits.
        close(s.storeLock)
        s.fs.kernel.detach()
        HeapTrimmer.shared.stop()
        s.server.stop()
        s.controller.shutdown()
        fuse_session_unmount(se)
        fuse_remove_signal_handlers(se)
        fuse_session_destroy(se)
        Unmanaged<FuseContext>.fromOpaque(userdata).release()
        return rc == 0 || rc == SIGTERM || rc == SIGINT || rc == SIGHUP ? 0 : 1
    }
}
