import CSystem
import Glibc
import KeybagCore

/// Attributes: getattr, setattr and access here; xattrs and ACLs in `Xattrs.swift`, the class
/// (`user.protection`) in `UserProtection.swift`. How long the kernel may cache them follows
/// the class rules (a file whose handles are refused is asked every time).
struct Attributes: Sendable {
    /// The nodes; directory metadata (a directory's class, its xattr id); file content
    /// (truncation, headers, keys, the store's space).
    let table: NodeTable, directories: DirectoryNames, io: FileIO
    /// The store's user xattr sets, and POSIX ACLs kept as the backing objects' own (on when
    /// INIT agreed to them).
    let xattrs: XattrStorage, acls: PosixACLs
    /// Attributes as the mount shows them.
    let plaintext: PlaintextStat

    /// getattr.
    func getattr(_ id: UInt64, handle: OpenFile? = nil) throws -> stat {
        let n = try table.known(id)
        // The kernel names a handle when it needs fresh attributes before using it — with
        // the write-back cache, before every write() into the page cache. For a file whose
        // handles are refused now, so is that: a cached handle (class B or C, or one opened
        // before the file became class A) would otherwise take a full page into the kernel,
        // in plaintext, without reaching us.
        if handle != nil, handlesRefused(n) { throw FSError(EACCES) }
        if let handle, handle.writable, io.space.isTight { try io.space.checkBeforeCachedWrite() }
        return try n.withPathFD { try plaintext.attributes(fd: $0) }
    }

    /// Whether I/O through the file's open handles is refused now: class A while locked,
    /// classes B and C once back in (or returning to) `beforeFirstUnlock`. Class B handles
    /// opened before a lock keep working.
    func handlesRefused(_ n: Node) -> Bool {
        let access = io.keyring.access
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
        if io.space.isTight { return 0 }
        guard Eviction.mayRefuseHandles(io.keyring.access), let n = table.node(id), handlesRefused(n) else {
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
        let n = try table.known(id)
        if let size {
            guard n.isRegular else { throw FSError(n.isDirectory ? EISDIR : EINVAL) }
            try io.truncate(n, handle: handle, to: size)
        }
        let mtime = n.isRegular ? storedModificationTime(n, requested: mtime) : mtime
        let change = AttributeChange(
            mode: mode, uid: uid, gid: gid, atime: atime, mtime: mtime,
            truncatedBy: size != nil && n.isRegular ? truncatedBy : nil)
        if let handle { return try change.apply(open: handle.fd, plaintext) }
        if n.isRegular, let st = try n.withOpenFD({ try change.apply(open: $0, plaintext) }) { return st }
        return try n.withPathFD { try change.apply(path: $0, type: n.type, plaintext) }
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
}
