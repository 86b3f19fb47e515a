import CFuse
import Glibc
import KeybagCore

/// User xattrs other than `user.protection`: names and values sealed under the volume key
/// in `STORE/xattrs/<id>`, where the id is a file's header file id or a directory's name
/// IV, so renames, hard links and `cp -a` keep them. Linux allows `user.*` only on regular
/// files and directories; elsewhere they answer EPERM as on ext4.
extension Attributes {
    /// The virtual xattr of the protection class.
    static let protectionXattr = "user.protection"

    /// The stable id under which a node's xattrs are stored.
    func xattrID(_ n: Node) throws -> String {
        if n.isDirectory { return Base64URL.encode(try directories.meta(of: n).iv) }
        guard let file = n.file else { throw FSError(EPERM) }
        if let h = file.io.read({ $0.header }) { return Base64URL.encode(h.fileID) }
        let fd = try check(n.open(O_RDONLY))
        defer { close(fd) }
        return Base64URL.encode(try HeaderSlots.current(fd: fd).fileID)
    }

    /// Whether any xattr set is stored (removals look for one only then).
    var hasStoredXattrs: Bool { xattrs.holdsAny }

    /// Deletes the xattr set stored under `id`, if any (its object is gone).
    func dropXattrs(_ id: String) { xattrs.drop(id) }

    /// Deletes the xattr set of a removed directory (known by its metadata), if any.
    func dropXattrs(ofDirectory meta: DirectoryMeta?) {
        if let meta, hasStoredXattrs { dropXattrs(Base64URL.encode(meta.iv)) }
    }

    /// The xattr id of the regular file `name` in `dirFD` (stat `st`) when removing that name
    /// removes the file and a set may be stored for it; nil otherwise. A file still open
    /// keeps its set (its descriptors may still read it).
    func xattrIDOfLastLink(dirFD: Int32, name: String, st: stat) -> String? {
        guard (st.st_mode & S_IFMT) == S_IFREG, st.st_nlink == 1, hasStoredXattrs else { return nil }
        if let file = table.node(dev: UInt64(st.st_dev), ino: UInt64(st.st_ino))?.file {
            let (open, header) = file.io.read { ($0.openCount, $0.header) }
            if open > 0 { return nil }
            if let header {
                let id = Base64URL.encode(header.fileID)
                return keptForConflictCopies(id, dirFD: dirFD, name: name) ? nil : id
            }
        }
        let fd = openat(dirFD, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        guard let id = (try? HeaderSlots.current(fd: fd)).map({ Base64URL.encode($0.fileID) }) else {
            return nil
        }
        return keptForConflictCopies(id, dirFD: dirFD, name: name) ? nil : id
    }

    /// Whether the stored set `id` of entry `name` must stay because a conflict copy may
    /// share it (looked for only when the set exists: a directory scan).
    private func keptForConflictCopies(_ id: String, dirFD: Int32, name: String) -> Bool {
        xattrs.exists(id) && directories.mayShareXattrSet(dirFD: dirFD, name: name)
    }

    /// getxattr: an ACL where the kernel enforces them, the virtual `user.protection`, or a
    /// stored user xattr. Only those namespaces exist (the kernel asks for
    /// `security.capability` before every write): EOPNOTSUPP, not ENODATA, for the others, so
    /// that `ls -l` stops asking for SELinux labels (and ACLs, where off) of every file.
    func getXattr(_ id: UInt64, name: String) throws -> [UInt8] {
        if acls.isACL(name) { return try acls.value(of: table.known(id), name: name) }
        if name == Self.protectionXattr { return Array(try protection(of: id).name.utf8) }
        return try storedXattr(id, name: name)
    }

    /// setxattr (XATTR_CREATE / XATTR_REPLACE): an ACL, the class (a class name, else
    /// EINVAL), or a stored user xattr.
    func setXattr(_ id: UInt64, name: String, value: [UInt8], flags: Int32, caller: Caller) throws {
        if acls.isACL(name) {
            return try acls.set(table.known(id), name: name, value: value, flags: flags, caller: caller)
        }
        guard name == Self.protectionXattr else {
            return try setStoredXattr(id, name: name, value: value, flags: flags)
        }
        guard let cls = ProtectionClass(name: String(decoding: value, as: UTF8.self)) else { throw FSError(EINVAL) }
        let current = try? protection(of: id)
        if flags & kbfs_XATTR_CREATE != 0 && current != nil { throw FSError(EEXIST) }
        if flags & kbfs_XATTR_REPLACE != 0 && current == nil { throw FSError(ENODATA) }
        try setProtection(of: id, to: cls)
    }

    /// removexattr: an ACL, the class (a directory's own default), or a stored user xattr.
    func removeXattr(_ id: UInt64, name: String) throws {
        if acls.isACL(name) { return try acls.remove(table.known(id), name: name) }
        if name == Self.protectionXattr { return try removeProtection(of: id) }
        try removeStoredXattr(id, name: name)
    }

    /// getxattr of a stored user xattr.
    func storedXattr(_ id: UInt64, name: String) throws -> [UInt8] {
        guard name.hasPrefix("user.") else { throw FSError(EOPNOTSUPP) }
        let n = try table.known(id)
        guard n.isRegular || n.isDirectory else { throw FSError(ENODATA) }
        return try xattrs.value(try xattrID(n), name: name)
    }

    /// setxattr of a stored user xattr, with XATTR_CREATE / XATTR_REPLACE semantics.
    func setStoredXattr(_ id: UInt64, name: String, value: [UInt8], flags: Int32) throws {
        guard name.hasPrefix("user."), name.utf8.count > 5, name.utf8.count <= 255 else {
            throw FSError(name.hasPrefix("user.") ? ERANGE : EOPNOTSUPP)
        }
        try xattrs.set(try xattrID(try table.known(id)), name: name, value: value, flags: flags)
    }

    /// removexattr of a stored user xattr.
    func removeStoredXattr(_ id: UInt64, name: String) throws {
        guard name.hasPrefix("user.") else { throw FSError(EOPNOTSUPP) }
        let n = try table.known(id)
        guard n.isRegular || n.isDirectory else { throw FSError(ENODATA) }
        try xattrs.remove(try xattrID(n), name: name)
    }

    /// The names listxattr reports: `user.protection` where it applies, then stored ones.
    func listXattrs(_ id: UInt64) throws -> [String] {
        let n = try table.known(id)
        var out: [String] = []
        if (try? protection(of: id)) != nil { out.append(Self.protectionXattr) }
        if n.isRegular || n.isDirectory { out += try xattrs.names(try xattrID(n)) }
        return out + acls.present(on: n)
    }
}
