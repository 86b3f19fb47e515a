import CFuse
import CSystem
import Glibc
import KeybagCore

// One function per FUSE operation, assigned in `FuseBridge.operations`: each decodes its
// request, calls `Filesystem` and replies (as libfuse's passthrough_hp does with its sfs_*).
// File-scope functions, so a C function pointer can be formed from them and stack traces
// and profiles name the operation.

/// The open-file information libfuse passes with file and directory requests.
typealias FileInfo = UnsafeMutablePointer<fuse_file_info>
/// A name or string argument as libfuse passes it.
typealias CName = UnsafePointer<CChar>

/// INIT: what the daemon asks of the kernel.
func fuseInit(_ userdata: UnsafeMutableRawPointer?, _ conn: UnsafeMutablePointer<fuse_conn_info>?) {
    guard let conn, let userdata else { return }
    let ctx = Unmanaged<FuseContext>.fromOpaque(userdata).takeUnretainedValue()
    // Write-back cache: writes land in the page cache and reach the daemon in large
    // requests when the kernel writes back (fsync, close, memory pressure). Class A
    // handles stay direct I/O; a lock first invalidates the inodes of protected
    // classes, which makes the kernel write their dirty pages while keys exist.
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
        ctx.fs.attributes.acls.enabled.store(true, ordering: .relaxed)
    }
    // 1 MiB requests (libfuse asks for max_pages to match): 8 times fewer round trips
    // for streaming I/O than the 128 KiB default. Readahead follows once the kernel
    // took the INIT reply (FuseChannel.raiseReadahead).
    conn.pointee.max_write = UInt32(FuseChannel.requestSize)
    // Background requests in flight at once (the kernel's default is 12): write-back and the
    // release of a closed file are both background requests, in one queue. With 12, the
    // release of a file deleted while open waited behind the write-back that needed its
    // space, and those writes met a full store that was not (generic/371).
    conn.pointee.max_background = 64
}

// MARK: names and attributes

func fuseLookup(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ name: CName?) {
    let fs = FuseBridge.fs(req)
    let changes = fs.underneath.namesSeen
    do {
        let (n, st) = try fs.lookups.lookup(parent: parent, name: FuseBridge.name(name))
        FuseBridge.replyEntry(req, n, st)
    } catch
        where FSError(error).errno == ENOENT
        && fs.underneath.namesSeen == changes
    {
        FuseBridge.replyAbsent(req)
    } catch {
        FuseBridge.fail(req, error)
    }
}

func fuseForget(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ nlookup: UInt64) {
    FuseBridge.fs(req).table.forget(ino, count: nlookup)
    fuse_reply_none(req)
}

func fuseForgetMulti(_ req: fuse_req_t?, _ count: Int, _ forgets: UnsafeMutablePointer<fuse_forget_data>?) {
    let fs = FuseBridge.fs(req)
    if let forgets { for i in 0..<count { fs.table.forget(forgets[i].ino, count: forgets[i].nlookup) } }
    fuse_reply_none(req)
}

func fuseGetattr(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: FileInfo?) {
    FuseBridge.replying(req) {
        FuseBridge.replyAttributes(
            req, ino, try FuseBridge.fs(req).attributes.getattr(ino, handle: FuseBridge.handle(fi)))
    }
}

func fuseAccess(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ mask: Int32) {
    let caller = FuseBridge.caller(req)  // groups come from /proc: only read when they can matter
    FuseBridge.replyingDone(req) {
        let groups = caller.uid == 0 ? [] : FuseBridge.groups(req)
        try FuseBridge.fs(req).attributes.access(ino, mask: mask, caller: caller, groups: groups)
    }
}

func fuseSetattr(
    _ req: fuse_req_t?, _ ino: fuse_ino_t, _ attr: UnsafeMutablePointer<stat>?, _ toSet: Int32,
    _ fi: FileInfo?
) {
    guard let a = attr?.pointee else { return FuseBridge.err(req, EINVAL) }
    func ts(_ set: Int32, _ now: Int32, _ v: timespec) -> timespec? {
        if toSet & now != 0 { return timespec(tv_sec: 0, tv_nsec: kbfs_UTIME_NOW) }
        return toSet & set != 0 ? v : nil
    }
    FuseBridge.replying(req) {
        let st = try FuseBridge.fs(req).attributes.setattr(
            ino, handle: FuseBridge.handle(fi),
            mode: toSet & FUSE_SET_ATTR_MODE != 0 ? a.st_mode : nil,
            uid: toSet & FUSE_SET_ATTR_UID != 0 ? a.st_uid : nil,
            gid: toSet & FUSE_SET_ATTR_GID != 0 ? a.st_gid : nil,
            size: toSet & FUSE_SET_ATTR_SIZE != 0 ? Int(a.st_size) : nil,
            atime: ts(FUSE_SET_ATTR_ATIME, FUSE_SET_ATTR_ATIME_NOW, a.st_atim),
            mtime: ts(FUSE_SET_ATTR_MTIME, FUSE_SET_ATTR_MTIME_NOW, a.st_mtim),
            truncatedBy: FuseBridge.caller(req))
        FuseBridge.replyAttributes(req, ino, st)
    }
}

