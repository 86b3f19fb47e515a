import CSystem
import Foundation
import Glibc

/// Opens the store's small files (directory metadata and its copies, long names' side files,
/// xattr sets) for reading. Anyone who can write the store could put a FIFO or a device node
/// under such a name: opening that would block the caller forever or run a driver's open. So
/// the name is opened as a path only, must be a regular file, and only then is read through
/// its descriptor (the object checked is the object read).
public enum StoreFileOpen {
    /// A read-only descriptor of the regular file `name` in `dirFD`; -1 with errno ENOENT when
    /// it is absent, EIO when it is no regular file, or the open's own error.
    public static func regular(_ dirFD: Int32, _ name: String) -> Int32 {
        let path = openat(dirFD, name, kbfs_O_PATH | O_NOFOLLOW | O_CLOEXEC)
        guard path >= 0 else { return -1 }
        defer { close(path) }
        var st = stat()
        guard fstat(path, &st) == 0 else { return -1 }
        guard st.st_mode & S_IFMT == S_IFREG else {
            errno = EIO
            return -1
        }
        return open("/proc/self/fd/\(path)", O_RDONLY | O_CLOEXEC | O_NOCTTY)
    }

    /// The most bytes a small store file may hold (keybags, device records, pairing files, long
    /// symlink targets, the state folder's records): the largest written is a few KiB.
    public static let smallFileLimit = 1 << 20

    /// The contents of the regular file at `path`, read without following a symlink in its
    /// last component or blocking on a FIFO; nil when it is absent. A file that is no regular
    /// file or holds more than `limit` bytes is refused before anything is allocated for it.
    public static func contents(_ path: String, limit: Int = smallFileLimit) throws -> Data? {
        let fd = regular(AT_FDCWD, path)
        guard fd >= 0 else {
            if errno == ENOENT { return nil }
            if errno == EIO { throw KeybagError.corrupt("\(path) is not a regular file") }
            throw KeybagError.system("open \(path)", errno)
        }
        defer { close(fd) }
        var st = stat()
        guard fstat(fd, &st) == 0 else { throw KeybagError.system("fstat \(path)", errno) }
        guard st.st_size <= limit else {
            throw KeybagError.corrupt("\(path) holds \(st.st_size) bytes, more than the \(limit) such a file may")
        }
        var out = Data(count: Int(st.st_size))
        let got = try out.withUnsafeMutableBytes { try FullIO.preadFull(fd, $0, offset: 0) }
        return out.prefix(got)
    }
}
