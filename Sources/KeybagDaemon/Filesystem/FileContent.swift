import CSodium
import CSystem
import Dispatch
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization

/// Open files and their content: headers and keys, open, create, read, write, truncate
/// (fallocate is in `Fallocate.swift`, the `user.protection` xattr in `UserProtection.swift`).
extension Filesystem {
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
                    log("could not erase the superseded header slot of inode \(node.backingIno): \(error)")
                }
            } else {
                log(
                    "could not erase the superseded header slot of inode \(node.backingIno): "
                        + "\(String(cString: strerror(errno)))"
                )
            }
        }
        return h
    }

    /// Runs `body` with the file key for `use`, holding the inode's lock shared when the key
    /// is ready (reads) or alone when it must be loaded or the use writes. Whether the key
    /// may be used is `FileKeyLife`'s decision alone.
    func withContentKey<R>(
        _ node: Node, _ use: FileKeyLife.Use, _ body: (FileContentKey) throws -> R
    ) throws -> R {
        guard let file = node.file else { throw FSError(EINVAL) }
        if use == .read {
            let access = keyring.access
            let done: R?? = try file.io.read { st in
                guard let k = st.readyKey(for: .read, access) else { return .none }
                return .some(try body(k))
            }
            if case .some(let r) = done, let r { return r }
        }
        return try file.io.write { st in
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
    func open(_ id: UInt64, flags: Int32, caller: Caller? = nil) throws -> OpenFile {
        let n = try node(id)
        guard let file = n.file else { throw FSError(n.isDirectory ? EISDIR : EINVAL) }
        let writable = (flags & O_ACCMODE) != O_RDONLY
        // nearly full: tight before the first write
        if writable && space.noteWritten() { refreshAttributesOfKnownFiles() }
        let fd = try check(n.open(writable ? O_RDWR : O_RDONLY))
        let cls: ProtectionClass
        do {
            cls = try file.io.write { st in
                let h = try st.header { try readHeader(n) }
                let key: FileContentKey
                do { key = try st.open(keyring: keyring, cipher: cipher) } catch {
                    Failpoint.keyRefused.hit()
                    throw error
                }
                if flags & O_TRUNC != 0 && writable {
                    // Forgotten before the cut: a cut that fails half-way leaves holes too.
                    file.noteHole(at: content.layout.backingSize(plainSize: 0))
                    let journal = journaling?.file(n, file, fd: fd, key: key)
                    do { try content.truncate(fd: fd, key: key, to: 0, journal: journal) } catch {
                        _ = st.release(keyring: keyring); throw error
                    }
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
        return OpenFile(node: n, file: file, fd: fd, writable: writable, directIO: usesDirectIO(cls))
    }

    /// Whether handles of `cls` bypass the kernel's page cache: class A, where the kernel
    /// lets mappings use direct-I/O handles (else class A keeps cached I/O, and a refused
    /// write can be seen by another reader of the file while the daemon answers it).
    func usesDirectIO(_ cls: ProtectionClass) -> Bool { cls == .complete && kernel.negotiated.directIOMappable }

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
        try Self.checkName(name)
        let p = try node(parent)
        let cls = try inheritedClass(p)
        guard let (wrapKey, epoch, keySet) = keyring.wrappingKey(for: cls) else { throw FSError(EACCES) }
        let entry = try backingName(p, name)
        let sideCreated = try ensureSideFile(p, entry)
        let file: NewFile
        do {
            file = try newFile(
                in: p, class: cls, wrapKey: wrapKey, keySet: keySet, mode: mode, caller: caller, nameless: false)
        } catch {
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
                let h = try open(n.id, flags: flags, caller: caller)
                return (n, try attributes(fd: h.fd), h)
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
            if sideCreated && (error as? FSError)?.errno != EEXIST { removeSideFile(p, entry) }
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
            let p = try node(parent)
            let cls = try inheritedClass(p)
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
                || !Failpoint.chownRefused.isOn && fchown(bfd, caller.uid, groupFor(caller, dirFD: p.fd)) == 0
            var st = stat()
            if owned && mode & (S_ISUID | S_ISGID) != 0 && fstat(bfd, &st) == 0 {
                fchmod(bfd, st.st_mode & 0o1777 | mode & (S_ISUID | S_ISGID))
            }
            let raw = SecureKey(random: 32)
            let header = try FileHeader.create(
                fileKey: raw, class: cls, cipher: cipher, using: wrapKey, keySet: keySet)
            try EncryptedContent.writeNewHeader(fd: bfd, header)
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
            n, plaintextAttributes(st, linkAt: -1, ""),
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

    /// The last close of a handle: class B file keys die with the last handle once locked,
    /// and so do the crypto library's key schedules and the inode's cached pages (dropped
    /// from the notifier's queue, not this FUSE thread).
    func release(_ h: OpenFile) {
        HeapTrimmer.shared.note()
        let (closed, header) = h.file.io.write { st in (st.release(keyring: keyring), st.header) }
        let lastClose = closed.lastClose
        if closed.pagesMustGo {
            HardwareAES.forgetKeySchedules()
            kernel.dropPagesSoon(h.node.id, pass: "last close of a class B file")
        }
        openFiles.subtract(1, ordering: .relaxed)
        // The last close of a file unlinked while open takes its xattr set with it.
        if lastClose {
            var st = stat()
            if fstat(h.fd, &st) == 0 && st.st_nlink == 0 {
                if let header, hasStoredXattrs { dropXattrs(Base64URL.encode(header.fileID)) }
                journaling?.journal.forgetDeleted(ino: UInt64(st.st_ino))
            }
        }
    }

    /// Reads through a handle and replies while still holding the inode's lock, so a lock
    /// (which takes it alone before dropping the page cache) cannot be overtaken by a reply.
    /// The reply buffer is zeroed once sent.
    func read(_ h: OpenFile, offset: Int, into buf: UnsafeMutableRawBufferPointer, reply: (Int) -> Void) throws {
        guard offset >= 0 else { throw FSError(EINVAL) }
        if offset >= Self.maxFileSize { return reply(0) }
        try withContentKey(h.node, .read) { key in
            let n: Int
            // No pending block anywhere: none of this file's can come while its lock is held.
            let journal = journaling.flatMap {
                $0.journal.pendingBlocks > 0 ? $0.file(h.node, h.file, fd: h.fd, key: key) : nil
            }
            do { n = try content.read(fd: h.fd, key: key, offset: offset, into: buf, journal: journal) } catch {
                Self.wipe(UnsafeRawBufferPointer(buf))
                throw error
            }
            reply(n)
            Self.wipe(UnsafeRawBufferPointer(rebasing: buf[0..<n]))
        }
    }

    /// Writes through a handle. The request's plaintext (in the FUSE receive buffer) is
    /// zeroed afterwards, whether the write was accepted or refused.
    func write(_ h: OpenFile, offset: Int, data: UnsafeRawBufferPointer) throws {
        guard offset >= 0 else { throw FSError(EINVAL) }
        guard offset <= Self.maxFileSize - data.count else { throw FSError(EFBIG) }
        defer { Self.wipe(data) }
        try retryingWhileSpaceReturns {
            try withContentKey(h.node, .write) { key in
                // Under `io` taken alone: the known hole-free start of the file moves on here only.
                var allocated = allocatedStart(of: h)
                defer { h.file.allocated.store(allocated, ordering: .relaxed) }
                let journal = journaling?.file(h.node, h.file, fd: h.fd, key: key)
                let reserved = try content.write(
                    fd: h.fd, key: key, offset: offset, data: data, allocated: &allocated, journal: journal)
                // Blocks written out of order leave the known start behind what the file has:
                // every 64 writes that reserve, the store is asked again from there.
                if reserved && storeReportsHoles && !underneath.anotherWriterExpected
                    && h.file.reservesSinceProbe.add(1, ordering: .relaxed).newValue % 64 == 0
                {
                    allocated = max(allocated, Int(kbfs_next_hole(h.fd, Int64(allocated))))
                }
            }
        }
    }

    /// How many backing bytes from the start of `h`'s file hold no hole: known from earlier
    /// writes, else asked of the store once (SEEK_HOLE) where its file system reports holes
    /// exactly, else none. None either where another writer is expected in the store: it
    /// could punch a hole or cut and regrow a file without the daemon seeing it at once.
    private func allocatedStart(of h: OpenFile) -> Int {
        if underneath.anotherWriterExpected { return 0 }
        let known = h.file.allocated.load(ordering: .relaxed)
        if known >= 0 { return known }
        return storeReportsHoles ? max(0, Int(kbfs_next_hole(h.fd, 0))) : 0
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
        let ids = table.regularFiles().map(\.node.id)
        kernel.soon { [kernel] in kernel.refreshAttributes(ids) }
    }

    /// Truncates through a handle when given, else through a fresh backing descriptor.
    func truncate(_ n: Node, handle: OpenFile?, to size: Int) throws {
        guard size >= 0 else { throw FSError(EINVAL) }
        guard size <= Self.maxFileSize else { throw FSError(EFBIG) }
        let fd: Int32
        if let handle, handle.writable { fd = handle.fd } else { fd = try check(n.open(O_RDWR)) }
        defer { if fd != handle?.fd { close(fd) } }
        try retryingWhileSpaceReturns {
            try withContentKey(n, .write) { key in
                // Forgotten before the cut: a cut that fails half-way leaves holes too.
                n.file?.noteHole(at: content.layout.backingSize(plainSize: size))
                let journal = n.file.flatMap { f in journaling?.file(n, f, fd: fd, key: key) }
                try content.truncate(fd: fd, key: key, to: size, journal: journal)
            }
        }
    }

    /// fsync of a handle: the file, then its xattr set when that changed since it was last
    /// made durable (as ext4's fsync covers a file's xattrs).
    /// Through the journal when the file was written through it (`OverwriteJournal.fsync`).
    func fsync(_ h: OpenFile, dataOnly: Bool) throws {
        let header = h.file.io.read { $0.header }
        if let journaling, let header {
            let journal = journaling.file(h.node, h.file, fd: h.fd, fileID: header.fileID)
            try journal.fsync(fd: h.fd, dataOnly: dataOnly)
        } else {
            try check(dataOnly ? fdatasync(h.fd) : Glibc.fsync(h.fd))
        }
        if xattrs.changedSinceSync, let header { try xattrs.makeDurable(Base64URL.encode(header.fileID)) }
    }

    /// fsync of a directory: its backing folder (the entries of the names in it, long names'
    /// side files, its metadata), then its xattr set when that changed.
    func fsyncdir(_ id: UInt64) throws {
        let n = try node(id)
        guard n.isDirectory else { throw FSError(ENOTDIR) }
        let fd = try check(openat(n.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC))
        defer { close(fd) }
        try check(Glibc.fsync(fd))
        if xattrs.changedSinceSync, let meta = try? meta(of: n) { try xattrs.makeDurable(Base64URL.encode(meta.iv)) }
    }
}
