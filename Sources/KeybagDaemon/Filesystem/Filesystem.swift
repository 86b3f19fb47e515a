import CSystem
import Dispatch
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization

/// An operation's failure as an errno value (what the kernel gets back).
struct FSError: Error {
    let errno: Int32
    init(_ e: Int32) { errno = e }

    /// Maps core and system errors: evicted keys are EACCES, bad data is EIO.
    init(_ error: Error) {
        switch error {
        case let e as FSError: errno = e.errno
        case KeybagError.keyUnavailable: errno = EACCES
        case KeybagError.corrupt: errno = EIO
        case KeybagError.system(_, let e): errno = e
        default: errno = EIO
        }
    }
}

/// Runs a syscall-style call, throwing its errno when it returns -1.
@discardableResult
@inline(__always)
func check<T: BinaryInteger>(_ r: T) throws -> T {
    if r < 0 { throw FSError(errno) }
    return r
}

/// The filesystem behind the FUSE glue: maps each operation onto the backing store and
/// enforces the class rules. Every method throws `FSError` with the errno to reply.
final class Filesystem: Sendable {
    /// Largest plaintext size (and offset) accepted: keeps every backing offset far from Int overflow.
    static let maxFileSize = 1 << 60

    let table: NodeTable
    /// Names, symlink targets and directory metadata under the volume key.
    let names: NameCipher
    /// The store's folder of long symlink targets.
    let targetsFD: Int32
    /// The store's user xattr sets.
    let xattrs: XattrStorage
    /// POSIX ACLs, kept as the backing objects' own (on when INIT agreed to them).
    let acls = PosixACLs()
    /// The mount's default class, its directory policy, and their generation.
    let classes: ClassDefaults
    /// What the store watcher reports of another writer (for lookups' "absent" replies).
    let underneath = ChangesUnderneath()
    let keyring: ClassKeyring
    let content: EncryptedContent
    let cipher: ContentCipher
    /// Open file handles (for `status`).
    let openFiles = Atomic<Int>(0)
    /// Page drops, attribute refreshes and off-thread work (see `KernelNotifier`).
    let kernel: KernelNotifier
    /// The store's free space as the write path sees it (see `StoreSpace`).
    let space: StoreSpace
    /// Whether created objects are chowned to the caller (the daemon runs as root).
    let chownToCaller: Bool
    /// Whether the store's file system reports holes exactly (`kbfs_reports_holes`): writes
    /// below a file's first hole then reserve no space (`FileState.allocated`).
    let storeReportsHoles: Bool
    /// The store's overwrite journal (nil: blocks are rewritten in place, as before it).
    let journaling: Journaling?
    /// Where notes go (the daemon's standard error).
    let log: EventLog

    init(
        dataFD: Int32, targetsFD: Int32, xattrsFD: Int32, names: NameCipher, keyring: ClassKeyring,
        cipher: ContentCipher, defaultClass: ProtectionClass,
        policy: ClassPolicy = ClassPolicy(), threads: Int = 16, kernel: KernelNotifier, journaling: Journaling? = nil,
        log: EventLog = .standardError
    ) throws {
        self.journaling = journaling
        self.log = log
        table = try NodeTable(rootFD: dataFD)
        self.kernel = kernel
        space = StoreSpace(storeFD: dataFD, threads: threads) { [keyring] in keyring.access.canOpen(.complete) }
        self.names = names
        self.targetsFD = targetsFD
        self.xattrs = XattrStorage(dirFD: xattrsFD, names: names, log: log)
        self.keyring = keyring
        self.cipher = cipher
        self.content = EncryptedContent(layout: BlockLayout(cipher: cipher))
        self.classes = ClassDefaults(mountDefault: defaultClass, policy: policy)
        self.chownToCaller = geteuid() == 0
        self.storeReportsHoles = kbfs_reports_holes(dataFD) == 1
    }

    // MARK: nodes and attributes

    /// A node by id, or ENOENT / ESTALE.
    func node(_ id: UInt64) throws -> Node {
        guard let n = table.node(id) else { throw FSError(ESTALE) }
        return n
    }

    /// Rejects names no directory entry may have.
    static func checkName(_ name: String) throws {
        if name.utf8.count > 255 { throw FSError(ENAMETOOLONG) }
        if name.isEmpty || name == "." || name == ".." || name.utf8.contains(UInt8(ascii: "/")) {
            throw FSError(EINVAL)
        }
    }

