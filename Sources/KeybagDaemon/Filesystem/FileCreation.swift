import CSystem
import Glibc
import KeybagCore
import Synchronization

/// New regular files: made whole without a name (O_TMPFILE, or a reserved temporary name),
/// then linked under their name, so a crash never leaves a named file without a header.
extension FileIO {
    /// Creates a regular file with the inherited class (EACCES when that class cannot create
    /// now). Atomic: the header is written to an unnamed file that is then linked under its
    /// name, so a crash never leaves a named file without a header.
    func create(
        parent: UInt64, name: String, mode: mode_t, flags: Int32, caller: Caller
    ) throws -> (Node, stat, OpenFile) {
        try retryingWhileSpaceReturns {
            try createOnce(parent: parent, name: name, mode: mode, flags: flags, caller: caller)
        }
    }

    /// One attempt of `create`; undoes what it did when it fails.
    private func createOnce(
        parent: UInt64, name: String, mode: mode_t, flags: Int32, caller: Caller
    ) throws -> (Node, stat, OpenFile) {
        try DirectoryNames.checkName(name)
        let p = try table.known(parent)
        let cls = try directories.inheritedClass(p)
        guard let (wrapKey, epoch, keySet) = keyring.wrappingKey(for: cls) else { throw FSError(EACCES) }
        let entry = try directories.backingName(p, name)
        let sideCreated = try directories.ensureSideFile(p, entry)
        let file: NewFile
        do {
            file = try newFile(
                in: p, class: cls, wrapKey: wrapKey, keySet: keySet, mode: mode, caller: caller, nameless: false)
        } catch {
            if sideCreated { directories.removeSideFile(p, entry) }
            throw FSError(error)
        }
        var linked = false
        do {
            let rc = link(unnamed: file.fd, temp: file.temp, dirFD: p.fd, as: entry.name)
            if rc == EEXIST && flags & O_EXCL == 0 {
                file.key.wipe()
                close(file.fd)
                let (n, _) = try lookups.lookupBacking(p, entry.name)
                let h = try open(n.id, flags: flags, caller: caller)
                return (n, try lookups.plaintext.attributes(fd: h.fd), h)
            }
            guard rc == 0 else { throw FSError(rc) }
            linked = true
            Failpoint.createBeforeKeyJoinsInode.hit()
            let pathFD = try check(openat(p.fd, entry.name, kbfs_O_PATH | O_NOFOLLOW | O_CLOEXEC))
            var st = stat()
            try check(fstat(pathFD, &st))
            let named = journaling?.path(of: pathFD)  // before the node table takes (and may close) pathFD
            return try adopt(
                file, node: table.remember(fd: pathFD, stat: st), stat: st, class: cls, epoch: epoch, named: named)
        } catch {
            if linked { unlinkat(p.fd, entry.name, 0) }
            if sideCreated && (error as? FSError)?.errno != EEXIST { directories.removeSideFile(p, entry) }
            close(file.fd)
            throw FSError(error)
        }
    }

