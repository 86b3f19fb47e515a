import CSodium
import CSystem
import Foundation
import Glibc
import KeybagCore

/// The namespace operations: mkdir, mknod, symlink, readlink, unlink, rmdir, rename, link.
extension Filesystem {
    /// Chowns a new object to the caller when running as root (the group stays the
    /// directory's where it is setgid, as the backing filesystem already set it). What is
    /// not a directory is made without set-ID bits; those of `mode` (which the kernel already
    /// let the caller ask for) are set once it is the caller's, never on one left as root's.
    private func own(_ dirFD: Int32, _ backing: String, _ caller: Caller, mode: mode_t) {
        let group = groupFor(caller, dirFD: dirFD)
        let owned =
            !chownToCaller
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
        let p = try node(parent)
        let e = try backingName(p, name)
        let created = try ensureSideFile(p, e)
        do {
            try make(p.fd, e.name)
        } catch {
            if created { removeSideFile(p, e) }
            throw FSError(error)
        }
        if let caller { own(p.fd, e.name, caller, mode: mode) }
        return try lookupBacking(p, e.name)
    }

    /// mkdir: the new directory gets its own random name IV, and the class the mount's policy
    /// gives its path, before anyone can see it. (Not derived from its path: a folder moved
    /// away and made again under the same name would share the IV, and with it the xattr set
    /// a directory's IV names.)
    func mkdir(parent: UInt64, name: String, mode: mode_t, caller: Caller) throws -> (Node, stat) {
        var meta = DirectoryMeta.fresh()
        let policy = classes.policy
        if policy.mayMatch(name: name) {
            let p = try node(parent)
            // A rename of an ancestor during the walk can hide a name: one more try.
            let (tail, fromRoot) =
                try (try? pathTail(of: p, upTo: policy.depth - 1)) ?? pathTail(of: p, upTo: policy.depth - 1)
            meta.defaultClass = policy.protectionClass(tail: tail + [name], fromRoot: fromRoot)
        }
        let made = try makeEntry(parent: parent, name: name, caller: caller) { [self] dirFD, backing in
            // Made whole under a temporary name, then renamed into place: a power cut never
            // leaves the folder's name without its metadata (the metadata's own sync would
            // otherwise make the bare folder durable first).
            let tmp = BackingKind.temporaryName()
            try check(mkdirat(dirFD, tmp, acls.creationMode(mode, in: node(parent), by: caller) & 0o7777))
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
            let (n, st, h) = try create(
                parent: parent, name: name, mode: mode, flags: O_WRONLY | O_EXCL, caller: caller)
            release(h)
            return (n, st)
        }
        return try makeEntry(parent: parent, name: name, caller: caller, mode: mode) { [self] dirFD, backing in
            try check(
                mknodat(
                    dirFD, backing, mode & S_IFMT | acls.creationMode(mode, in: node(parent), by: caller) & 0o1777, rdev
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
        let n = try node(id)
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

    /// unlink (a long symlink target goes with its last link).
    func unlink(parent: UInt64, name: String) throws {
        let p = try node(parent)
        let e = try backingName(p, name)
        var st = stat()
        var longTarget: String?
        let statted = fstatat(p.fd, e.name, &st, AT_SYMLINK_NOFOLLOW) == 0
        let xattrID = statted ? xattrIDOfLastLink(dirFD: p.fd, name: e.name, st: st) : nil
        if statted, (st.st_mode & S_IFMT) == S_IFLNK, st.st_nlink == 1 {
            var buf = [UInt8](repeating: 0, count: 256)
            let len = readlinkat(p.fd, e.name, &buf, buf.count)
            if len > 0 {
                longTarget = StoreNames.longTargetID(String(decoding: buf[0..<len], as: UTF8.self))
            }
        }
        try check(unlinkat(p.fd, e.name, 0))
        if statted, (st.st_mode & S_IFMT) == S_IFREG, st.st_nlink == 1 {
            journaling?.nameRemoved(ino: UInt64(st.st_ino), table: table, dev: UInt64(st.st_dev))
        }
        removeSideFile(p, e)
        if let longTarget { unlinkat(targetsFD, longTarget, 0) }
        if let xattrID { dropXattrs(xattrID) }
    }

    /// Whether a backing directory's entries are only the store's own files: metadata (and a
    /// sync engine's copies of it), temporaries, and long-name side files whose entry is gone
    /// (left by a crash or an offline edit). Such a directory is empty to its users.
    static func holdsOnlyStoreFiles(_ names: [String]) -> Bool {
        let present = Set(names)
        return names.allSatisfy { n in
            switch BackingKind.of(n) {
            case .directoryMeta, .storeFile: return true
            case .sideFile(let entry): return !present.contains(entry)
            case .name, .longName, .syncEngine, .foreign: return MetadataCopy(backing: n) != nil
            }
        }
    }

    /// rmdir: a directory holding only the store's own files counts as empty.
    func rmdir(parent: UInt64, name: String) throws {
        let p = try node(parent)
        let e = try backingName(p, name)
        if unlinkat(p.fd, e.name, AT_REMOVEDIR) == 0 { removeSideFile(p, e); return }
        let err = errno
        guard err == ENOTEMPTY || err == EEXIST else { throw FSError(err) }
        let failed = try replacingDirectoryOfStoreFiles(parentFD: p.fd, name: e.name) {
            unlinkat(p.fd, e.name, AT_REMOVEDIR)
        }
        if failed != 0 { throw FSError(failed) }
        removeSideFile(p, e)
    }

    /// rename (flags: RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT): the name is
    /// re-encrypted for the target directory; the target's side file is written first, the
    /// source's removed last unless an entry stays under the source name (the other file of
    /// an exchange, or the whiteout the backing filesystem leaves there). A replaced file's
    /// xattr set goes with it, whatever the flags.
    func rename(parent: UInt64, name: String, newParent: UInt64, newName: String, flags: UInt32) throws {
        let p = try node(parent), np = try node(newParent)
        let src = try backingName(p, name)
        let dst = try backingName(np, newName)
        let exchange = flags & kbfs_RENAME_EXCHANGE != 0, noReplace = flags & kbfs_RENAME_NOREPLACE != 0
        let created = try ensureSideFile(np, dst)
        let replacedXattrs = exchange || noReplace ? nil : xattrIDOfReplaced(p, src.name, np, dst.name)
        var replaced = stat()
        let replacing = !exchange && !noReplace && fstatat(np.fd, dst.name, &replaced, AT_SYMLINK_NOFOLLOW) == 0
        var rc = kbfs_renameat2(p.fd, src.name, np.fd, dst.name, flags)
        if rc != 0 && (errno == ENOTEMPTY || errno == EEXIST) && !exchange && !noReplace {
            // The target is a directory; one holding only the store's own files is empty.
            rc = renameOverEmptyDirectory(p, src.name, np, dst.name, flags: flags)
        }
        if rc != 0 {
            let e = errno
            if created { removeSideFile(np, dst) }
            throw FSError(e)
        }
        if let replacedXattrs { dropXattrs(replacedXattrs) }
        if replacing, (replaced.st_mode & S_IFMT) == S_IFREG, replaced.st_nlink == 1 {
            journaling?.nameRemoved(ino: UInt64(replaced.st_ino), table: table, dev: UInt64(replaced.st_dev))
        }
        var moved = stat()
        if let journaling, fstatat(np.fd, dst.name, &moved, AT_SYMLINK_NOFOLLOW) == 0,
            (moved.st_mode & S_IFMT) == S_IFREG,
            let f = table.node(dev: UInt64(moved.st_dev), ino: UInt64(moved.st_ino))?.file
        {
            journaling.renamed(f)
        }
        classes.changed()  // a moved directory may inherit differently
        let same = p.id == np.id && src.name == dst.name
        if !exchange && flags & kbfs_RENAME_WHITEOUT == 0 && !same { removeSideFile(p, src) }
    }

    /// The xattr id of a regular file that renaming `from` over `to` would delete (nil when
    /// the target is absent, another link of the source, or keeps other links).
    private func xattrIDOfReplaced(_ p: Node, _ from: String, _ np: Node, _ to: String) -> String? {
        guard hasStoredXattrs else { return nil }
        var a = stat(), b = stat()
        guard fstatat(np.fd, to, &b, AT_SYMLINK_NOFOLLOW) == 0, fstatat(p.fd, from, &a, AT_SYMLINK_NOFOLLOW) == 0,
            a.st_ino != b.st_ino || a.st_dev != b.st_dev
        else { return nil }
        return xattrIDOfLastLink(dirFD: np.fd, name: to, st: b)
    }

    /// Retries a rename whose target directory holds only the store's own files, after
    /// removing them (restored if the rename still fails). Returns the rename's result.
    private func renameOverEmptyDirectory(
        _ p: Node, _ from: String, _ np: Node, _ to: String, flags: UInt32
    ) -> Int32 {
        let failed: Int32
        do {
            failed = try replacingDirectoryOfStoreFiles(parentFD: np.fd, name: to) {
                kbfs_renameat2(p.fd, from, np.fd, to, flags)
            }
        } catch {
            failed = ENOTEMPTY
        }
        errno = failed
        return failed == 0 ? 0 : -1
    }

    /// Runs `replace` (which removes, or renames over, the directory `name` of `parentFD`)
    /// once that directory, holding only the store's own files (it counts as empty), is
    /// cleared of them; its metadata is put back when `replace` fails, and its xattr set
    /// dropped when it succeeds. Throws the error of opening it, and ENOTEMPTY when it holds
    /// anything else. Returns 0, or the errno `replace` failed with.
    private func replacingDirectoryOfStoreFiles(parentFD: Int32, name: String, _ replace: () -> Int32) throws -> Int32 {
        let dfd = try check(openat(parentFD, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC))
        defer { close(dfd) }
        let entries = try backingEntries(dirFD: dfd)
        guard Self.holdsOnlyStoreFiles(entries.map(\.name)) else { throw FSError(ENOTEMPTY) }
        let saved = try? readMeta(dirFD: dfd)
        for r in entries { unlinkat(dfd, r.name, 0) }
        guard replace() == 0 else {
            let e = errno
            if let saved {
                _ = try? AtomicStoreFile.createIfAbsent(dirFD: dfd, DirectoryMeta.fileName, try saved.encode(names))
            }
            return e
        }
        dropXattrs(ofDirectory: saved)
        return 0
    }

    /// link: hard links share the backing inode, so its header, key and class.
    func link(_ id: UInt64, newParent: UInt64, newName: String) throws -> (Node, stat) {
        let n = try node(id)
        guard !n.isDirectory else { throw FSError(EPERM) }
        return try makeEntry(parent: newParent, name: newName, caller: nil) { dirFD, backing in
            try n.withPathFD { try check(linkat(AT_FDCWD, "/proc/self/fd/\($0)", dirFD, backing, AT_SYMLINK_FOLLOW)) }
        }
    }
}
