import CSodium
import CSystem
import Foundation
import Glibc
import KeybagCore

/// The namespace operations: entries made here (mkdir, mknod, symlink, link; readlink),
/// removed and moved in `NamespaceRemoval.swift` (unlink, rmdir, rename), listed in
/// `DirectoryListing.swift`. Regular files are made by `FileIO`'s create.
struct Namespace: Sendable {
    /// The nodes; each directory's names, metadata and class; lookups (entries become nodes).
    let table: NodeTable, directories: DirectoryNames, lookups: EntryLookup
    /// Regular files (mknod makes one as create does), and the xattr sets and ACLs of entries.
    let io: FileIO, attributes: Attributes
    /// The store's folder of long symlink targets.
    let targetsFD: Int32

    /// Names, symlink targets and directory metadata under the volume key (`DirectoryNames`'),
    /// the mount's class rules, and where notes go.
    var names: NameCipher { directories.names }
    var classes: ClassDefaults { directories.classes }
    var log: EventLog { directories.log }
    /// The store's overwrite journal, told of names removed and moved; default ACLs of new entries.
    var journaling: Journaling? { io.journaling }
    var acls: PosixACLs { attributes.acls }

    /// Chowns a new object to the caller when running as root (the group stays the
    /// directory's where it is setgid, as the backing filesystem already set it). What is
    /// not a directory is made without set-ID bits; those of `mode` (which the kernel already
    /// let the caller ask for) are set once it is the caller's, never on one left as root's.
    private func own(_ dirFD: Int32, _ backing: String, _ caller: Caller, mode: mode_t) {
        let group = caller.group(in: dirFD)
        let owned =
            !io.chownToCaller
            || !Failpoint.chownRefused.isOn && fchownat(dirFD, backing, caller.uid, group, AT_SYMLINK_NOFOLLOW) == 0
        var st = stat()
        if owned && mode & (S_ISUID | S_ISGID) != 0 && mode & S_IFMT != S_IFLNK && mode & S_IFMT != S_IFDIR,
            fstatat(dirFD, backing, &st, AT_SYMLINK_NOFOLLOW) == 0
        {
            fchmodat(dirFD, backing, st.st_mode & 0o1777 | mode & (S_ISUID | S_ISGID), AT_SYMLINK_NOFOLLOW)
        }
    }

    /// Creates an entry with `make`, its side file first; undoes the side file on failure.
    /// A new object (`caller` given) is owned by the caller, with `mode`'s set-ID bits.
    private func makeEntry(
        parent: UInt64, name: String, caller: Caller?, mode: mode_t = 0, _ make: (Int32, String) throws -> Void
    ) throws -> (Node, stat) {
        let p = try table.known(parent)
        let e = try directories.backingName(p, name)
        let created = try directories.ensureSideFile(p, e)
        do {
            try make(p.fd, e.name)
        } catch {
            if created { directories.removeSideFile(p, e) }
            throw FSError(error)
        }
        if let caller { own(p.fd, e.name, caller, mode: mode) }
        return try lookups.lookupBacking(p, e.name)
    }

    /// mkdir: the new directory gets its own random name IV, and the class the mount's policy
    /// gives its path, before anyone can see it. (Not derived from its path: a folder moved
    /// away and made again under the same name would share the IV, and with it the xattr set
    /// a directory's IV names.)
    func mkdir(parent: UInt64, name: String, mode: mode_t, caller: Caller) throws -> (Node, stat) {
        var meta = DirectoryMeta.fresh()
        let policy = classes.policy
        if policy.mayMatch(name: name) {
            let p = try table.known(parent)
            // A rename of an ancestor during the walk can hide a name: one more try.
            let (tail, fromRoot) =
                try (try? directories.pathTail(of: p, upTo: policy.depth - 1))
                ?? directories.pathTail(of: p, upTo: policy.depth - 1)
            meta.defaultClass = policy.protectionClass(tail: tail + [name], fromRoot: fromRoot)
        }
        let made = try makeEntry(parent: parent, name: name, caller: caller) { [self] dirFD, backing in
            // Made whole under a temporary name, then renamed into place: a power cut never
            // leaves the folder's name without its metadata (the metadata's own sync would
            // otherwise make the bare folder durable first).
            let tmp = BackingKind.temporaryName()
            try check(mkdirat(dirFD, tmp, acls.creationMode(mode, in: table.known(parent), by: caller) & 0o7777))
            do {
                let d = try check(openat(dirFD, tmp, kbfs_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC))
                defer { close(d) }
                try AtomicStoreFile.createIfAbsent(dirFD: d, DirectoryMeta.fileName, try meta.encode(names))
                try Self.renameNoReplace(dirFD, tmp, backing)
            } catch {
                AtomicStoreFile.removeTemporaryFolder(dirFD: dirFD, tmp)
                throw error
            }
        }
        // A new folder's metadata is the one just written, and it has no copies: its first
        // lookups need neither a read nor a listing to know.
        made.0.directory?.meta.withLock { if $0 == nil { $0 = meta } }
        made.0.directory?.metadataCopies.withLock { if $0 == nil { $0 = [] } }
        return made
    }