    /// Attributes with the plaintext size for regular files and symlinks.
    func attributes(fd: Int32) throws -> stat {
        var st = stat()
        try check(fstat(fd, &st))
        return plaintextAttributes(st, linkAt: fd, "")
    }

    /// Backing attributes with the size turned into the plaintext size: of the contents for
    /// a regular file, of the target for a symlink (`linkAt`/`name` reach the link when its
    /// target is kept in the store's `targets/` folder).
    func plaintextAttributes(_ backing: stat, linkAt dirFD: Int32, _ name: String) -> stat {
        var st = backing
        switch st.st_mode & S_IFMT {
        case S_IFREG: st.st_size = off_t(content.layout.plainSize(backingSize: Int(st.st_size)))
        case S_IFLNK: st.st_size = off_t(targetLength(storedLength: Int(st.st_size), linkAt: dirFD, name))
        default: break
        }
        return st
    }

    /// A symlink target's plaintext length, from the length of what the link stores (no
    /// decryption); a target kept in `targets/` is measured there.
    private func targetLength(storedLength: Int, linkAt dirFD: Int32, _ name: String) -> Int {
        guard storedLength == NameCipher.longTargetLinkLength else {
            return NameCipher.targetLength(storedLength: storedLength)
        }
        var buf = [UInt8](repeating: 0, count: storedLength + 1)
        let n = readlinkat(dirFD, name, &buf, buf.count)
        let link = n > 0 ? String(decoding: buf[0..<n], as: UTF8.self) : ""
        var t = stat()
        guard let id = StoreNames.longTargetID(link), fstatat(targetsFD, id, &t, AT_SYMLINK_NOFOLLOW) == 0 else {
            return NameCipher.targetLength(storedLength: storedLength)
        }
        return NameCipher.targetLength(storedLength: Int(t.st_size))
    }

    /// Looks up `name` in `parent`: counts one kernel lookup.
    func lookup(parent: UInt64, name: String) throws -> (Node, stat) {
        let p = try node(parent)
        if name.utf8.count > 255 { throw FSError(ENAMETOOLONG) }
        return try lookupBacking(p, try backingName(p, name).name)
    }

    /// Looks up a backing entry of directory `p`: counts one kernel lookup.
    func lookupBacking(_ p: Node, _ backing: String) throws -> (Node, stat) {
        if table.handlesWork {
            // Non-directories: stat and file handle by name, no descriptor (2 syscalls).
            var st = stat()
            try check(fstatat(p.fd, backing, &st, AT_SYMLINK_NOFOLLOW))
            if (st.st_mode & S_IFMT) != S_IFDIR {
                var buf = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
                let len = kbfs_handle_at(p.fd, backing, &buf, Int32(buf.count))
                if len > 0 {
                    return remembered(
                        table.remember(handle: Array(buf[0..<Int(len)]), stat: st), st, parent: p, backing)
                }
            }
        }
        let fd = try check(openat(p.fd, backing, kbfs_O_PATH | O_NOFOLLOW | O_CLOEXEC))
        var st = stat()
        guard fstat(fd, &st) == 0 else { let e = errno; close(fd); throw FSError(e) }
        return remembered(table.remember(fd: fd, stat: st), st, parent: p, backing)
    }

    /// A looked-up node with its attributes; a headerless empty file gets its header first.
    private func remembered(_ n: Node, _ st: stat, parent p: Node, _ backing: String) -> (Node, stat) {
        if (st.st_mode & S_IFMT) == S_IFREG && st.st_size == 0 { giveHeaderToEmptyFile(n, parent: p) }
        return (n, plaintextAttributes(st, linkAt: p.fd, backing))
    }

    /// getattr.
    func getattr(_ id: UInt64, handle: OpenFile? = nil) throws -> stat {
        let n = try node(id)
        // The kernel names a handle when it needs fresh attributes before using it — with
        // the write-back cache, before every write() into the page cache. For a file whose
        // handles are refused now, so is that: a cached handle (class B or C, or one opened
        // before the file became class A) would otherwise take a full page into the kernel,
        // in plaintext, without reaching us.
        if handle != nil, handlesRefused(n) { throw FSError(EACCES) }
        if let handle, handle.writable, space.isTight { try space.checkBeforeCachedWrite() }
        return try n.withPathFD { try attributes(fd: $0) }
    }

