import CSystem
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
}
