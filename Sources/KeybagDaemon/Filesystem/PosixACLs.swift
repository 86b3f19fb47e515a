import CSystem
import Glibc
import KeybagCore

/// POSIX ACLs (`setfacl`, `getfacl`), on mounts where the kernel checks permissions
/// (`default_permissions`): the kernel enforces them from the two `system.posix_acl_*`
/// xattrs, which are kept as the backing object's own ACL, in the clear like its owner and
/// mode (they name users and groups, never content). The backing filesystem then does what
/// an ACL asks of a filesystem: the mode follows a new access ACL and a chmod changes the
/// mask, and new objects inherit a directory's default ACL. For that last rule the kernel
/// passes modes unmasked (FUSE_DONT_MASK) and the daemon applies the caller's umask itself
/// where no default ACL does.
extension Filesystem {
    /// The two ACL xattrs.
    static let aclXattrs: Set<String> = ["system.posix_acl_access", "system.posix_acl_default"]

    /// Whether `name` is an ACL xattr this mount keeps.
    func isACL(_ name: String) -> Bool { posixACLs.load(ordering: .relaxed) && Self.aclXattrs.contains(name) }

    /// The mode a new object in `p` is made with: `mode` as asked where `p` has a default ACL
    /// (the backing filesystem derives the rest from it), else without the caller's umask.
    func creationMode(_ mode: mode_t, in p: Node, by caller: Caller) -> mode_t {
        let on = posixACLs.load(ordering: .relaxed)
        if on && getxattr(p.procPath, "system.posix_acl_default", nil, 0) > 0 { return mode }
        return mode & ~caller.umask
    }

    /// getxattr of an ACL: the backing object's. Where the store's filesystem keeps none
    /// (btrfs -o noacl), there is none (ENODATA): the kernel asks before its permission checks,
    /// and an error there would deny everyone but the owner.
    func getACL(_ id: UInt64, name: String) throws -> [UInt8] {
        do {
            return try node(id).withPathFD { fd in
                let path = "/proc/self/fd/\(fd)"
                let size = try check(getxattr(path, name, nil, 0))
                var value = [UInt8](repeating: 0, count: size)
                let n = try check(getxattr(path, name, &value, value.count))
                return Array(value[0..<n])
            }
        } catch  where FSError(error).errno == EOPNOTSUPP {
            throw FSError(ENODATA)
        }
    }

    /// setxattr of an ACL on the backing object. An access ACL set by a caller outside the
    /// file's group and without CAP_FSETID clears set-group-ID, as the kernel's rule is
    /// (it cannot tell us through libfuse 3.14, which lacks FUSE_SETXATTR_EXT).
    func setACL(_ id: UInt64, name: String, value: [UInt8], flags: Int32, caller: Caller) throws {
        try node(id).withPathFD { fd in
            let path = "/proc/self/fd/\(fd)"
            try check(setxattr(path, name, value, value.count, flags))
            var st = stat()
            if name == "system.posix_acl_access", fstat(fd, &st) == 0, st.st_mode & S_ISGID != 0,
                !caller.isInGroup(st.st_gid), !caller.mayKeepSetID
            {
                _ = chmod(path, st.st_mode & 0o7777 & ~S_ISGID)
            }
        }
    }

    /// removexattr of an ACL on the backing object.
    func removeACL(_ id: UInt64, name: String) throws {
        try node(id).withPathFD { fd in _ = try check(removexattr("/proc/self/fd/\(fd)", name)) }
    }

    /// The ACL xattrs the backing object has (for listxattr).
    func aclNames(_ n: Node) -> [String] {
        guard posixACLs.load(ordering: .relaxed), !n.isSymlink else { return [] }
        let present = try? n.withPathFD { fd in
            Self.aclXattrs.sorted().filter { getxattr("/proc/self/fd/\(fd)", $0, nil, 0) > 0 }
        }
        return present ?? []
    }
}
