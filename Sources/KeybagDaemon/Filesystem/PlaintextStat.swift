import Glibc
import KeybagCore

/// Backing attributes as the mount shows them: the size of a regular file is its plaintext
/// size, of a symlink its target's (no decryption; a long target is measured in `targets/`).
struct PlaintextStat: Sendable {
    /// The content's block layout (backing size to plaintext size).
    let layout: BlockLayout
    /// The store's folder of long symlink targets.
    let targetsFD: Int32

    /// Attributes with the plaintext size for regular files and symlinks.
    func attributes(fd: Int32) throws -> stat {
        var st = stat()
        try check(fstat(fd, &st))
        return attributes(of: st, linkAt: fd, "")
    }

    /// Backing attributes with the size turned into the plaintext size: of the contents for
    /// a regular file, of the target for a symlink (`linkAt`/`name` reach the link when its
    /// target is kept in the store's `targets/` folder).
    func attributes(of backing: stat, linkAt dirFD: Int32, _ name: String) -> stat {
        var st = backing
        switch st.st_mode & S_IFMT {
        case S_IFREG: st.st_size = off_t(layout.plainSize(backingSize: Int(st.st_size)))
        case S_IFLNK: st.st_size = off_t(targetLength(storedLength: Int(st.st_size), linkAt: dirFD, name))
        default: break
        }
        return st
    }

    /// A symlink target's plaintext length, from the length of what the link stores (no
    /// decryption); a target kept in `targets/` is measured there.
    private func targetLength(storedLength: Int, linkAt dirFD: Int32, _ name: String) -> Int {
        guard storedLength == NameCipher.longTargetLinkLength else {
            return NameCipher.targetLength(storedLength: storedLength)
        }
        var buf = [UInt8](repeating: 0, count: storedLength + 1)
        let n = readlinkat(dirFD, name, &buf, buf.count)
        let link = n > 0 ? String(decoding: buf[0..<n], as: UTF8.self) : ""
        var t = stat()
        guard let id = StoreNames.longTargetID(link), fstatat(targetsFD, id, &t, AT_SYMLINK_NOFOLLOW) == 0 else {
            return NameCipher.targetLength(storedLength: storedLength)
        }
        return NameCipher.targetLength(storedLength: Int(t.st_size))
    }
}
