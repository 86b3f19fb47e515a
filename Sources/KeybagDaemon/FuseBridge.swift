import CFuse
import CSystem
import Glibc
import KeybagCore
import Synchronization

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

/// The low-level FUSE glue: thin callbacks that decode a request, call `Filesystem` and
/// reply. No policy lives here.
enum FuseBridge {
    /// The context of a request.
    @inline(__always)
    static func context(_ req: fuse_req_t?) -> FuseContext {
        Unmanaged<FuseContext>.fromOpaque(fuse_req_userdata(req)!).takeUnretainedValue()
    }

    /// The caller's uid and gid.
    static func caller(_ req: fuse_req_t?) -> Filesystem.Caller {
        let c = fuse_req_ctx(req)!.pointee
        return .init(uid: c.uid, gid: c.gid, pid: c.pid, umask: c.umask)
    }

    /// The caller's supplementary groups (read from /proc by libfuse; empty if unknown).
    static func groups(_ req: fuse_req_t?) -> [gid_t] {
        var list = [gid_t](repeating: 0, count: 64)
        let n = fuse_req_getgroups(req, Int32(list.count), &list)
        return n > 0 ? Array(list[0..<min(Int(n), list.count)]) : []
    }

    /// Replies an errno.
    static func err(_ req: fuse_req_t?, _ e: Int32) { fuse_reply_err(req, e) }

    /// Replies an error from any thrown error.
    static func fail(_ req: fuse_req_t?, _ error: Error) {
        fuse_reply_err(req, FSError(error).errno)
    }

    /// Replies an entry for a looked-up node.
    static func replyEntry(_ req: fuse_req_t?, _ node: Node, _ st: stat) {
        let ctx = context(req)
        var e = fuse_entry_param()
        e.ino = node.id
        e.attr = st
        e.attr_timeout = ctx.fs.attributeSeconds(node.id, normal: ctx.cacheTimeout)
        e.entry_timeout = ctx.cacheTimeout
        fuse_reply_entry(req, &e)
    }

    /// Replies an xattr value or list: its size when probed with 0, ERANGE when too small.
    static func replyXattr(_ req: fuse_req_t?, _ value: [UInt8], size: Int) {
        if size == 0 { fuse_reply_xattr(req, value.count) }
        else if size < value.count { fuse_reply_err(req, ERANGE) }
        else { value.withUnsafeBufferPointer { b in _ = fuse_reply_buf(req, UnsafeRawPointer(b.baseAddress)?.assumingMemoryBound(to: CChar.self), b.count) } }
    }

