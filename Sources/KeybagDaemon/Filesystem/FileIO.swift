import CSodium
import CSystem
import Dispatch
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization

/// Open files and their content: headers and keys, open, read, write, truncate, fsync and
/// release (creation is in `FileCreation.swift`, fallocate in `Fallocate.swift`). Whether a
/// key may be used is `FileKeyLife`'s decision; this type runs it against the store.
final class FileIO: Sendable {
    /// Largest plaintext size (and offset) accepted: keeps every backing offset far from Int overflow.
    static let maxFileSize = 1 << 60

    /// The nodes; where new files get their names and classes; the lookup of a name a create
    /// found taken.
    let table: NodeTable, directories: DirectoryNames, lookups: EntryLookup
    /// The class keys, the content cipher, and the block format over it.
    let keyring: ClassKeyring, cipher: ContentCipher, content: EncryptedContent
    /// Page drops, attribute refreshes and off-thread work (see `KernelNotifier`).
    let kernel: KernelNotifier
    /// The store's free space as the write path sees it (see `StoreSpace`).
    let space: StoreSpace
    /// The store's overwrite journal (nil: blocks are rewritten in place, as before it).
    let journaling: Journaling?
    /// What the store watcher reports of another writer (no hole-free start is trusted then).
    let underneath = ChangesUnderneath()
    /// The creation mode of new files (an ACL's default applies).
    let acls: PosixACLs
    /// The store's user xattr sets (a file's goes with its last close; fsync covers it).
    let xattrs: XattrStorage
    /// Open file handles (for `status`).
    let openFiles = Atomic<Int>(0)
    /// Whether created objects are chowned to the caller (the daemon runs as root).
    let chownToCaller: Bool
    /// Whether the store's file system reports holes exactly (`kbfs_reports_holes`): writes
    /// below a file's first hole then reserve no space (`FileState.allocated`).
    let storeReportsHoles: Bool
    /// Where notes go.
    let log: EventLog

    init(
        table: NodeTable, directories: DirectoryNames, lookups: EntryLookup, keyring: ClassKeyring,
        cipher: ContentCipher, kernel: KernelNotifier, space: StoreSpace, journaling: Journaling?,
        acls: PosixACLs, xattrs: XattrStorage, storeReportsHoles: Bool
    ) {
        (self.table, self.directories, self.lookups, self.keyring) = (table, directories, lookups, keyring)
        (self.cipher, self.kernel, self.space, self.journaling) = (cipher, kernel, space, journaling)
        (self.acls, self.xattrs, self.storeReportsHoles) = (acls, xattrs, storeReportsHoles)
        content = EncryptedContent(layout: BlockLayout(cipher: cipher))
        chownToCaller = geteuid() == 0
        log = directories.log
    }

    // MARK: classes and keys

    /// Reads a regular file's header. A header left with two valid slots by a class change
    /// that was cut off gets the older slot (another class's wrap) erased now.
    func readHeader(_ node: Node) throws -> FileHeader {
        let fd = try check(node.open(O_RDONLY))
        defer { close(fd) }
        let (h, superseded) = try HeaderSlots.read(fd: fd)
        if let superseded {
            let wfd = node.open(O_RDWR)
            if wfd >= 0 {
                defer { close(wfd) }
                do { try HeaderSlots.erase(fd: wfd, index: superseded) } catch {
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
        let n = try table.known(id)
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
            if fstat(fd, &st) == 0, let mode = caller.modeAfterModification(of: st) { _ = fchmod(fd, mode) }
        }
        openFiles.add(1, ordering: .relaxed)
        return OpenFile(node: n, file: file, fd: fd, writable: writable, directIO: usesDirectIO(cls))
    }

    /// Whether handles of `cls` bypass the kernel's page cache: class A, where the kernel
    /// lets mappings use direct-I/O handles (else class A keeps cached I/O, and a refused
    /// write can be seen by another reader of the file while the daemon answers it).
    func usesDirectIO(_ cls: ProtectionClass) -> Bool { cls == .complete && kernel.negotiated.directIOMappable }

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
                if let header, xattrs.holdsAny { xattrs.drop(Base64URL.encode(header.fileID)) }
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

    /// Clears the set-ID bits of an open file that `caller` just modified (write, fallocate)
    /// as `modeAfterModification` rules. Costs nothing when the kernel said they stay (writes
    /// of callers with CAP_FSETID, and the page cache's write-back); else one `fstat`.
    func clearSetIDAfterModification(_ h: OpenFile, by caller: Caller) {
        if caller.kernelSaysClearSetID == false { return }
        var st = stat()
        if fstat(h.fd, &st) == 0, let mode = caller.modeAfterModification(of: st) {
            setModeBehindTheKernel(h, mode)
        }
    }

    /// Changes the mode of an open file on a request that does not answer with attributes
    /// (write, fallocate): the kernel keeps the mode it has cached (the attributes it took
    /// just before, when it updated the times) until told to ask again.
    func setModeBehindTheKernel(_ h: OpenFile, _ mode: mode_t) {
        guard fchmod(h.fd, mode) == 0 else { return }
        kernel.refreshAttributes([h.node.id])
    }
}
