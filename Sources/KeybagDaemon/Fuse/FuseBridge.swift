import CFuse
import CSystem
import Glibc
import KeybagCore

/// What the FUSE callbacks reach through `fuse_req_userdata`.
final class FuseContext: Sendable {
    /// The filesystem the callbacks drive.
    let fs: Filesystem
    /// Seconds the kernel may cache attributes and entries.
    let cacheTimeout: Double
    /// Whether to ask for the kernel's write-back cache (cached handles: classes B, C, D).
    let writebackCache: Bool
    /// Whether to ask the kernel to enforce POSIX ACLs.
    let posixACL: Bool
    init(fs: Filesystem, cacheTimeout: Double, writebackCache: Bool, posixACL: Bool) {
        self.fs = fs; self.cacheTimeout = cacheTimeout; self.writebackCache = writebackCache; self.posixACL = posixACL
    }
}

/// The low-level FUSE glue: the operations table (`operations`, assigning the named
/// handlers of FuseHandlers.swift) and what those handlers share to decode a request and
/// reply. No policy lives here: every rule is `Filesystem`'s.
enum FuseBridge {
    /// The operations table: one named handler per FUSE operation.
    static func operations() -> fuse_lowlevel_ops {
        var ops = fuse_lowlevel_ops()
        ops.`init` = fuseInit
        ops.lookup = fuseLookup
        ops.forget = fuseForget
        ops.forget_multi = fuseForgetMulti
        ops.getattr = fuseGetattr
        ops.access = fuseAccess
        ops.setattr = fuseSetattr
        ops.readlink = fuseReadlink
        ops.mknod = fuseMknod
        ops.mkdir = fuseMkdir
        ops.unlink = fuseUnlink
        ops.rmdir = fuseRmdir
        ops.symlink = fuseSymlink
        ops.rename = fuseRename
        ops.link = fuseLink
        ops.open = fuseOpen
        ops.create = fuseCreate
        ops.read = fuseRead
        ops.write = fuseWrite
        // No flush: writes reach the store before they are acknowledged and locks are the
        // kernel's, so close() has nothing to wait for. Without the operation the kernel
        // stops sending FLUSH after the first ENOSYS (it still writes back mmap pages).
        ops.flush = nil
        ops.fallocate = fuseFallocate
        ops.release = fuseRelease
        ops.fsync = fuseFsync
        ops.opendir = fuseOpendir
        ops.readdir = fuseReaddir
        ops.readdirplus = fuseReaddirplus
        ops.releasedir = fuseReleasedir
        ops.fsyncdir = fuseFsyncdir
        ops.statfs = fuseStatfs
        ops.setxattr = fuseSetxattr
        ops.getxattr = fuseGetxattr
        ops.listxattr = fuseListxattr
        ops.removexattr = fuseRemovexattr
        return ops
    }

    // MARK: decoding

    /// The context of a request.
    @inline(__always)
    static func context(_ req: fuse_req_t?) -> FuseContext {
        Unmanaged<FuseContext>.fromOpaque(fuse_req_userdata(req)!).takeUnretainedValue()
    }

    /// The filesystem of a request.
    @inline(__always)
    static func fs(_ req: fuse_req_t?) -> Filesystem { context(req).fs }

    /// The caller's uid, gid, pid and umask.
    static func caller(_ req: fuse_req_t?) -> Caller {
        let c = fuse_req_ctx(req)!.pointee
        let word = kbfs_request_kills_setid()
        return .init(
            uid: c.uid, gid: c.gid, pid: c.pid, umask: c.umask, kernelSaysClearSetID: word < 0 ? nil : word == 1)
    }

    /// The caller's supplementary groups (read from /proc by libfuse; empty if unknown).
    static func groups(_ req: fuse_req_t?) -> [gid_t] {
        var list = [gid_t](repeating: 0, count: 64)
        let n = fuse_req_getgroups(req, Int32(list.count), &list)
        return n > 0 ? Array(list[0..<min(Int(n), list.count)]) : []
    }