    /// `open(2)` with `O_TMPFILE` in `parent`: a file of the inherited class with no name,
    /// gone at its last close unless `linkat(2)` gives it one (a backing O_TMPFILE file,
    /// whose node keeps a descriptor: an unlinked inode cannot be reopened by handle).
    /// EOPNOTSUPP where the store's filesystem has no O_TMPFILE.
    func createUnnamed(parent: UInt64, mode: mode_t, caller: Caller) throws -> (Node, stat, OpenFile) {
        try retryingWhileSpaceReturns {
            let p = try table.known(parent)
            let cls = try directories.inheritedClass(p)
            guard let (wrapKey, epoch, keySet) = keyring.wrappingKey(for: cls) else { throw FSError(EACCES) }
            let file = try newFile(
                in: p, class: cls, wrapKey: wrapKey, keySet: keySet, mode: mode, caller: caller, nameless: true)
            do {
                let pathFD = try check(Glibc.open("/proc/self/fd/\(file.fd)", kbfs_O_PATH | O_CLOEXEC))
                var st = stat()
                guard fstat(pathFD, &st) == 0 else { let e = errno; close(pathFD); throw FSError(e) }
                return try adopt(
                    file, node: table.remember(keeping: pathFD, stat: st), stat: st, class: cls, epoch: epoch)
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
    private func newFile(
        in p: Node, class cls: ProtectionClass, wrapKey: FileHeader.ClassKey, keySet: UInt8, mode: mode_t,
        caller: Caller, nameless: Bool
    ) throws -> NewFile {
        // Made without set-ID bits: they come once the file is the caller's (the kernel already
        // dropped those the caller may not set, Linux 6.0+); never on a file left as root's.
        let (bfd, temp) = try unnamedFile(
            dirFD: p.fd, mode: acls.creationMode(mode, in: p, by: caller) & 0o1777, fallback: !nameless)
        do {
            let owned =
                !chownToCaller
                || !Failpoint.chownRefused.isOn && fchown(bfd, caller.uid, caller.group(in: p.fd)) == 0
            var st = stat()
            if owned && mode & (S_ISUID | S_ISGID) != 0 && fstat(bfd, &st) == 0 {
                fchmod(bfd, st.st_mode & 0o1777 | mode & (S_ISUID | S_ISGID))
            }
            let raw = SecureKey(random: 32)
            let header = try FileHeader.create(
                fileKey: raw, class: cls, cipher: cipher, using: wrapKey, keySet: keySet)
            try HeaderSlots.writeNew(fd: bfd, header)
            return NewFile(fd: bfd, temp: temp, header: header, key: try FileContentKey(key: raw, header: header))
        } catch {
            if let temp { unlinkat(p.fd, temp, 0) }
            close(bfd)
            throw FSError(error)
        }
    }

    /// Gives a new file's key to its node and opens the creator's handle on it.
    /// `named`: its path in the store, for the journal (a new file's own descriptor is unnamed).
    private func adopt(
        _ file: NewFile, node n: Node, stat st: stat, class cls: ProtectionClass, epoch: UInt64, named: String? = nil
    ) throws -> (Node, stat, OpenFile) {
        let state: FileState
        do {
            guard let s = n.file else { throw FSError(EIO) }  // another writer put something else there
            try s.io.write { s in
                try s.adoptCreated(header: file.header, key: file.key, epoch: epoch, keyring: keyring)
            }
            state = s
        } catch {
            table.forget(n.id, count: 1)  // the kernel never learns of this node
            throw error
        }
        if let named {
            journaling?.created(state, ino: UInt64(st.st_ino), fd: file.fd, fileID: file.key.fileID, path: named)
        }
        openFiles.add(1, ordering: .relaxed)
        return (
            n, lookups.plaintext.attributes(of: st, linkAt: -1, ""),
            OpenFile(node: n, file: state, fd: file.fd, writable: true, directIO: usesDirectIO(cls))
        )
    }

    /// A new backing file without a name in `dirFD` (O_TMPFILE), or under a reserved
    /// temporary name where the backing filesystem has no O_TMPFILE.
    private func unnamedFile(dirFD: Int32, mode: mode_t, fallback: Bool) throws -> (Int32, String?) {
        let fd = openat(dirFD, ".", kbfs_O_TMPFILE | O_RDWR | O_CLOEXEC, mode)
        if fd >= 0 { return (fd, nil) }
        guard errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL else { throw FSError(errno) }
        guard fallback else { throw FSError(EOPNOTSUPP) }
        let temp = BackingKind.temporaryName()
        return (try check(openat(dirFD, temp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode)), temp)
    }

    /// Links a file from `unnamedFile` under `name` (never replacing an entry); removes the
    /// temporary name. Returns 0 or the errno (EEXIST when the name is taken).
    private func link(unnamed fd: Int32, temp: String?, dirFD: Int32, as name: String) -> Int32 {
        let rc =
            temp.map { linkat(dirFD, $0, dirFD, name, 0) }
            ?? linkat(AT_FDCWD, "/proc/self/fd/\(fd)", dirFD, name, AT_SYMLINK_FOLLOW)
        let e = rc == 0 ? 0 : errno
        if let temp { unlinkat(dirFD, temp, 0) }
        return e
    }
}
