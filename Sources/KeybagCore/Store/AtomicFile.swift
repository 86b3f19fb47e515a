import Foundation
import Glibc

/// A small file of the store or of the device's state replaced whole: a new temporary of its
/// own, written and synced, renamed over the old, the folder synced.
enum AtomicFile {
    /// Writes `data` to `path` atomically: temp file, fsync, rename, fsync of the folder.
    static func write(_ data: Data, to path: String) throws {
        // The temporary is always a new file of our own: a stale one (or a symlink planted in
        // its place) is removed first, and O_EXCL|O_NOFOLLOW never writes through a link
        // that appears in between (the daemon runs as root).
        let tmp = path + ".tmp"
        if unlink(tmp) != 0 && errno != ENOENT { throw KeybagError.system("cannot remove the stale \(tmp)", errno) }
        let fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw KeybagError.system("cannot write \(tmp)", errno) }
        let ok = data.withUnsafeBytes { b -> Bool in
            var off = 0
            while off < b.count {
                let n = Glibc.write(fd, b.baseAddress! + off, b.count - off)
                if n <= 0 { return false }
                off += n
            }
            return fsync(fd) == 0
        }
        let err = errno
        close(fd)
        guard ok else { unlink(tmp); throw KeybagError.system("cannot write \(tmp)", err) }
        guard rename(tmp, path) == 0 else { throw KeybagError.system("cannot replace \(path)", errno) }
        DeviceKeyFile.syncFolder(of: path)
    }
}
