import Dispatch
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization

/// Who asks: the caller identity of a request, and the set-ID rules of its modifications (one
/// mechanism for every request that changes a file: write, truncate, O_TRUNC, fallocate, ACL changes).
struct Caller {
    let uid: uid_t
    let gid: gid_t
    /// The calling process (0 when unknown).
    var pid: pid_t = 0
    /// The caller's umask, for creations (0 when the kernel applied it already).
    var umask: mode_t = 0
    /// The kernel's word on this request (FUSE_HANDLE_KILLPRIV_V2: write, truncate, open
    /// with O_TRUNC, create): true when the set-ID bits must go, false when they stay; nil
    /// when the request carries none (fallocate, setxattr) and /proc must tell.
    var kernelSaysClearSetID: Bool? = nil

    /// Whether the caller keeps set-ID bits through a modification: the kernel's word
    /// where the request has one, else whether it holds CAP_FSETID, read from /proc (only
    /// when a file has such bits). Capabilities held in a user namespace other than the
    /// daemon's (`unshare -r`) count in that namespace only: there the caller is treated
    /// as having none (stricter than the kernel, which also allows them for files whose
    /// owner and group the namespace maps).
    var mayKeepSetID: Bool {
        if let kernelSaysClearSetID { return !kernelSaysClearSetID }
        guard pid > 0 else { return uid == 0 }
        guard sharesDaemonUserNamespace,
            let caps = statusField("CapEff:").flatMap({ UInt64($0, radix: 16) })
        else { return false }
        return caps & (1 << 4) != 0  // CAP_FSETID
    }

    /// Whether the calling process is in the daemon's user namespace (false if unknown).
    private var sharesDaemonUserNamespace: Bool {
        var theirs = stat(), ours = stat()
        guard fstatat(AT_FDCWD, "/proc/\(pid)/ns/user", &theirs, 0) == 0,
            fstatat(AT_FDCWD, "/proc/self/ns/user", &ours, 0) == 0
        else { return false }
        return theirs.st_ino == ours.st_ino && theirs.st_dev == ours.st_dev
    }

    /// Whether the caller is in group `g`: its own, or a supplementary one (from /proc).
    func isInGroup(_ g: gid_t) -> Bool {
        if gid == g { return true }
        return statusField("Groups:")?.split(separator: " ").contains { gid_t($0) == g } ?? false
    }

    /// A field of the calling process's /proc status, trimmed; nil when unknown.
    private func statusField(_ key: String) -> String? {
        guard pid > 0, let status = ProcFile.read("/proc/\(pid)/status"),
            let line = status.split(separator: "\n").first(where: { $0.hasPrefix(key) })
        else { return nil }
        return line.dropFirst(key.count).trimmingCharacters(in: .whitespaces).replacingOccurrences(
            of: "\t", with: " ")
    }
}

/// The set-ID rules of a modification by this caller.
extension Caller {
    /// The mode a regular file keeps after a modification (write, truncate, fallocate) by
    /// this caller, as the kernel rules it: nothing changes for a caller with CAP_FSETID, else
    /// `modeWithoutSetID`. nil when nothing changes.
    func modeAfterModification(of st: stat) -> mode_t? {
        guard st.st_mode & (S_ISUID | S_ISGID) != 0, !mayKeepSetID else { return nil }
        return modeWithoutSetID(of: st)
    }

    /// The mode after a modification by this caller, who lacks CAP_FSETID: set-user-ID goes;
    /// set-group-ID goes when group-executable, or when the caller is not in the file's
    /// group (without group execute it marks mandatory locking, which the group may keep).
    /// nil when nothing changes.
    func modeWithoutSetID(of st: stat) -> mode_t? {
        let mode = st.st_mode
        var kill: mode_t = mode & S_ISUID
        if mode & S_ISGID != 0 && (mode & S_IXGRP != 0 || !isInGroup(st.st_gid)) { kill |= S_ISGID }
        return kill == 0 ? nil : mode & 0o7777 & ~kill
    }

    /// The group a new object of this caller gets in a directory: unchanged (the directory's,
    /// set by the backing filesystem) in a setgid directory, else the caller's.
    func group(in dirFD: Int32) -> gid_t {
        var st = stat()
        if fstat(dirFD, &st) == 0 && st.st_mode & S_ISGID != 0 { return gid_t.max }
        return gid
    }
}