func fuseReadlink(_ req: fuse_req_t?, _ ino: fuse_ino_t) {
    FuseBridge.replying(req) {
        var bytes = try FuseBridge.fs(req).namespace.readlink(ino)
        bytes.append(0)
        bytes.withUnsafeBufferPointer { b in
            _ = b.baseAddress!.withMemoryRebound(to: CChar.self, capacity: b.count) { fuse_reply_readlink(req, $0) }
        }
    }
}

// MARK: directory entries

func fuseMknod(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ name: CName?, _ mode: mode_t, _ rdev: dev_t) {
    FuseBridge.replying(req) {
        let (n, st) = try FuseBridge.fs(req).namespace.mknod(
            parent: parent, name: FuseBridge.name(name), mode: mode, rdev: rdev,
            caller: FuseBridge.caller(req))
        FuseBridge.replyEntry(req, n, st)
    }
}

func fuseMkdir(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ name: CName?, _ mode: mode_t) {
    FuseBridge.replying(req) {
        let (n, st) = try FuseBridge.fs(req).namespace.mkdir(
            parent: parent, name: FuseBridge.name(name), mode: mode,
            caller: FuseBridge.caller(req))
        FuseBridge.replyEntry(req, n, st)
    }
}

func fuseUnlink(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ name: CName?) {
    FuseBridge.replyingDone(req) {
        try FuseBridge.fs(req).namespace.unlink(parent: parent, name: FuseBridge.name(name))
    }
}

func fuseRmdir(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ name: CName?) {
    FuseBridge.replyingDone(req) { try FuseBridge.fs(req).namespace.rmdir(parent: parent, name: FuseBridge.name(name)) }
}

func fuseSymlink(_ req: fuse_req_t?, _ link: CName?, _ parent: fuse_ino_t, _ name: CName?) {
    FuseBridge.replying(req) {
        let (n, st) = try FuseBridge.fs(req).namespace.symlink(
            target: FuseBridge.name(link), parent: parent,
            name: FuseBridge.name(name), caller: FuseBridge.caller(req))
        FuseBridge.replyEntry(req, n, st)
    }
}

func fuseRename(
    _ req: fuse_req_t?, _ parent: fuse_ino_t, _ name: CName?, _ newParent: fuse_ino_t,
    _ newName: CName?, _ flags: UInt32
) {
    FuseBridge.replyingDone(req) {
        try FuseBridge.fs(req).namespace.rename(
            parent: parent, name: FuseBridge.name(name), newParent: newParent,
            newName: FuseBridge.name(newName), flags: flags)
    }
}

func fuseLink(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ newParent: fuse_ino_t, _ newName: CName?) {
    FuseBridge.replying(req) {
        let (n, st) = try FuseBridge.fs(req).namespace.link(
            ino, newParent: newParent, newName: FuseBridge.name(newName))
        FuseBridge.replyEntry(req, n, st)
    }
}

// MARK: files

func fuseOpen(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: FileInfo?) {
    guard let fi else { return FuseBridge.err(req, EINVAL) }
    FuseBridge.replying(req) {
        let h = try FuseBridge.fs(req).io.open(ino, flags: fi.pointee.flags, caller: FuseBridge.caller(req))
        FuseBridge.attach(h, to: fi)
        if fuse_reply_open(req, fi) != 0 { FuseBridge.releaseHandle(req, fi) }  // the opener is gone
    }
}

/// CREATE, and `open(2)` with O_TMPFILE: FuseChannel relabels FUSE_TMPFILE as CREATE with
/// the name "/", which no real entry has.
func fuseCreate(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ name: CName?, _ mode: mode_t, _ fi: FileInfo?) {
    guard let fi else { return FuseBridge.err(req, EINVAL) }
    FuseBridge.replying(req) {
        let fs = FuseBridge.fs(req), entryName = try FuseBridge.name(name)
        let (n, st, h) =
            entryName == FuseChannel.unnamedFileName
            ? try fs.io.createUnnamed(parent: parent, mode: mode, caller: FuseBridge.caller(req))
            : try fs.io.create(
                parent: parent, name: entryName, mode: mode, flags: fi.pointee.flags,
                caller: FuseBridge.caller(req))
        FuseBridge.attach(h, to: fi)
        var e = FuseBridge.entry(req, n, st)
        if fuse_reply_create(req, &e, fi) != 0 {  // interrupted: the kernel knows neither the handle nor the node
            FuseBridge.releaseHandle(req, fi)
            fs.table.forget(n.id, count: 1)
        }
    }
}