    /// Replies a readdir / readdirplus page from the snapshot taken at opendir. With
    /// `plus`, each entry is looked up (counting a kernel lookup, undone when the entry does
    /// not fit); entries that vanished since opendir are skipped.
    static func replyDirectory(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int, _ off: off_t,
                               _ fi: UnsafeMutablePointer<fuse_file_info>?, plus: Bool) {
        guard let fi, fi.pointee.fh != 0 else { return err(req, EBADF) }
        let ctx = context(req)
        let d = Unmanaged<DirHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).takeUnretainedValue()
        let parent = ctx.fs.table.node(ino)
        let entries: [DirHandle.Entry]
        do {
            entries = try d.entries(from: Int(off)) {
                guard let parent else { throw FSError(ESTALE) }
                return try ctx.fs.listing(parent)
            }
        } catch { return fail(req, error) }
        let buf = UnsafeMutablePointer<CChar>.allocate(capacity: max(size, 1))
        defer { buf.deallocate() }
        var used = 0
        var i = max(0, Int(off))
        while i < entries.count {
            let e = entries[i]
            var entry = fuse_entry_param()
            entry.attr.st_ino = UInt(e.ino)
            entry.attr.st_mode = mode_t(e.type) << 12
            var counted: UInt64 = 0
            if plus && e.name != "." && e.name != ".." {
                guard let parent, let (n, st) = try? ctx.fs.lookupBacking(parent, e.backing) else { i += 1; continue }
                entry.ino = n.id
                entry.attr = st
                entry.attr_timeout = ctx.fs.attributeSeconds(n.id, normal: ctx.cacheTimeout)
                entry.entry_timeout = ctx.cacheTimeout
                counted = n.id
            }
            let need = plus
                ? fuse_add_direntry_plus(req, buf + used, size - used, e.name, &entry, off_t(i + 1))
                : fuse_add_direntry(req, buf + used, size - used, e.name, &entry.attr, off_t(i + 1))
            if need > size - used {
                if counted != 0 { ctx.fs.table.forget(counted, count: 1) }
                break
            }
            used += need
            i += 1
        }
        fuse_reply_buf(req, buf, used)
    }

    /// The handle behind `fi.fh`.
    static func handle(_ fi: UnsafeMutablePointer<fuse_file_info>?) -> FileHandle? {
        guard let fi, fi.pointee.fh != 0 else { return nil }
        return Unmanaged<FileHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).takeUnretainedValue()
    }

    /// Stores a file handle in `fi` (no page cache kept across opens; direct I/O for class A).
    static func attach(_ h: FileHandle, to fi: UnsafeMutablePointer<fuse_file_info>) {
        fi.pointee.fh = UInt64(UInt(bitPattern: Unmanaged.passRetained(h).toOpaque()))
        fi.pointee.keep_cache = 0
        fi.pointee.direct_io = h.directIO ? 1 : 0
    }

    /// A C string argument as a Swift string.
    static func str(_ p: UnsafePointer<CChar>?) -> String { p.map { String(cString: $0) } ?? "" }

    /// A file name or symlink target: names are stored encrypted as UTF-8, so bytes that
    /// are not UTF-8 are refused (EILSEQ) rather than silently changed.
    static func name(_ p: UnsafePointer<CChar>?) throws -> String {
        guard let p, let s = String(validatingCString: p) else { throw FSError(EILSEQ) }
        return s
    }

    /// The operations table.
    static func operations() -> fuse_lowlevel_ops {
        var ops = fuse_lowlevel_ops()
        ops.`init` = { userdata, conn in
            guard let conn, let userdata else { return }
            // Write-back cache: writes land in the page cache and reach the daemon in large
            // requests when the kernel writes back (fsync, close, memory pressure). Class A
            // handles stay direct I/O; a lock first invalidates the inodes of protected
            // classes, which makes the kernel write their dirty pages while keys exist.
            let ctx = Unmanaged<FuseContext>.fromOpaque(userdata).takeUnretainedValue()
            if ctx.writebackCache {
                conn.pointee.want |= UInt32(FUSE_CAP_WRITEBACK_CACHE) & conn.pointee.capable
            } else {
                conn.pointee.want &= ~UInt32(FUSE_CAP_WRITEBACK_CACHE)
            }
            conn.pointee.want |= UInt32(FUSE_CAP_ATOMIC_O_TRUNC) & conn.pointee.capable
            // POSIX ACLs, enforced by the kernel; modes then come unmasked (PosixACLs.swift).
            let acl = UInt32(FUSE_CAP_POSIX_ACL), dontMask = UInt32(FUSE_CAP_DONT_MASK)
            if ctx.posixACL && conn.pointee.capable & (acl | dontMask) == acl | dontMask {
                conn.pointee.want |= acl | dontMask
                ctx.fs.posixACLs.store(true, ordering: .relaxed)
            }
            // 1 MiB requests (libfuse asks for max_pages to match): 8 times fewer round trips
            // for streaming I/O than the 128 KiB default. Readahead follows once the kernel
            // took the INIT reply (FuseChannel.raiseReadahead).
            conn.pointee.max_write = UInt32(FuseChannel.requestSize)
        }
        ops.lookup = { req, parent, name in
            do { let (n, st) = try FuseBridge.context(req).fs.lookup(parent: parent, name: FuseBridge.name(name)); FuseBridge.replyEntry(req, n, st) }
            catch { FuseBridge.fail(req, error) }
        }
        ops.forget = { req, ino, nlookup in
            FuseBridge.context(req).fs.table.forget(ino, count: nlookup)
            fuse_reply_none(req)
        }
        ops.forget_multi = { req, count, forgets in
            let fs = FuseBridge.context(req).fs
            if let forgets { for i in 0..<count { fs.table.forget(forgets[i].ino, count: forgets[i].nlookup) } }
            fuse_reply_none(req)
        }
        ops.getattr = { req, ino, fi in
            let ctx = FuseBridge.context(req)
            do {
                var st = try ctx.fs.getattr(ino, handle: FuseBridge.handle(fi))
                fuse_reply_attr(req, &st, ctx.fs.attributeSeconds(ino, normal: ctx.cacheTimeout))
            } catch { FuseBridge.fail(req, error) }
        }
        ops.access = { req, ino, mask in
            let caller = FuseBridge.caller(req)   // groups come from /proc: only read when they can matter
            do { try FuseBridge.context(req).fs.access(ino, mask: mask, caller: caller, groups: caller.uid == 0 ? [] : FuseBridge.groups(req)); fuse_reply_err(req, 0) }
            catch { FuseBridge.fail(req, error) }
        }
        ops.setattr = { req, ino, attr, toSet, fi in
            guard let a = attr?.pointee else { return FuseBridge.err(req, EINVAL) }
            let s = toSet
            func ts(_ set: Int32, _ now: Int32, _ v: timespec) -> timespec? {
                if s & now != 0 { return timespec(tv_sec: 0, tv_nsec: kbfs_UTIME_NOW) }
                return s & set != 0 ? v : nil
            }
            let killsSetID = kbfs_request_kills_setid() != 0
            do {
                var st = try FuseBridge.context(req).fs.setattr(
                    ino, handle: FuseBridge.handle(fi),
                    mode: s & FUSE_SET_ATTR_MODE != 0 ? a.st_mode : nil,
                    uid: s & FUSE_SET_ATTR_UID != 0 ? a.st_uid : nil,
                    gid: s & FUSE_SET_ATTR_GID != 0 ? a.st_gid : nil,
                    size: s & FUSE_SET_ATTR_SIZE != 0 ? Int(a.st_size) : nil,
                    atime: ts(FUSE_SET_ATTR_ATIME, FUSE_SET_ATTR_ATIME_NOW, a.st_atim),
                    mtime: ts(FUSE_SET_ATTR_MTIME, FUSE_SET_ATTR_MTIME_NOW, a.st_mtim),
                    clearSetIDFor: killsSetID ? FuseBridge.caller(req) : nil)
                fuse_reply_attr(req, &st, FuseBridge.context(req).fs.attributeSeconds(ino, normal: FuseBridge.context(req).cacheTimeout))
            } catch { FuseBridge.fail(req, error) }
        }
        ops.readlink = { req, ino in
            do {
                var bytes = try FuseBridge.context(req).fs.readlink(ino)
                bytes.append(0)
                bytes.withUnsafeBufferPointer { b in
                    _ = b.baseAddress!.withMemoryRebound(to: CChar.self, capacity: b.count) { fuse_reply_readlink(req, $0) }
                }
            } catch { FuseBridge.fail(req, error) }
        }
        ops.mknod = { req, parent, name, mode, rdev in
            do { let (n, st) = try FuseBridge.context(req).fs.mknod(parent: parent, name: FuseBridge.name(name), mode: mode, rdev: rdev, caller: FuseBridge.caller(req)); FuseBridge.replyEntry(req, n, st) }
            catch { FuseBridge.fail(req, error) }
        }
        ops.mkdir = { req, parent, name, mode in
            do { let (n, st) = try FuseBridge.context(req).fs.mkdir(parent: parent, name: FuseBridge.name(name), mode: mode, caller: FuseBridge.caller(req)); FuseBridge.replyEntry(req, n, st) }
            catch { FuseBridge.fail(req, error) }
        }
        ops.unlink = { req, parent, name in
            do { try FuseBridge.context(req).fs.unlink(parent: parent, name: FuseBridge.name(name)); _ = fuse_reply_err(req, 0) } catch { FuseBridge.fail(req, error) }
        }
        ops.rmdir = { req, parent, name in
            do { try FuseBridge.context(req).fs.rmdir(parent: parent, name: FuseBridge.name(name)); _ = fuse_reply_err(req, 0) } catch { FuseBridge.fail(req, error) }
        }
        ops.symlink = { req, link, parent, name in
            do { let (n, st) = try FuseBridge.context(req).fs.symlink(target: FuseBridge.name(link), parent: parent, name: FuseBridge.name(name), caller: FuseBridge.caller(req)); FuseBridge.replyEntry(req, n, st) }
            catch { FuseBridge.fail(req, error) }
        }
        ops.rename = { req, parent, name, newParent, newName, flags in
            do { try FuseBridge.context(req).fs.rename(parent: parent, name: FuseBridge.name(name), newParent: newParent, newName: FuseBridge.name(newName), flags: flags); _ = fuse_reply_err(req, 0) }
            catch { FuseBridge.fail(req, error) }
        }
        ops.link = { req, ino, newParent, newName in
            do { let (n, st) = try FuseBridge.context(req).fs.link(ino, newParent: newParent, newName: FuseBridge.name(newName)); FuseBridge.replyEntry(req, n, st) }
            catch { FuseBridge.fail(req, error) }
        }
        ops.open = { req, ino, fi in
            guard let fi else { return FuseBridge.err(req, EINVAL) }
            do {
                let h = try FuseBridge.context(req).fs.open(ino, flags: fi.pointee.flags, caller: FuseBridge.caller(req))
                FuseBridge.attach(h, to: fi)
                if fuse_reply_open(req, fi) != 0 { FuseBridge.context(req).fs.release(h); Unmanaged<FileHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).release() }
            } catch { FuseBridge.fail(req, error) }
        }
        ops.create = { req, parent, name, mode, fi in
            guard let fi else { return FuseBridge.err(req, EINVAL) }
            do {
                let fs = FuseBridge.context(req).fs, entryName = try FuseBridge.name(name)
                let (n, st, h) = entryName == FuseChannel.unnamedFileName
                    ? try fs.createUnnamed(parent: parent, mode: mode, caller: FuseBridge.caller(req))   // O_TMPFILE
                    : try fs.create(parent: parent, name: entryName, mode: mode, flags: fi.pointee.flags, caller: FuseBridge.caller(req))
                FuseBridge.attach(h, to: fi)
                var e = fuse_entry_param()
                e.ino = n.id
                e.attr = st
                e.attr_timeout = FuseBridge.context(req).fs.attributeSeconds(n.id, normal: FuseBridge.context(req).cacheTimeout)
                e.entry_timeout = FuseBridge.context(req).cacheTimeout
                if fuse_reply_create(req, &e, fi) != 0 { FuseBridge.context(req).fs.release(h); Unmanaged<FileHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).release() }
            } catch { FuseBridge.fail(req, error) }
        }
        ops.read = { req, _, size, off, fi in
            guard let h = FuseBridge.handle(fi) else { return FuseBridge.err(req, EBADF) }
            ScratchBuffers.shared.with(max(size, 1)) { buf in
                do {
                    try FuseBridge.context(req).fs.read(h, offset: Int(off), into: UnsafeMutableRawBufferPointer(rebasing: buf[0..<size])) { n in
                        fuse_reply_buf(req, buf.baseAddress!.assumingMemoryBound(to: CChar.self), n)
                    }
                } catch { FuseBridge.fail(req, error) }
            }
        }
        ops.write = { req, _, data, size, off, fi in
            guard let h = FuseBridge.handle(fi) else { return FuseBridge.err(req, EBADF) }
            do {
                let killsSetID = kbfs_request_kills_setid() != 0
                try FuseBridge.context(req).fs.write(h, offset: Int(off), data: UnsafeRawBufferPointer(start: data, count: size))
                if killsSetID { FuseBridge.context(req).fs.clearSetID(h, by: FuseBridge.caller(req)) }
                fuse_reply_write(req, size)
            } catch { FuseBridge.fail(req, error) }
        }
        // No flush: writes reach the store before they are acknowledged and locks are the
        // kernel's, so close() has nothing to wait for. Without the operation the kernel
        // stops sending FLUSH after the first ENOSYS (it still writes back mmap pages).
        ops.flush = nil
        ops.fallocate = { req, _, mode, off, length, fi in
            guard let h = FuseBridge.handle(fi) else { return FuseBridge.err(req, EBADF) }
            do { try FuseBridge.context(req).fs.fallocate(h, mode: mode, offset: Int(off), length: Int(length), caller: FuseBridge.caller(req)); FuseBridge.err(req, 0) }
            catch { FuseBridge.fail(req, error) }
        }
        ops.release = { req, _, fi in
            if let fi, fi.pointee.fh != 0 {
                let h = Unmanaged<FileHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).takeRetainedValue()
                FuseBridge.context(req).fs.release(h)
            }
            fuse_reply_err(req, 0)
        }
        ops.fsync = { req, _, datasync, fi in
            guard let h = FuseBridge.handle(fi) else { return FuseBridge.err(req, EBADF) }
            do { try FuseBridge.context(req).fs.fsync(h, dataOnly: datasync != 0); _ = fuse_reply_err(req, 0) } catch { FuseBridge.fail(req, error) }
        }
        ops.opendir = { req, ino, fi in
            guard let fi else { return FuseBridge.err(req, EINVAL) }
            do {
                let d = try FuseBridge.context(req).fs.opendir(ino)
                fi.pointee.fh = UInt64(UInt(bitPattern: Unmanaged.passRetained(d).toOpaque()))
                if fuse_reply_open(req, fi) != 0 { Unmanaged<DirHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).release() }
            } catch { FuseBridge.fail(req, error) }
        }
        ops.readdir = { req, ino, size, off, fi in FuseBridge.replyDirectory(req, ino, size, off, fi, plus: false) }
        ops.readdirplus = { req, ino, size, off, fi in FuseBridge.replyDirectory(req, ino, size, off, fi, plus: true) }
        ops.releasedir = { req, _, fi in
            if let fi, fi.pointee.fh != 0 {
                Unmanaged<DirHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).release()
            }
            fuse_reply_err(req, 0)
        }
        ops.fsyncdir = { req, _, _, _ in _ = fuse_reply_err(req, 0) }
        ops.statfs = { req, _ in
            do { var s = try FuseBridge.context(req).fs.statfs(); fuse_reply_statfs(req, &s) } catch { FuseBridge.fail(req, error) }
        }
        ops.setxattr = { req, ino, name, value, size, flags in
            let n = FuseBridge.str(name)
            let bytes = value.map { Array(UnsafeRawBufferPointer(start: $0, count: size)) } ?? []
            let fs = FuseBridge.context(req).fs
            do {
                if fs.isACL(n) {
                    try fs.setACL(ino, name: n, value: bytes, flags: flags, caller: FuseBridge.caller(req))
                } else if n == Filesystem.protectionXattr {
                    guard let cls = ProtectionClass(name: String(decoding: bytes, as: UTF8.self)) else { return FuseBridge.err(req, EINVAL) }
                    let current = try? fs.protection(of: ino)
                    if flags & kbfs_XATTR_CREATE != 0 && current != nil { return FuseBridge.err(req, EEXIST) }
                    if flags & kbfs_XATTR_REPLACE != 0 && current == nil { return FuseBridge.err(req, ENODATA) }
                    try fs.setProtection(of: ino, to: cls)
                } else {
                    try fs.setXattr(ino, name: n, value: bytes, flags: flags)
                }
                FuseBridge.err(req, 0)
            } catch { FuseBridge.fail(req, error) }
        }
        ops.getxattr = { req, ino, name, size in
            // Only the user.* namespace exists, and ACLs where the kernel enforces them (the
            // kernel asks for security.capability before every write). EOPNOTSUPP, not
            // ENODATA, for the others: ls -l then stops asking for SELinux labels (and ACLs,
            // where off) of every further file on this filesystem.
            let fs = FuseBridge.context(req).fs
            let n = FuseBridge.str(name)
            if fs.isACL(n) {
                do { FuseBridge.replyXattr(req, try fs.getACL(ino, name: n), size: size) } catch { FuseBridge.fail(req, error) }
                return
            }
            guard let name, strncmp(name, "user.", 5) == 0 else { return FuseBridge.err(req, EOPNOTSUPP) }
            do {
                let value = n == Filesystem.protectionXattr ? Array(try fs.protection(of: ino).name.utf8) : try fs.getXattr(ino, name: n)
                FuseBridge.replyXattr(req, value, size: size)
            } catch { FuseBridge.fail(req, error) }
        }
        ops.listxattr = { req, ino, size in
            do {
                let names = try FuseBridge.context(req).fs.listXattrs(ino)
                FuseBridge.replyXattr(req, names.flatMap { Array($0.utf8) + [0] }, size: size)
            } catch { FuseBridge.fail(req, error) }
        }
        ops.removexattr = { req, ino, name in
            let n = FuseBridge.str(name)
            let fs = FuseBridge.context(req).fs
            do {
                if fs.isACL(n) { try fs.removeACL(ino, name: n) }
                else if n == Filesystem.protectionXattr { try fs.removeProtection(of: ino) } else { try fs.removeXattr(ino, name: n) }
                FuseBridge.err(req, 0)
            } catch { FuseBridge.fail(req, error) }
        }
        return ops
    }
}