    /// Whether I/O through the file's open handles is refused now: class A while locked,
    /// classes B and C once back in (or returning to) `beforeFirstUnlock`. Class B handles
    /// opened before a lock keep working.
    func handlesRefused(_ n: Node) -> Bool {
        let access = keyring.access
        guard Eviction.mayRefuseHandles(access), let file = n.file, let cls = file.io.read({ $0.protectionClass })
        else {
            return false
        }
        return Eviction.refusesHandles(of: cls, access)
    }

    /// Seconds the kernel may keep a node's attributes: `normal`, but none while its
    /// handles are refused or the store is (nearly) full, so that every write the kernel
    /// would take into its page cache asks for them first (see `getattr`).
    func attributeSeconds(_ id: UInt64, normal: Double) -> Double {
        if space.isTight { return 0 }
        guard Eviction.mayRefuseHandles(keyring.access), let n = table.node(id), handlesRefused(n) else {
            return normal
        }
        return 0
    }

    /// access(2). The kernel asks only on mounts without `default_permissions` (root's
    /// private mount): the mode bits decide as the kernel would, root may read and write
    /// anything and execute anything with an x bit (and search any directory).
    func access(_ id: UInt64, mask: Int32, caller: Caller, groups: [gid_t]) throws {
        let st = try getattr(id)
        let want = mode_t(mask) & 0o7
        guard want != 0 else { return }
        let isDir = (st.st_mode & S_IFMT) == S_IFDIR
        if caller.uid == 0 {
            if want & mode_t(X_OK) != 0 && !isDir && st.st_mode & 0o111 == 0 { throw FSError(EACCES) }
            return
        }
        let bits: mode_t
        if caller.uid == st.st_uid {
            bits = (st.st_mode >> 6) & 0o7
        } else if caller.gid == st.st_gid || groups.contains(st.st_gid) {
            bits = (st.st_mode >> 3) & 0o7
        } else {
            bits = st.st_mode & 0o7
        }
        if want & ~bits != 0 { throw FSError(EACCES) }
    }

    /// setattr: mode, owner, size, times; returns the new attributes.
    /// `truncatedBy`: the caller of a truncate, whose modification may clear set-ID bits.
    /// A regular file with an open handle (the kernel names it only for a truncate; tar's
    /// fchown, fchmod and futimens after writing come without) is changed through that
    /// handle's descriptor, else through an `O_PATH` descriptor opened for the call.
    func setattr(
        _ id: UInt64, handle: OpenFile?, mode: mode_t?, uid: uid_t?, gid: gid_t?, size: Int?,
        atime: timespec?, mtime: timespec?, truncatedBy: Caller? = nil
    ) throws -> stat {
        let n = try node(id)
        if let size {
            guard n.isRegular else { throw FSError(n.isDirectory ? EISDIR : EINVAL) }
            try truncate(n, handle: handle, to: size)
        }
        let mtime = n.isRegular ? storedModificationTime(n, requested: mtime) : mtime
        let change = AttributeChange(
            mode: mode, uid: uid, gid: gid, atime: atime, mtime: mtime,
            truncatedBy: size != nil && n.isRegular ? truncatedBy : nil)
        if let handle { return try change.apply(open: handle.fd, self) }
        if n.isRegular, let st = try n.withOpenFD({ try change.apply(open: $0, self) }) { return st }
        return try n.withPathFD { try change.apply(path: $0, type: n.type, self) }
    }

    /// The modification time to store for `requested`. With the write-back cache the kernel
    /// owns a file's times and writes its own back (right after a setxattr too): after a class
    /// change that would set the backing file's time back to before its header was rewritten,
    /// and sync engines and backups, which compare times and sizes, would never copy the new
    /// class. A time before the rewrite is raised to it; a later one (or "now") ends the rule.
    func storedModificationTime(_ n: Node, requested: timespec?) -> timespec? {
        guard let t = requested, t.tv_nsec != kbfs_UTIME_OMIT else { return requested }
        guard let file = n.file else { return t }
        return file.headerRewritten.withLock { rewritten in
            guard let r = rewritten else { return t }
            if t.tv_nsec != kbfs_UTIME_NOW && (t.tv_sec, t.tv_nsec) < (r.tv_sec, r.tv_nsec) { return r }
            rewritten = nil
            return t
        }
    }

