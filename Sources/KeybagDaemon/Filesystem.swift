import CFuse
import Dispatch
import CSodium
import CSystem
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

    /// Backing names the store reserves for its own files (see `NameCipher.reservedPrefix`).
    static let reservedPrefix = NameCipher.reservedPrefix

    let table: NodeTable
    /// Names, symlink targets and directory metadata under the volume key.
    let names: NameCipher
    /// The store's folder of long symlink targets.
    let targetsFD: Int32
    /// The store's folder of sealed user xattrs.
    let xattrsFD: Int32
    /// Serialises read-modify-write of stored xattr sets.
    let xattrUpdates = Locked(())
    /// How many xattr sets are stored (while none are, removals skip looking for one).
    let storedXattrSets: Atomic<Int>
    /// Whether the kernel enforces POSIX ACLs on this mount (set at INIT; see PosixACLs.swift).
    let posixACLs = Atomic<Bool>(false)
    /// Bumped whenever a directory's class or the tree's shape changes; cached
    /// inherited classes of an older generation are recomputed.
    let classGeneration = Atomic<UInt64>(1)
    let keyring: ClassKeyring
    let content: EncryptedContent
    let cipher: ContentCipher
    let defaultClass: ProtectionClass
    /// Default classes given to directories created at matching paths.
    let policy: ClassPolicy
    /// Open file handles (for `status`).
    let openFiles = Atomic<Int>(0)
    /// Asks the kernel to drop an inode's cached pages, soon and from another thread (set
    /// by the daemon once the FUSE session exists).
    let dropPages = Locked<(@Sendable (UInt64) -> Void)?>(nil)
    /// Runs work on the daemon's own queue, not a FUSE thread (set with `dropPages`; runs
    /// the work at once until then).
    let onDaemonQueue = Locked<(@Sendable (@escaping @Sendable () -> Void) -> Void)?>(nil)

    /// Runs `work` on the daemon's own queue.
    func soon(_ work: @escaping @Sendable () -> Void) {
        if let q = onDaemonQueue.withLock({ $0 }) { q(work) } else { work() }
    }
    /// Tells the kernel to fetch the attributes of these inodes again before it uses them
    /// (set by the daemon once the FUSE session exists). Call it with no lock held.
    let refreshAttributes = Locked<(@Sendable ([UInt64]) -> Void)?>(nil)
    /// The store's free space as the write path sees it (see `StoreSpace`).
    let space: StoreSpace
    /// Whether created objects are chowned to the caller (the daemon runs as root).
    let chownToCaller: Bool

    init(dataFD: Int32, targetsFD: Int32, xattrsFD: Int32, names: NameCipher, keyring: ClassKeyring, cipher: ContentCipher, defaultClass: ProtectionClass,
         policy: ClassPolicy = ClassPolicy(), threads: Int = 16) throws {
        table = try NodeTable(rootFD: dataFD)
        space = StoreSpace(storeFD: dataFD, threads: threads) { [keyring] in keyring.access.canOpen(.complete) }
        self.names = names
        self.targetsFD = targetsFD
        self.xattrsFD = xattrsFD
        self.keyring = keyring
        self.cipher = cipher
        self.content = EncryptedContent(layout: BlockLayout(cipher: cipher))
        self.defaultClass = defaultClass
        self.policy = policy
        self.chownToCaller = geteuid() == 0
        storedXattrSets = Atomic(Self.countStoredSets(xattrsFD))
    }

    /// Stored xattr sets in the store's folder (temporary files not counted).
    private static func countStoredSets(_ dirFD: Int32) -> Int {
        let fd = openat(dirFD, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0, let dir = fdopendir(fd) else { if fd >= 0 { close(fd) }; return 0 }
        defer { closedir(dir) }
        var count = 0
        while let ent = readdir(dir) {
            if Self.entryName(ent).pointee != CChar(UInt8(ascii: ".")) { count += 1 }
        }
        return count
    }

    /// Caller identity of a request.
    struct Caller {
        let uid: uid_t
        let gid: gid_t
        /// The calling process (0 when unknown).
        var pid: pid_t = 0
        /// The caller's umask, for creations (0 when the kernel applied it already).
        var umask: mode_t = 0

        /// Whether the caller holds CAP_FSETID (keeps set-ID bits through writes and
        /// truncates); read from /proc only when a file has such bits. Capabilities held in a
        /// user namespace other than the daemon's (`unshare -r`) count in that namespace only:
        /// there the caller is treated as having none (stricter than the kernel, which also
        /// allows them for files whose owner and group the namespace maps).
        var mayKeepSetID: Bool {
            guard pid > 0 else { return uid == 0 }
            guard sharesDaemonUserNamespace,
                  let caps = statusField("CapEff:").flatMap({ UInt64($0, radix: 16) }) else { return false }
            return caps & (1 << 4) != 0   // CAP_FSETID
        }

        /// Whether the calling process is in the daemon's user namespace (false if unknown).
        private var sharesDaemonUserNamespace: Bool {
            var theirs = stat(), ours = stat()
            guard fstatat(AT_FDCWD, "/proc/\(pid)/ns/user", &theirs, 0) == 0,
                  fstatat(AT_FDCWD, "/proc/self/ns/user", &ours, 0) == 0 else { return false }
            return theirs.st_ino == ours.st_ino && theirs.st_dev == ours.st_dev
        }

        /// Whether the caller is in group `g`: its own, or a supplementary one (from /proc).
        func isInGroup(_ g: gid_t) -> Bool {
            if gid == g { return true }
            return statusField("Groups:")?.split(separator: " ").contains { gid_t($0) == g } ?? false
        }

        /// A field of the calling process's /proc status, trimmed; nil when unknown.
        private func statusField(_ key: String) -> String? {
            guard pid > 0, let status = ProcFile.read("/proc/\(pid)/status"),
                  let line = status.split(separator: "\n").first(where: { $0.hasPrefix(key) }) else { return nil }
            return line.dropFirst(key.count).trimmingCharacters(in: .whitespaces).replacingOccurrences(of: "\t", with: " ")
        }
    }

    /// The mode a regular file keeps after a modification (write, truncate, fallocate) by
    /// `caller`, as the kernel rules it: nothing changes for a caller with CAP_FSETID, else
    /// `modeWithoutSetID`. nil when nothing changes.
    static func modeAfterModification(_ st: stat, by caller: Caller) -> mode_t? {
        guard st.st_mode & (S_ISUID | S_ISGID) != 0, !caller.mayKeepSetID else { return nil }
        return modeWithoutSetID(st, by: caller)
    }

    /// The mode after a modification by `caller`, who lacks CAP_FSETID: set-user-ID goes;
    /// set-group-ID goes when group-executable, or when the caller is not in the file's
    /// group (without group execute it marks mandatory locking, which the group may keep).
    /// nil when nothing changes.
    static func modeWithoutSetID(_ st: stat, by caller: Caller) -> mode_t? {
        let mode = st.st_mode
        var kill: mode_t = mode & S_ISUID
        if mode & S_ISGID != 0 && (mode & S_IXGRP != 0 || !caller.isInGroup(st.st_gid)) { kill |= S_ISGID }
        return kill == 0 ? nil : mode & 0o7777 & ~kill
    }

    /// Clears the set-ID bits of an open file after a write the kernel marked as coming from
    /// a caller without CAP_FSETID (FUSE_HANDLE_KILLPRIV_V2).
    func clearSetID(_ h: FileHandle, by caller: Caller) {
        var st = stat()
        if fstat(h.fd, &st) == 0, st.st_mode & (S_ISUID | S_ISGID) != 0, let mode = Self.modeWithoutSetID(st, by: caller) {
            setModeBehindTheKernel(h, mode)
        }
    }

    /// Changes the mode of an open file on a request that does not answer with attributes
    /// (write, fallocate): the kernel keeps the mode it has cached (the attributes it took
    /// just before, when it updated the times) until told to ask again.
    private func setModeBehindTheKernel(_ h: FileHandle, _ mode: mode_t) {
        guard fchmod(h.fd, mode) == 0 else { return }
        refreshAttributes.withLock { $0 }?([h.node.id])
    }

    /// The group a new object of `caller` gets in a directory: unchanged (the directory's,
    /// set by the backing filesystem) in a setgid directory, else the caller's.
    func groupFor(_ caller: Caller, dirFD: Int32) -> gid_t {
        var st = stat()
        if fstat(dirFD, &st) == 0 && st.st_mode & S_ISGID != 0 { return gid_t.max }
        return caller.gid
    }

    // MARK: nodes and attributes

    /// A node by id, or ENOENT / ESTALE.
    func node(_ id: UInt64) throws -> Node {
        guard let n = table.node(id) else { throw FSError(ESTALE) }
        return n
    }

    /// Whether a backing entry is the store's own (metadata, temporaries).
    static func isReserved(_ backing: String) -> Bool { backing.hasPrefix(reservedPrefix) }

    /// Rejects names no directory entry may have.
    static func checkName(_ name: String) throws {
        if name.utf8.count > 255 { throw FSError(ENAMETOOLONG) }
        if name.isEmpty || name == "." || name == ".." || name.utf8.contains(UInt8(ascii: "/")) { throw FSError(EINVAL) }
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
        guard storedLength == NameCipher.longTargetLinkLength else { return NameCipher.targetLength(storedLength: storedLength) }
        var buf = [UInt8](repeating: 0, count: storedLength + 1)
        let n = readlinkat(dirFD, name, &buf, buf.count)
        let link = n > 0 ? String(decoding: buf[0..<n], as: UTF8.self) : ""
        var t = stat()
        guard link.hasPrefix(NameCipher.longTargetPrefix),
              fstatat(targetsFD, String(link.dropFirst(NameCipher.longTargetPrefix.count)), &t, AT_SYMLINK_NOFOLLOW) == 0 else {
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
                if len > 0 { return remembered(table.remember(handle: Array(buf[0..<Int(len)]), stat: st), st, parent: p, backing) }
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
    func getattr(_ id: UInt64, handle: FileHandle? = nil) throws -> stat {
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
        // Unlocked (class A opens), nothing is refused: one atomic load on the hot path.
        guard !access.canOpen(.complete), n.isRegular, let cls = n.io.read({ $0.protectionClass }), cls != .none else { return false }
        return !access.canOpen(cls) && (cls == .complete || !access.canCreate(cls))
    }

    /// Seconds the kernel may keep a node's attributes: `normal`, but none while its
    /// handles are refused or the store is (nearly) full, so that every write the kernel
    /// would take into its page cache asks for them first (see `getattr`).
    func attributeSeconds(_ id: UInt64, normal: Double) -> Double {
        if space.isTight { return 0 }
        guard !keyring.access.canOpen(.complete), let n = table.node(id), handlesRefused(n) else { return normal }
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
        if caller.uid == st.st_uid { bits = (st.st_mode >> 6) & 0o7 }
        else if caller.gid == st.st_gid || groups.contains(st.st_gid) { bits = (st.st_mode >> 3) & 0o7 }
        else { bits = st.st_mode & 0o7 }
        if want & ~bits != 0 { throw FSError(EACCES) }
    }

    /// setattr: mode, owner, size, times; returns the new attributes.
    /// `clearSetIDFor`: the caller of a truncate the kernel marked as coming from one without
    /// CAP_FSETID.
    /// A regular file with an open handle (the kernel names it only for a truncate; tar's
    /// fchown, fchmod and futimens after writing come without) is changed through that
    /// handle's descriptor, else through an `O_PATH` descriptor opened for the call.
    func setattr(_ id: UInt64, handle: FileHandle?, mode: mode_t?, uid: uid_t?, gid: gid_t?, size: Int?,
                 atime: timespec?, mtime: timespec?, clearSetIDFor: Caller? = nil) throws -> stat {
        let n = try node(id)
        if let size {
            guard n.isRegular else { throw FSError(n.isDirectory ? EISDIR : EINVAL) }
            try truncate(n, handle: handle, to: size)
        }
        let change = AttributeChange(mode: mode, uid: uid, gid: gid, atime: atime, mtime: mtime,
                                     clearSetIDFor: size != nil && n.isRegular ? clearSetIDFor : nil)
        if let handle { return try change.apply(open: handle.fd, self) }
        if n.isRegular, let st = try n.withOpenFD({ try change.apply(open: $0, self) }) { return st }
        return try n.withPathFD { try change.apply(path: $0, type: n.type, self) }
    }

    /// The attribute changes of one setattr (all but the size).
    struct AttributeChange {
        let mode: mode_t?, uid: uid_t?, gid: gid_t?, atime: timespec?, mtime: timespec?
        /// Clear the set-ID bits as after a truncate by this caller, who lacks CAP_FSETID
        /// (unless `mode` is set).
        let clearSetIDFor: Caller?

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
            } else if let caller = clearSetIDFor {
                var st = stat()
                if fstat(fd, &st) == 0, let cleared = Filesystem.modeWithoutSetID(st, by: caller) { try check(fchmod(fd, cleared)) }
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
            } else if let caller = clearSetIDFor {
                var st = stat()
                if fstat(pfd, &st) == 0, let cleared = Filesystem.modeWithoutSetID(st, by: caller) { try check(chmod(path, cleared)) }
            }
            if uid != nil || gid != nil {
                try check(fchownat(pfd, "", uid ?? uid_t.max, gid ?? gid_t.max, kbfs_AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))
            }
            if var t = times {
                if type == S_IFLNK {
                    try check(utimensat(pfd, "", &t, kbfs_AT_EMPTY_PATH))   // the link itself
                } else {
                    try check(utimensat(AT_FDCWD, path, &t, 0))
                }
            }
            return try fs.attributes(fd: pfd)
        }
    }

    // MARK: classes and keys

    /// Reads a regular file's header. A header left with two valid slots by a class change
    /// that was cut off gets the older slot (another class's wrap) erased now.
    func readHeader(_ node: Node) throws -> FileHeader {
        let fd = try check(node.open(O_RDONLY))
        defer { close(fd) }
        let (h, superseded) = try EncryptedContent.readHeaderSlots(fd: fd)
        if let superseded {
            let wfd = node.open(O_RDWR)
            if wfd >= 0 {
                defer { close(wfd) }
                do { try EncryptedContent.eraseHeaderSlot(fd: wfd, index: superseded) } catch {
                    MountDaemon.log("could not erase the superseded header slot of inode \(node.backingIno): \(error)")
                }
            } else {
                MountDaemon.log("could not erase the superseded header slot of inode \(node.backingIno): \(String(cString: strerror(errno)))")
            }
        }
        return h
    }

    /// Runs `body` with the file key for `use`, holding the inode's lock shared when the key
    /// is ready (reads) or alone when it must be loaded or the use writes. Whether the key
    /// may be used is `FileKeyLife`'s decision alone.
    private func withContentKey<R>(_ node: Node, _ use: FileKeyLife.Use, _ body: (FileContentKey) throws -> R) throws -> R {
        if use == .read {
            let access = keyring.access
            let done: R?? = try node.io.read { st in
                guard let k = st.readyKey(for: .read, access) else { return .none }
                return .some(try body(k))
            }
            if case .some(let r) = done, let r { return r }
        }
        return try node.io.write { st in
            _ = try st.header { try readHeader(node) }
            let key: FileContentKey
            do { key = try st.key(for: use, keyring: keyring, cipher: cipher) } catch {
                Failpoint.keyRefused.hit()
                throw error
            }
            return try body(key)
        }
    }

    /// Zeroes a buffer that carried plaintext, so it cannot outlive its request. Every class:
    /// a file read or written as class C may be made `complete` before the next lock.
    static func wipe(_ b: UnsafeRawBufferPointer) {
        guard let base = b.baseAddress, b.count > 0 else { return }
        sodium_memzero(UnsafeMutableRawPointer(mutating: base), b.count)
    }

    // MARK: files

    /// Opens the backing file for a handle and loads the file key (EACCES by class rules).
    func open(_ id: UInt64, flags: Int32, caller: Caller? = nil) throws -> FileHandle {
        let n = try node(id)
        guard n.isRegular else { throw FSError(n.isDirectory ? EISDIR : EINVAL) }
        let writable = (flags & O_ACCMODE) != O_RDONLY
        if writable && space.noteWritten() { refreshAttributesOfKnownFiles() }   // nearly full: tight before the first write
        let fd = try check(n.open(writable ? O_RDWR : O_RDONLY))
        let cls: ProtectionClass
        do {
            cls = try n.io.write { st in
                let h = try st.header { try readHeader(n) }
                let key: FileContentKey
                do { key = try st.open(keyring: keyring, cipher: cipher) } catch {
                    Failpoint.keyRefused.hit()
                    throw error
                }
                if flags & O_TRUNC != 0 && writable {
                    do { try content.truncate(fd: fd, key: key, to: 0) } catch { _ = st.release(keyring: keyring); throw error }
                }
                return h.protectionClass
            }
        } catch {
            close(fd)
            throw FSError(error)
        }
        // An open that truncates is a modification: the kernel leaves the set-ID bits to us
        // when it hands O_TRUNC over (atomic O_TRUNC).
        if flags & O_TRUNC != 0 && writable, let caller {
            var st = stat()
            if fstat(fd, &st) == 0, let mode = Self.modeAfterModification(st, by: caller) { _ = fchmod(fd, mode) }
        }
        openFiles.add(1, ordering: .relaxed)
        return FileHandle(node: n, fd: fd, writable: writable, directIO: usesDirectIO(cls))
    }

    /// Whether handles of `cls` bypass the kernel's page cache: class A, where the kernel
    /// lets mappings use direct-I/O handles (else class A keeps cached I/O, and a refused
    /// write can be seen by another reader of the file while the daemon answers it).
    func usesDirectIO(_ cls: ProtectionClass) -> Bool { cls == .complete && FuseChannel.directIOMappable }

    /// Creates a regular file with the inherited class (EACCES when that class cannot create
    /// now). Atomic: the header is written to an unnamed file that is then linked under its
    /// name, so a crash never leaves a named file without a header.
    func create(parent: UInt64, name: String, mode: mode_t, flags: Int32, caller: Caller) throws -> (Node, stat, FileHandle) {
        try retryingWhileSpaceReturns { try createOnce(parent: parent, name: name, mode: mode, flags: flags, caller: caller) }
    }

    /// One attempt of `create`; undoes what it did when it fails.
    private func createOnce(parent: UInt64, name: String, mode: mode_t, flags: Int32, caller: Caller) throws -> (Node, stat, FileHandle) {
        try Self.checkName(name)
        let p = try node(parent)
        let cls = try inheritedClass(p)
        guard let (wrapKey, epoch) = keyring.wrappingKey(for: cls) else { throw FSError(EACCES) }
        let entry = try backingName(p, name)
        let sideCreated = try ensureSideFile(p, entry)
        let file: NewFile
        do { file = try newFile(in: p, class: cls, wrapKey: wrapKey, mode: mode, caller: caller, nameless: false) } catch {
            if sideCreated { removeSideFile(p, entry) }
            throw FSError(error)
        }
        var linked = false
        do {
            let rc = link(unnamed: file.fd, temp: file.temp, dirFD: p.fd, as: entry.name)
            if rc == EEXIST && flags & O_EXCL == 0 {
                file.key.wipe()
                close(file.fd)
                let (n, _) = try lookupBacking(p, entry.name)
                let h = try open(n.id, flags: flags)
                return (n, try attributes(fd: h.fd), h)
            }
            guard rc == 0 else { throw FSError(rc) }
            linked = true
            Failpoint.createBeforeKeyJoinsInode.hit()
            let pathFD = try check(openat(p.fd, entry.name, kbfs_O_PATH | O_NOFOLLOW | O_CLOEXEC))
            var st = stat()
            try check(fstat(pathFD, &st))
            return try adopt(file, node: table.remember(fd: pathFD, stat: st), stat: st, class: cls, epoch: epoch)
        } catch {
            if linked { unlinkat(p.fd, entry.name, 0) }
            if sideCreated && (error as? FSError)?.errno != EEXIST { removeSideFile(p, entry) }
            close(file.fd)
            throw FSError(error)
        }
    }

    /// `open(2)` with `O_TMPFILE` in `parent`: a file of the inherited class with no name,
    /// gone at its last close unless `linkat(2)` gives it one (a backing O_TMPFILE file,
    /// whose node keeps a descriptor: an unlinked inode cannot be reopened by handle).
    /// EOPNOTSUPP where the store's filesystem has no O_TMPFILE.
    func createUnnamed(parent: UInt64, mode: mode_t, caller: Caller) throws -> (Node, stat, FileHandle) {
        try retryingWhileSpaceReturns {
            let p = try node(parent)
            let cls = try inheritedClass(p)
            guard let (wrapKey, epoch) = keyring.wrappingKey(for: cls) else { throw FSError(EACCES) }
            let file = try newFile(in: p, class: cls, wrapKey: wrapKey, mode: mode, caller: caller, nameless: true)
            do {
                let pathFD = try check(Glibc.open("/proc/self/fd/\(file.fd)", kbfs_O_PATH | O_CLOEXEC))
                var st = stat()
                guard fstat(pathFD, &st) == 0 else { let e = errno; close(pathFD); throw FSError(e) }
                return try adopt(file, node: table.remember(keeping: pathFD, stat: st), stat: st, class: cls, epoch: epoch)
            } catch {
                close(file.fd)
                throw FSError(error)
            }
        }
    }

    /// A new backing file with its header, not yet in the node table.
    private struct NewFile {
        /// Read-write descriptor of the backing file.
        let fd: Int32
        /// Its reserved temporary name where the store has no O_TMPFILE, else nil.
        let temp: String?
        let header: FileHeader
        let key: FileContentKey
    }

    /// A backing file in `p` of class `cls` owned by `caller`, with its header written and
    /// no name of its own (`unnamedFile`; `nameless` refuses the temporary-name fallback).
    /// Leaves nothing behind when it throws.
    private func newFile(in p: Node, class cls: ProtectionClass, wrapKey: FileHeader.ClassKey, mode: mode_t, caller: Caller, nameless: Bool) throws -> NewFile {
        // Made without set-ID bits: they come once the file is the caller's (the kernel already
        // dropped those the caller may not set, Linux 6.0+); never on a file left as root's.
        let (bfd, temp) = try unnamedFile(dirFD: p.fd, mode: creationMode(mode, in: p, by: caller) & 0o1777, fallback: !nameless)
        do {
            let owned = !chownToCaller || !Failpoint.chownRefused.isOn && fchown(bfd, caller.uid, groupFor(caller, dirFD: p.fd)) == 0
            var st = stat()
            if owned && mode & (S_ISUID | S_ISGID) != 0 && fstat(bfd, &st) == 0 {
                fchmod(bfd, st.st_mode & 0o1777 | mode & (S_ISUID | S_ISGID))
            }
            let raw = SecureKey(random: 32)
            let header = try FileHeader.create(fileKey: raw, class: cls, cipher: cipher, using: wrapKey)
            try EncryptedContent.writeNewHeader(fd: bfd, header)
            return NewFile(fd: bfd, temp: temp, header: header, key: try FileContentKey(key: raw, header: header))
        } catch {
            if let temp { unlinkat(p.fd, temp, 0) }
            close(bfd)
            throw FSError(error)
        }
    }

    /// Gives a new file's key to its node and opens the creator's handle on it.
    private func adopt(_ file: NewFile, node n: Node, stat st: stat, class cls: ProtectionClass, epoch: UInt64) throws -> (Node, stat, FileHandle) {
        do {
            try n.io.write { s in try s.adoptCreated(header: file.header, key: file.key, epoch: epoch, keyring: keyring) }
        } catch {
            table.forget(n.id, count: 1)   // the kernel never learns of this node
            throw error
        }
        openFiles.add(1, ordering: .relaxed)
        return (n, plaintextAttributes(st, linkAt: -1, ""), FileHandle(node: n, fd: file.fd, writable: true, directIO: usesDirectIO(cls)))
    }

    /// A new backing file without a name in `dirFD` (O_TMPFILE), or under a reserved
    /// temporary name where the backing filesystem has no O_TMPFILE.
    private func unnamedFile(dirFD: Int32, mode: mode_t, fallback: Bool) throws -> (Int32, String?) {
        let fd = openat(dirFD, ".", kbfs_O_TMPFILE | O_RDWR | O_CLOEXEC, mode)
        if fd >= 0 { return (fd, nil) }
        guard errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL else { throw FSError(errno) }
        guard fallback else { throw FSError(EOPNOTSUPP) }
        let temp = Self.reservedPrefix + "tmp-" + Base64URL.encode(Sodium.randomArray(9))
        return (try check(openat(dirFD, temp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode)), temp)
    }

    /// Links a file from `unnamedFile` under `name` (never replacing an entry); removes the
    /// temporary name. Returns 0 or the errno (EEXIST when the name is taken).
    private func link(unnamed fd: Int32, temp: String?, dirFD: Int32, as name: String) -> Int32 {
        let rc = temp.map { linkat(dirFD, $0, dirFD, name, 0) } ?? linkat(AT_FDCWD, "/proc/self/fd/\(fd)", dirFD, name, AT_SYMLINK_FOLLOW)
        let e = rc == 0 ? 0 : errno
        if let temp { unlinkat(dirFD, temp, 0) }
        return e
    }

    /// A regular backing file of 0 bytes has no header: left by a crash of a version that
    /// created the name before writing the header. It becomes an empty file of the
    /// directory's class (a fresh file key; there is no data to lose). Needs that class's
    /// wrapping key now; otherwise the file stays as it is (EIO) until it can.
    func giveHeaderToEmptyFile(_ n: Node, parent p: Node) {
        guard let cls = try? inheritedClass(p), let (wrapKey, _) = keyring.wrappingKey(for: cls) else { return }
        n.io.write { st in
            guard st.header == nil else { return }
            let fd = n.open(O_RDWR)
            guard fd >= 0 else { return }
            defer { close(fd) }
            var s = stat()
            guard fstat(fd, &s) == 0, s.st_size == 0 else { return }
            let raw = SecureKey(random: 32)
            defer { raw.wipe() }
            do {
                try EncryptedContent.writeNewHeader(fd: fd, try FileHeader.create(fileKey: raw, class: cls, cipher: cipher, using: wrapKey))
                MountDaemon.log("inode \(n.backingIno) had no header (0 bytes, left by a crash): now an empty \(cls.name) file")
            } catch {
                MountDaemon.log("could not give the empty inode \(n.backingIno) a header: \(error)")
            }
        }
    }

    /// The last close of a handle: class B file keys die with the last handle once locked,
    /// and the inode's cached pages are handed to `dropPages` (which tells the kernel from
    /// a thread of its own, not this FUSE thread).
    func release(_ h: FileHandle) {
        HeapTrimmer.shared.note()
        let (closed, header) = h.node.io.write { st in (st.release(keyring: keyring), st.header) }
        let lastClose = closed.lastClose
        if closed.pagesMustGo { dropPages.withLock { $0 }?(h.node.id) }
        openFiles.subtract(1, ordering: .relaxed)
        // The last close of a file unlinked while open takes its xattr set with it.
        if lastClose, let header, hasStoredXattrs {
            var st = stat()
            if fstat(h.fd, &st) == 0 && st.st_nlink == 0 { dropXattrs(Base64URL.encode(header.fileID)) }
        }
    }

    /// Reads through a handle and replies while still holding the inode's lock, so a lock
    /// (which takes it alone before dropping the page cache) cannot be overtaken by a reply.
    /// The reply buffer is zeroed once sent.
    func read(_ h: FileHandle, offset: Int, into buf: UnsafeMutableRawBufferPointer, reply: (Int) -> Void) throws {
        guard offset >= 0 else { throw FSError(EINVAL) }
        if offset >= Self.maxFileSize { return reply(0) }
        try withContentKey(h.node, .read) { key in
            let n: Int
            do { n = try content.read(fd: h.fd, key: key, offset: offset, into: buf) } catch {
                Self.wipe(UnsafeRawBufferPointer(buf))
                throw error
            }
            reply(n)
            Self.wipe(UnsafeRawBufferPointer(rebasing: buf[0..<n]))
        }
    }

    /// Writes through a handle. The request's plaintext (in the FUSE receive buffer) is
    /// zeroed afterwards, whether the write was accepted or refused.
    func write(_ h: FileHandle, offset: Int, data: UnsafeRawBufferPointer) throws {
        guard offset >= 0 else { throw FSError(EINVAL) }
        guard offset <= Self.maxFileSize - data.count else { throw FSError(EFBIG) }
        defer { Self.wipe(data) }
        try retryingWhileSpaceReturns {
            try withContentKey(h.node, .write) { key in
                try content.write(fd: h.fd, key: key, offset: offset, data: data)
            }
        }
    }

    /// Runs `body` (which must leave nothing half done when it throws) through
    /// `StoreSpace.retryingWhileSpaceReturns`; a failure for want of space makes the store
    /// full, and the kernel is told to ask for the attributes of every known file again.
    func retryingWhileSpaceReturns<R>(_ body: () throws -> R) throws -> R {
        do {
            let r = try space.retryingWhileSpaceReturns(body)
            if space.noteWritten() { refreshAttributesOfKnownFiles() }
            return r
        } catch {
            if [ENOSPC, EDQUOT].contains(FSError(error).errno), space.noteFull() { refreshAttributesOfKnownFiles() }
            throw error
        }
    }

    /// Tells the kernel to ask again for the attributes of every regular file it knows, from
    /// the daemon's own queue (not this FUSE thread: the kernel may wait there for an inode
    /// being evicted, whose write-back needs a FUSE thread).
    func refreshAttributesOfKnownFiles() {
        let ids = table.regularFiles().map(\.id)
        guard let refresh = refreshAttributes.withLock({ $0 }) else { return }
        soon { refresh(ids) }
    }

    /// Truncates through a handle when given, else through a fresh backing descriptor.
    func truncate(_ n: Node, handle: FileHandle?, to size: Int) throws {
        guard size >= 0 else { throw FSError(EINVAL) }
        guard size <= Self.maxFileSize else { throw FSError(EFBIG) }
        let fd: Int32
        if let handle, handle.writable { fd = handle.fd } else { fd = try check(n.open(O_RDWR)) }
        defer { if fd != handle?.fd { close(fd) } }
        try retryingWhileSpaceReturns {
            try withContentKey(n, .write) { key in
                try content.truncate(fd: fd, key: key, to: size)
            }
        }
    }

    /// fallocate: mode 0 (allocate, growing the size), KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE,
    /// ZERO_RANGE (optionally KEEP_SIZE); other modes are EOPNOTSUPP.
    /// The kernel leaves set-ID bits to us here (no per-request flag, as for writes), so they
    /// go as after a write by `caller`.
    func fallocate(_ h: FileHandle, mode: Int32, offset: Int, length: Int, caller: Caller) throws {
        let keepSize: Int32 = 0x01, punchHole: Int32 = 0x02, zeroRange: Int32 = 0x10
        guard offset >= 0, length > 0 else { throw FSError(EINVAL) }
        guard offset <= Self.maxFileSize - length else { throw FSError(EFBIG) }
        guard mode & ~(keepSize | punchHole | zeroRange) == 0 else { throw FSError(EOPNOTSUPP) }
        if mode & punchHole != 0 && (mode & keepSize == 0 || mode & zeroRange != 0) { throw FSError(EOPNOTSUPP) }
        guard h.writable else { throw FSError(EBADF) }
        let layout = content.layout
        try retryingWhileSpaceReturns { try withContentKey(h.node, .write) { key in
            let size = try content.plainSize(fd: h.fd)
            let end = offset + length
            if mode & (punchHole | zeroRange) != 0 {
                try content.zeroRange(fd: h.fd, key: key, offset: offset, length: length) { off, len in
                    kbfs_fallocate(h.fd, punchHole | keepSize, Int64(off), Int64(len)) == 0
                }
            }
            if mode & keepSize == 0 && end > size {
                try content.truncate(fd: h.fd, key: key, to: end)
            }
            if mode & (punchHole | zeroRange) == 0 {
                // Reserve backing space for the range (best effort where the backing fs cannot).
                let b0 = layout.cipherOffset(ofBlock: offset / BlockLayout.plainBlockSize)
                let b1 = layout.cipherOffset(ofBlock: (end - 1) / BlockLayout.plainBlockSize + 1)
                let bsize = layout.backingSize(plainSize: max(size, mode & keepSize == 0 ? end : size))
                let upTo = mode & keepSize == 0 ? min(b1, bsize) : b1
                if upTo > b0 && kbfs_fallocate(h.fd, keepSize, Int64(b0), Int64(upTo - b0)) != 0 && errno == ENOSPC {
                    throw FSError(ENOSPC)
                }
            }
        } }
        var st = stat()
        if fstat(h.fd, &st) == 0, let cleared = Self.modeAfterModification(st, by: caller) { setModeBehindTheKernel(h, cleared) }
    }

    /// fsync of a handle.
    func fsync(_ h: FileHandle, dataOnly: Bool) throws {
        try check(dataOnly ? fdatasync(h.fd) : Glibc.fsync(h.fd))
    }

    // MARK: user.protection

    /// The class of a file, or the stored default of a directory (ENODATA where none).
    func protection(of id: UInt64) throws -> ProtectionClass {
        let n = try node(id)
        if n.isDirectory {
            guard let c = try meta(of: n).defaultClass else { throw FSError(ENODATA) }
            return c
        }
        guard n.isRegular else { throw FSError(ENODATA) }
        if let c = n.io.read({ $0.protectionClass }) { return c }
        return try n.io.write { st in try st.header { try readHeader(n) }.protectionClass }
    }

    /// Changes a file's class by rewrapping its key (the rules are `FileKeyLife`'s): the new
    /// slot is written and made durable, then the old slot is erased and that made durable,
    /// so no older class's wrap survives a finished change. On a directory, stores the
    /// default for new children.
    func setProtection(of id: UInt64, to cls: ProtectionClass) throws {
        let n = try node(id)
        if n.isDirectory { return try setDirectoryClass(n, cls) }
        guard n.isRegular else { throw FSError(EPERM) }
        let fd = try check(n.open(O_RDWR))
        defer { close(fd) }
        try n.io.write { st in
            _ = try st.header { try readHeader(n) }
            try st.changeClass(to: cls, keyring: keyring, cipher: cipher) { next in
                try EncryptedContent.writeHeaderSlot(fd: fd, next)
                Failpoint.classChangeBetweenSlots.hit()
                try EncryptedContent.eraseHeaderSlot(fd: fd, index: 1 - next.slot)
            }
        }
    }

    /// Removes a directory's stored default (files always have a class: EPERM).
    func removeProtection(of id: UInt64) throws {
        let n = try node(id)
        guard n.isDirectory else { throw FSError(n.isRegular ? EPERM : ENODATA) }
        guard try meta(of: n).defaultClass != nil else { throw FSError(ENODATA) }
        try setDirectoryClass(n, nil)
    }

    // MARK: lock

    /// Lock, first pass (keys still present): the inodes whose page cache the kernel must
    /// write back and drop before the keys go.
    func inodesHoldingProtectedPages() -> [UInt64] {
        table.regularFiles().compactMap { n in n.io.read { $0.holdsProtectedPages } ? n.id : nil }
    }

    /// Lock, after the class keys are evicted: zeroes class A file keys and the keys of
    /// class B files with no open handle. Returns the nodes whose page cache must go.
    func evictFileKeys() -> [UInt64] {
        table.regularFiles().compactMap { n in n.io.write { $0.evict() } ? n.id : nil }
    }

    /// Return to `beforeFirstUnlock`: inodes whose pages need a key other than class D's.
    func inodesHoldingKeysButNone() -> [UInt64] {
        table.regularFiles().compactMap { n in n.io.read { $0.protectionClass.map { $0 != .none } ?? false } ? n.id : nil }
    }

    /// Return to `beforeFirstUnlock`, after the class keys are gone: zeroes every file key
    /// but class D's, open handles or not. Returns the nodes whose page cache must go.
    func evictAllFileKeysButNone() -> [UInt64] {
        table.regularFiles().compactMap { n in n.io.write { $0.evictAllButNone() } ? n.id : nil }
    }

    /// Daemon exit: every file key zeroed.
    func wipeFileKeys() {
        for n in table.regularFiles() { n.io.write { $0.wipe() } }
    }

    /// statfs of the store's filesystem, in plaintext: each 4096-byte block of content takes
    /// `cipherBlockSize` bytes of the store, so the space a program can fill is that much
    /// smaller than the store's (a program that fallocates what df says is free must fit).
    func statfs() throws -> statvfs {
        var s = statvfs()
        try check(fstatvfs(table.root.fd, &s))
        let plain = UInt64(BlockLayout.plainBlockSize), cipher = UInt64(content.layout.cipherBlockSize)
        func scaled(_ n: fsblkcnt_t) -> fsblkcnt_t { fsblkcnt_t(UInt64(n) / cipher * plain + UInt64(n) % cipher * plain / cipher) }
        s.f_blocks = scaled(s.f_blocks)
        s.f_bfree = scaled(s.f_bfree)
        s.f_bavail = scaled(s.f_bavail)
        return s
    }
}

