import Glibc
import KeybagCore

/// The store's small files (directory metadata, long names' side files, long symlink
/// targets, xattr sets) written so that a reader or a crash sees the old bytes or the new,
/// never part: a temporary under the reserved prefix, then a link or a rename.
enum AtomicStoreFile {
    /// Writes `bytes` to a fresh temporary file in `dirFD` and returns its name; `durable`
    /// syncs it before it is linked or renamed into place.
    private static func writeTemporary(dirFD: Int32, _ bytes: [UInt8], durable: Bool) throws -> String {
        let tmp = BackingKind.temporaryName()
        let fd = try check(openat(dirFD, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o644))
        let ok = Glibc.write(fd, bytes, bytes.count) == bytes.count && (!durable || fdatasync(fd) == 0)
        let e = errno
        close(fd)
        guard ok else { unlinkat(dirFD, tmp, 0); throw FSError(e == 0 ? EIO : e) }
        return tmp
    }

    /// Creates `name` in `dirFD` with `bytes` unless it exists (temp file + link, synced).
    /// Returns whether this call created it.
    @discardableResult
    static func createIfAbsent(dirFD: Int32, _ name: String, _ bytes: [UInt8]) throws -> Bool {
        let tmp = try writeTemporary(dirFD: dirFD, bytes, durable: true)
        defer { unlinkat(dirFD, tmp, 0) }
        if linkat(dirFD, tmp, dirFD, name, 0) == 0 { return true }
        if errno == EEXIST { return false }
        throw FSError(errno)
    }

    /// Removes a folder made under a temporary name (its metadata and temporaries in it first).
    static func removeTemporaryFolder(dirFD: Int32, _ name: String) {
        let d = openat(dirFD, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        if d >= 0 {
            for e in DirectoryEntries.names(of: d) { unlinkat(d, e, 0) }
            close(d)
        }
        unlinkat(dirFD, name, AT_REMOVEDIR)
    }

    /// Replaces `name` in `dirFD` with `bytes` (temp file + rename; `durable`: synced first).
    static func replace(dirFD: Int32, _ name: String, _ bytes: [UInt8], durable: Bool = true) throws {
        let tmp = try writeTemporary(dirFD: dirFD, bytes, durable: durable)
        guard renameat(dirFD, tmp, dirFD, name) == 0 else { let e = errno; unlinkat(dirFD, tmp, 0); throw FSError(e) }
    }
}