func fuseRead(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int, _ off: off_t, _ fi: FileInfo?) {
    guard let h = FuseBridge.handle(fi) else { return FuseBridge.err(req, EBADF) }
    ScratchBuffers.shared.with(max(size, 1)) { buf in
        FuseBridge.replying(req) {
            let into = UnsafeMutableRawBufferPointer(rebasing: buf[0..<size])
            try FuseBridge.fs(req).io.read(h, offset: Int(off), into: into) { n in
                fuse_reply_buf(req, buf.baseAddress!.assumingMemoryBound(to: CChar.self), n)
            }
        }
    }
}

func fuseWrite(
    _ req: fuse_req_t?, _ ino: fuse_ino_t, _ data: CName?, _ size: Int, _ off: off_t,
    _ fi: FileInfo?
) {
    guard let h = FuseBridge.handle(fi) else { return FuseBridge.err(req, EBADF) }
    FuseBridge.replying(req) {
        let fs = FuseBridge.fs(req)
        try fs.io.write(h, offset: Int(off), data: UnsafeRawBufferPointer(start: data, count: size))
        fs.io.clearSetIDAfterModification(h, by: FuseBridge.caller(req))
        fuse_reply_write(req, size)
    }
}

func fuseFallocate(
    _ req: fuse_req_t?, _ ino: fuse_ino_t, _ mode: Int32, _ off: off_t, _ length: off_t,
    _ fi: FileInfo?
) {
    guard let h = FuseBridge.handle(fi) else { return FuseBridge.err(req, EBADF) }
    FuseBridge.replyingDone(req) {
        try FuseBridge.fs(req).io.fallocate(
            h, mode: mode, offset: Int(off), length: Int(length),
            caller: FuseBridge.caller(req))
    }
}

func fuseRelease(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: FileInfo?) {
    FuseBridge.releaseHandle(req, fi)
    fuse_reply_err(req, 0)
}

func fuseFsync(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ datasync: Int32, _ fi: FileInfo?) {
    guard let h = FuseBridge.handle(fi) else { return FuseBridge.err(req, EBADF) }
    FuseBridge.replyingDone(req) { try FuseBridge.fs(req).io.fsync(h, dataOnly: datasync != 0) }
}

// MARK: directories

func fuseOpendir(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: FileInfo?) {
    guard let fi else { return FuseBridge.err(req, EINVAL) }
    FuseBridge.replying(req) {
        FuseBridge.attach(try FuseBridge.fs(req).namespace.opendir(ino), to: fi)
        if fuse_reply_open(req, fi) != 0 { FuseBridge.releaseDirectory(fi) }
    }
}

func fuseReaddir(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int, _ off: off_t, _ fi: FileInfo?) {
    FuseBridge.replyDirectory(req, ino, size, off, fi, plus: false)
}

func fuseReaddirplus(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int, _ off: off_t, _ fi: FileInfo?) {
    FuseBridge.replyDirectory(req, ino, size, off, fi, plus: true)
}

func fuseReleasedir(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: FileInfo?) {
    FuseBridge.releaseDirectory(fi)
    fuse_reply_err(req, 0)
}

func fuseFsyncdir(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ datasync: Int32, _ fi: FileInfo?) {
    FuseBridge.replyingDone(req) { try FuseBridge.fs(req).namespace.fsyncdir(ino) }
}

func fuseStatfs(_ req: fuse_req_t?, _ ino: fuse_ino_t) {
    FuseBridge.replying(req) {
        var s = try FuseBridge.fs(req).statfs()
        fuse_reply_statfs(req, &s)
    }
}

// MARK: xattrs (user.*, the virtual user.protection, ACLs where on: Xattrs.swift)

func fuseSetxattr(
    _ req: fuse_req_t?, _ ino: fuse_ino_t, _ name: CName?, _ value: CName?,
    _ size: Int, _ flags: Int32
) {
    let bytes = value.map { Array(UnsafeRawBufferPointer(start: $0, count: size)) } ?? []
    FuseBridge.replyingDone(req) {
        try FuseBridge.fs(req).attributes.setXattr(
            ino, name: FuseBridge.str(name), value: bytes, flags: flags,
            caller: FuseBridge.caller(req))
    }
}

func fuseGetxattr(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ name: CName?, _ size: Int) {
    FuseBridge.replying(req) {
        FuseBridge.replyXattr(
            req, try FuseBridge.fs(req).attributes.getXattr(ino, name: FuseBridge.str(name)), size: size)
    }
}

func fuseListxattr(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int) {
    FuseBridge.replying(req) {
        let names = try FuseBridge.fs(req).attributes.listXattrs(ino)
        FuseBridge.replyXattr(req, names.flatMap { Array($0.utf8) + [0] }, size: size)
    }
}

func fuseRemovexattr(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ name: CName?) {
    FuseBridge.replyingDone(req) { try FuseBridge.fs(req).attributes.removeXattr(ino, name: FuseBridge.str(name)) }
}