    /// Renames `from` to `to` in `dirFD` unless `to` exists (EEXIST); where the store's
    /// filesystem lacks RENAME_NOREPLACE, a look first (the store's lock keeps other writers of
    /// this daemon's names out; a sync engine does not make folders under names it has not seen).
    static func renameNoReplace(_ dirFD: Int32, _ from: String, _ to: String) throws {
        if kbfs_renameat2(dirFD, from, dirFD, to, kbfs_RENAME_NOREPLACE) == 0 { return }
        guard errno == EINVAL || errno == ENOSYS else { throw FSError(errno) }
        var st = stat()
        if fstatat(dirFD, to, &st, AT_SYMLINK_NOFOLLOW) == 0 { throw FSError(EEXIST) }
        try check(renameat(dirFD, from, dirFD, to))
    }

    /// mknod: regular files (through `create`), FIFOs, sockets, and device nodes as root.
    func mknod(parent: UInt64, name: String, mode: mode_t, rdev: dev_t, caller: Caller) throws -> (Node, stat) {
        if (mode & S_IFMT) == S_IFREG {
            // A regular file needs its header: made as create makes it, then its handle closed.
            let (n, st, h) = try io.create(
                parent: parent, name: name, mode: mode, flags: O_WRONLY | O_EXCL, caller: caller)
            io.release(h)
            return (n, st)
        }
        return try makeEntry(parent: parent, name: name, caller: caller, mode: mode) { [self] dirFD, backing in
            try check(
                mknodat(
                    dirFD, backing,
                    mode & S_IFMT | acls.creationMode(mode, in: table.known(parent), by: caller) & 0o1777, rdev
                )
            )
        }
    }

    /// symlink: the target is encrypted; one too long for a backing symlink lives in the
    /// store's `targets/` folder under its hash, written before the link.
    func symlink(target: String, parent: UInt64, name: String, caller: Caller) throws -> (Node, stat) {
        let t = Array(target.utf8)
        guard !t.isEmpty, t.count < Int(PATH_MAX) else { throw FSError(t.isEmpty ? ENOENT : ENAMETOOLONG) }
        var stored = try names.encryptTarget(t)
        if stored.utf8.count >= 4000 {
            var h = [UInt8](repeating: 0, count: 32)
            let b = Array(stored.utf8)
            crypto_generichash(&h, 32, b, UInt64(b.count), nil, 0)
            let id = Base64URL.encode(h)
            try AtomicStoreFile.createIfAbsent(dirFD: targetsFD, id, b)
            stored = NameCipher.longTargetPrefix + id
        }
        return try makeEntry(parent: parent, name: name, caller: caller) { dirFD, backing in
            try check(symlinkat(stored, dirFD, backing))
        }
    }

    /// readlink: decrypts the stored target.
    func readlink(_ id: UInt64) throws -> [UInt8] {
        let n = try table.known(id)
        var buf = [UInt8](repeating: 0, count: Int(PATH_MAX) + 1)
        let len = try n.withPathFD { try check(readlinkat($0, "", &buf, buf.count)) }
        var stored = String(decoding: buf[0..<len], as: UTF8.self)
        if let id = StoreNames.longTargetID(stored) {
            let fd = try check(StoreFileOpen.regular(targetsFD, id))  // a FIFO there would block
            defer { close(fd) }
            var big = [UInt8](repeating: 0, count: 8192)
            let m = Glibc.read(fd, &big, big.count)
            guard m > 0 else { throw FSError(EIO) }
            stored = String(decoding: big[0..<m], as: UTF8.self)
        }
        return try names.decryptTarget(stored)
    }

    /// link: hard links share the backing inode, so its header, key and class.
    func link(_ id: UInt64, newParent: UInt64, newName: String) throws -> (Node, stat) {
        let n = try table.known(id)
        guard !n.isDirectory else { throw FSError(EPERM) }
        return try makeEntry(parent: newParent, name: newName, caller: nil) { dirFD, backing in
            try n.withPathFD { try check(linkat(AT_FDCWD, "/proc/self/fd/\($0)", dirFD, backing, AT_SYMLINK_FOLLOW)) }
        }
    }
}