    /// A C string argument as a Swift string.
    static func str(_ p: UnsafePointer<CChar>?) -> String { p.map { String(cString: $0) } ?? "" }

    /// A file name or symlink target: names are stored encrypted as UTF-8, so bytes that
    /// are not UTF-8 are refused (EILSEQ) rather than silently changed.
    static func name(_ p: UnsafePointer<CChar>?) throws -> String {
        guard let p, let s = String(validatingCString: p) else { throw FSError(EILSEQ) }
        return s
    }

    // MARK: handles in fuse_file_info

    /// The object stored in `fi.fh` by `attach` or `attachDirectory`, if any.
    private static func object<T: AnyObject>(_ fi: UnsafeMutablePointer<fuse_file_info>?, as: T.Type) -> Unmanaged<T>? {
        guard let fi, fi.pointee.fh != 0 else { return nil }
        return Unmanaged<T>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!)
    }

    /// The file handle behind `fi.fh`.
    static func handle(_ fi: UnsafeMutablePointer<fuse_file_info>?) -> OpenFile? {
        object(fi, as: OpenFile.self)?.takeUnretainedValue()
    }

    /// The directory handle behind `fi.fh`.
    static func directory(_ fi: UnsafeMutablePointer<fuse_file_info>?) -> DirHandle? {
        object(fi, as: DirHandle.self)?.takeUnretainedValue()
    }

    /// Stores a file handle in `fi` (no page cache kept across opens; direct I/O for class A).
    static func attach(_ h: OpenFile, to fi: UnsafeMutablePointer<fuse_file_info>) {
        fi.pointee.fh = UInt64(UInt(bitPattern: Unmanaged.passRetained(h).toOpaque()))
        fi.pointee.keep_cache = 0
        fi.pointee.direct_io = h.directIO ? 1 : 0
    }

    /// Stores a directory handle in `fi`.
    static func attach(_ d: DirHandle, to fi: UnsafeMutablePointer<fuse_file_info>) {
        fi.pointee.fh = UInt64(UInt(bitPattern: Unmanaged.passRetained(d).toOpaque()))
    }

    /// Takes the file handle out of `fi` (RELEASE, or an open whose reply did not reach the
    /// kernel) and closes it in the filesystem.
    static func releaseHandle(_ req: fuse_req_t?, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
        guard let h = object(fi, as: OpenFile.self)?.takeRetainedValue() else { return }
        fs(req).io.release(h)
    }

    /// Takes the directory handle out of `fi` (RELEASEDIR, or an opendir not delivered).
    static func releaseDirectory(_ fi: UnsafeMutablePointer<fuse_file_info>?) {
        object(fi, as: DirHandle.self)?.release()
    }

    // MARK: replies

    /// Replies an errno.
    static func err(_ req: fuse_req_t?, _ e: Int32) { fuse_reply_err(req, e) }

    /// Replies an error from any thrown error.
    static func fail(_ req: fuse_req_t?, _ error: Error) {
        fuse_reply_err(req, FSError(error).errno)
    }

    /// Runs `body`, which replies on success; replies its error otherwise.
    static func replying(_ req: fuse_req_t?, _ body: () throws -> Void) {
        do { try body() } catch { fail(req, error) }
    }

    /// Runs `body` and replies 0, or its error.
    static func replyingDone(_ req: fuse_req_t?, _ body: () throws -> Void) {
        do { try body(); fuse_reply_err(req, 0) } catch { fail(req, error) }
    }

    /// The entry parameters of a node for the kernel: its id, attributes and cache times.
    static func entry(_ req: fuse_req_t?, _ node: Node, _ st: stat) -> fuse_entry_param {
        let ctx = context(req)
        var e = fuse_entry_param()
        e.ino = node.id
        e.attr = st
        e.attr_timeout = ctx.fs.attributes.attributeSeconds(node.id, normal: ctx.cacheTimeout)
        e.entry_timeout = ctx.cacheTimeout
        return e
    }

    /// Replies an entry for a looked-up or new node; the lookup it counted is undone when the
    /// reply does not reach the kernel (the request was interrupted).
    static func replyEntry(_ req: fuse_req_t?, _ node: Node, _ st: stat) {
        var e = entry(req, node, st)
        if fuse_reply_entry(req, &e) != 0 { fs(req).table.forget(node.id, count: 1) }
    }

    /// Replies that a name does not exist, for the kernel to remember (a negative entry, as
    /// long as an entry, at most 1 s where another writer is expected): a program that looks
    /// for a file before it makes it, or a compiler searching its include path, asks once.
    /// Names made through the mount replace it; a name another writer makes in the store is
    /// forgotten by the store watcher.
    static func replyAbsent(_ req: fuse_req_t?) {
        var e = fuse_entry_param()
        e.ino = 0
        let ctx = context(req)
        e.entry_timeout = ctx.fs.underneath.negativeEntrySeconds(normal: ctx.cacheTimeout)
        fuse_reply_entry(req, &e)
    }

    /// Replies attributes with the node's cache time.
    static func replyAttributes(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ st: stat) {
        var st = st
        let ctx = context(req)
        fuse_reply_attr(req, &st, ctx.fs.attributes.attributeSeconds(ino, normal: ctx.cacheTimeout))
    }

    /// Replies an xattr value or list: its size when probed with 0, ERANGE when too small.
    static func replyXattr(_ req: fuse_req_t?, _ value: [UInt8], size: Int) {
        if size == 0 {
            fuse_reply_xattr(req, value.count)
        } else if size < value.count {
            fuse_reply_err(req, ERANGE)
        } else {
            value.withUnsafeBufferPointer { b in
                _ = fuse_reply_buf(req, UnsafeRawPointer(b.baseAddress)?.assumingMemoryBound(to: CChar.self), b.count)
            }
        }
    }

    /// Replies a readdir / readdirplus page from the snapshot taken at opendir. With
    /// `plus`, each entry is looked up (counting a kernel lookup, undone when the entry does
    /// not fit); entries that vanished since opendir are skipped.
    static func replyDirectory(
        _ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int, _ off: off_t,
        _ fi: UnsafeMutablePointer<fuse_file_info>?, plus: Bool
    ) {
        guard let d = directory(fi) else { return err(req, EBADF) }
        let fs = fs(req)
        let parent = fs.table.node(ino)
        let entries: [DirHandle.Entry]
        do {
            entries = try d.entries(from: Int(off)) {
                guard let parent else { throw FSError(ESTALE) }
                return try fs.namespace.listing(parent)
            }
        } catch { return fail(req, error) }
        let buf = UnsafeMutablePointer<CChar>.allocate(capacity: max(size, 1))
        defer { buf.deallocate() }
        var used = 0, counted: [UInt64] = []
        let start = max(0, Int(off))
        for i in start..<max(start, entries.count) {
            let e = entries[i]
            var entry = fuse_entry_param()
            entry.attr.st_ino = UInt(e.ino)
            entry.attr.st_mode = mode_t(e.type) << 12
            if plus && e.name != "." && e.name != ".." {
                guard let parent, let (n, st) = try? fs.lookups.lookupBacking(parent, e.backing) else { continue }
                entry = self.entry(req, n, st)
            }
            let need =
                plus
                ? fuse_add_direntry_plus(req, buf + used, size - used, e.name, &entry, off_t(i + 1))
                : fuse_add_direntry(req, buf + used, size - used, e.name, &entry.attr, off_t(i + 1))
            if need > size - used {
                if entry.ino != 0 { fs.table.forget(entry.ino, count: 1) }  // the lookup above
                break
            }
            if entry.ino != 0 { counted.append(entry.ino) }
            used += need
        }
        if fuse_reply_buf(req, buf, used) != 0 {  // interrupted: the kernel learnt none of them
            for id in counted { fs.table.forget(id, count: 1) }
        }
    }
}