    /// The attribute changes of one setattr (all but the size).
    struct AttributeChange {
        let mode: mode_t?, uid: uid_t?, gid: gid_t?, atime: timespec?, mtime: timespec?
        /// The caller of a truncate: set-ID bits go as after its modification (unless `mode` is set).
        let truncatedBy: Caller?

        /// The times for utimensat/futimens (UTIME_OMIT for the one not changed), or nil.
        private var times: [timespec]? {
            guard atime != nil || mtime != nil else { return nil }
            let omit = timespec(tv_sec: 0, tv_nsec: kbfs_UTIME_OMIT)
            return [atime ?? omit, mtime ?? omit]
        }

        /// Applies the change through a regular file's open (not `O_PATH`) descriptor.
        func apply(open fd: Int32, _ fs: Filesystem) throws -> stat {
            if let mode {
                try check(fchmod(fd, mode & 0o7777))
            } else if let caller = truncatedBy {
                var st = stat()
                if fstat(fd, &st) == 0, let cleared = Filesystem.modeAfterModification(st, by: caller) {
                    try check(fchmod(fd, cleared))
                }
            }
            if uid != nil || gid != nil { try check(fchown(fd, uid ?? uid_t.max, gid ?? gid_t.max)) }
            if var t = times { try check(futimens(fd, &t)) }
            return try fs.attributes(fd: fd)
        }

        /// Applies the change through an `O_PATH` descriptor of an object of `type`.
        func apply(path pfd: Int32, type: mode_t, _ fs: Filesystem) throws -> stat {
            let path = "/proc/self/fd/\(pfd)"
            if let mode {
                if type == S_IFLNK { throw FSError(EOPNOTSUPP) }
                try check(chmod(path, mode & 0o7777))
            } else if let caller = truncatedBy {
                var st = stat()
                if fstat(pfd, &st) == 0, let cleared = Filesystem.modeAfterModification(st, by: caller) {
                    try check(chmod(path, cleared))
                }
            }
            if uid != nil || gid != nil {
                try check(
                    fchownat(pfd, "", uid ?? uid_t.max, gid ?? gid_t.max, kbfs_AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))
            }
            if var t = times {
                if type == S_IFLNK {
                    try check(utimensat(pfd, "", &t, kbfs_AT_EMPTY_PATH))  // the link itself
                } else {
                    try check(utimensat(AT_FDCWD, path, &t, 0))
                }
            }
            return try fs.attributes(fd: pfd)
        }
    }

    // MARK: lock

    /// Daemon exit: every file key zeroed.
    func wipeFileKeys() {
        for f in table.regularFiles() { f.file.io.write { $0.wipe() } }
    }

    /// statfs of the store's filesystem, in plaintext: each 4096-byte block of content takes
    /// `cipherBlockSize` bytes of the store, so the space a program can fill is that much
    /// smaller than the store's (a program that fallocates what df says is free must fit).
    func statfs() throws -> statvfs {
        var s = statvfs()
        try check(fstatvfs(table.root.fd, &s))
        let plain = UInt64(BlockLayout.plainBlockSize), cipher = UInt64(content.layout.cipherBlockSize)
        func scaled(_ n: fsblkcnt_t) -> fsblkcnt_t {
            fsblkcnt_t(UInt64(n) / cipher * plain + UInt64(n) % cipher * plain / cipher)
        }
        s.f_blocks = scaled(s.f_blocks)
        s.f_bfree = scaled(s.f_bfree)
        s.f_bavail = scaled(s.f_bavail)
        return s
    }
}

/// The lock's view of the filesystem: every regular file's key life, and the kernel's page cache.
extension Filesystem: EvictionTarget {
    func fileKeyLives() -> [(id: UInt64, life: RWLocked<FileKeyLife>)] {
        table.regularFiles().map { ($0.node.id, $0.file.io) }
    }

    func dropPageCache(_ ids: [UInt64], pass: Eviction.Pass, of kind: Eviction.Kind) {
        kernel.dropPageCache(ids, pass: "\(kind.rawValue) (\(pass.rawValue))")
    }
}
