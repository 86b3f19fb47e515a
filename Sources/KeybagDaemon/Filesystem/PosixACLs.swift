import CSystem
import Glibc
import KeybagCore
import Synchronization

/// POSIX ACLs (`setfacl`, `getfacl`), on mounts where the kernel checks permissions
/// (`default_permissions`): the kernel enforces them from the two `system.posix_acl_*`
/// xattrs, which are kept as the backing object's own ACL, in the clear like its owner and
/// mode (they name users and groups, never content). The backing filesystem then does what
/// an ACL asks of a filesystem: the mode follows a new access ACL and a chmod changes the
/// mask, and new objects inherit a directory's default ACL. For that last rule the kernel
/// passes modes unmasked (FUSE_DONT_MASK) and the daemon applies the caller's umask itself
/// where no default ACL does.
final class PosixACLs: Sendable {
    /// The two ACL xattrs.
    static let names: Set<String> = ["system.posix_acl_access", "system.posix_acl_default"]

    /// Whether the kernel enforces ACLs on this mount (INIT agreed to FUSE_POSIX_ACL).
    let enabled = Atomic<Bool>(false)

    /// Whether `name` is an ACL xattr this mount keeps.
    func isACL(_ name: String) -> Bool { enabled.load(ordering: .relaxed) && Self.names.contains(name) }

    /// The mode a new object in `p` is made with: `mode` as asked where `p` has a default ACL
    /// (the backing filesystem derives the rest from it), else without the caller's umask.
    func creationMode(_ mode: mode_t, in p: Node, by caller: Caller) -> mode_t {
        if enabled.load(ordering: .relaxed) && getxattr(p.procPath, "system.posix_acl_default", nil, 0) > 0 {
            return mode
        }
        return mode & ~caller.umask
    }

    /// getxattr of an ACL: the backing object's. Where the store's filesystem keeps none
    /// (btrfs -o noacl), there is none (ENODATA): the kernel asks before its permission checks,
    /// and an error there would deny everyone but the owner.
    func value(of n: Node, name: String) throws -> [UInt8] {
        do {
            return try n.withPathFD { fd in
                let path = "/proc/self/fd/\(fd)"
                let size = try check(getxattr(path, name, nil, 0))
                var value = [UInt8](repeating: 0, count: size)
                let got = try check(getxattr(path, name, &value, value.count))
                return Array(value[0..<got])
            }
        } catch  where FSError(error).errno == EOPNOTSUPP {
            throw FSError(ENODATA)
        }
    }

    /// setxattr of an ACL on the backing object. An access ACL set by a caller outside the
    /// file's group and without CAP_FSETID clears set-group-ID, as the kernel's rule is
    /// (it cannot tell us through libfuse 3.14, which lacks FUSE_SETXATTR_EXT).
    func set(_ n: Node, name: String, value: [UInt8], flags: Int32, caller: Caller) throws {
        try n.withPathFD { fd in
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
    func remove(_ n: Node, name: String) throws {
        try n.withPathFD { fd in _ = try check(removexattr("/proc/self/fd/\(fd)", name)) }
    }

    /// The ACL xattrs the backing object has (for listxattr).
    func present(on n: Node) -> [String] {
        guard enabled.load(ordering: .relaxed), !n.isSymlink else { return [] }
        let present = try? n.withPathFD { fd in
            Self.names.sorted().filter { getxattr("/proc/self/fd/\(fd)", $0, nil, 0) > 0 }
        }
        return present ?? []
    }
}
