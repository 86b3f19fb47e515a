import CSystem
import Glibc

/// The attribute changes of one setattr (all but the size).
struct AttributeChange {
    let mode: mode_t?, uid: uid_t?, gid: gid_t?, atime: timespec?, mtime: timespec?
    /// The caller of a truncate: set-ID bits go as after its modification (unless `mode` is set).
    let truncatedBy: Caller?

    /// The times for utimensat/futimens (UTIME_OMIT for the one not changed), or nil.
    private var times: [timespec]? {
        guard atime != nil || mtime != nil else { return nil }
        let omit = timespec(tv_sec: 0, tv_nsec: kbfs_UTIME_OMIT)
        return [atime ?? omit, mtime ?? omit]
    }

    /// Applies the change through a regular file's open (not `O_PATH`) descriptor.
    func apply(open fd: Int32, _ plaintext: PlaintextStat) throws -> stat {
        if let mode {
            try check(fchmod(fd, mode & 0o7777))
        } else if let caller = truncatedBy {
            var st = stat()
            if fstat(fd, &st) == 0, let cleared = caller.modeAfterModification(of: st) {
                try check(fchmod(fd, cleared))
            }
        }
        if uid != nil || gid != nil { try check(fchown(fd, uid ?? uid_t.max, gid ?? gid_t.max)) }
        if var t = times { try check(futimens(fd, &t)) }
        return try plaintext.attributes(fd: fd)
    }

    /// Applies the change through an `O_PATH` descriptor of an object of `type`.
    func apply(path pfd: Int32, type: mode_t, _ plaintext: PlaintextStat) throws -> stat {
        let path = "/proc/self/fd/\(pfd)"
        if let mode {
            if type == S_IFLNK { throw FSError(EOPNOTSUPP) }
            try check(chmod(path, mode & 0o7777))
        } else if let caller = truncatedBy {
            var st = stat()
            if fstat(pfd, &st) == 0, let cleared = caller.modeAfterModification(of: st) {
                try check(chmod(path, cleared))
            }
        }
        if uid != nil || gid != nil {
            try check(
                fchownat(pfd, "", uid ?? uid_t.max, gid ?? gid_t.max, kbfs_AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))
        }
        if var t = times {
            if type == S_IFLNK {
                try check(utimensat(pfd, "", &t, kbfs_AT_EMPTY_PATH))  // the link itself
            } else {
                try check(utimensat(AT_FDCWD, path, &t, 0))
            }
        }
        return try plaintext.attributes(fd: pfd)
    }
}
