import CSystem
import Glibc
import KeybagCore

/// Lookups: a backing entry becomes a node the kernel knows (one lookup counted), with its
/// plaintext attributes; an empty file left without a header by a crash gets one here.
struct EntryLookup: Sendable {
    /// The nodes, the backing names of plaintext names, and attributes as the mount shows them.
    let table: NodeTable, directories: DirectoryNames, plaintext: PlaintextStat
    /// The wrapping keys and cipher of the header an empty file gets.
    let keyring: ClassKeyring, cipher: ContentCipher

    /// Where notes go.
    private var log: EventLog { directories.log }

    /// Looks up `name` in `parent`: counts one kernel lookup.
    func lookup(parent: UInt64, name: String) throws -> (Node, stat) {
        let p = try table.known(parent)
        if name.utf8.count > 255 { throw FSError(ENAMETOOLONG) }
        return try lookupBacking(p, try directories.backingName(p, name).name)
    }

    /// Looks up a backing entry of directory `p`: counts one kernel lookup.
    func lookupBacking(_ p: Node, _ backing: String) throws -> (Node, stat) {
        if table.handlesWork {
            // Non-directories: stat and file handle by name, no descriptor (2 syscalls).
            var st = stat()
            try check(fstatat(p.fd, backing, &st, AT_SYMLINK_NOFOLLOW))
            if (st.st_mode & S_IFMT) != S_IFDIR {
                var buf = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
                let len = kbfs_handle_at(p.fd, backing, &buf, Int32(buf.count))
                if len > 0 {
                    return remembered(
                        table.remember(handle: Array(buf[0..<Int(len)]), stat: st), st, parent: p, backing)
                }
            }
        }
        let fd = try check(openat(p.fd, backing, kbfs_O_PATH | O_NOFOLLOW | O_CLOEXEC))
        var st = stat()
        guard fstat(fd, &st) == 0 else { let e = errno; close(fd); throw FSError(e) }
        return remembered(table.remember(fd: fd, stat: st), st, parent: p, backing)
    }

    /// A looked-up node with its attributes; a headerless empty file gets its header first.
    private func remembered(_ n: Node, _ st: stat, parent p: Node, _ backing: String) -> (Node, stat) {
        if (st.st_mode & S_IFMT) == S_IFREG && st.st_size == 0 { giveHeaderToEmptyFile(n, parent: p) }
        return (n, plaintext.attributes(of: st, linkAt: p.fd, backing))
    }

    /// A regular backing file of 0 bytes has no header: left by a crash of a version that
    /// created the name before writing the header. It becomes an empty file of the
    /// directory's class (a fresh file key; there is no data to lose). Needs that class's
    /// wrapping key now; otherwise the file stays as it is (EIO) until it can.
    func giveHeaderToEmptyFile(_ n: Node, parent p: Node) {
        guard let file = n.file, let cls = try? directories.inheritedClass(p),
            let (wrapKey, _, keySet) = keyring.wrappingKey(for: cls)
        else { return }
        file.io.write { st in
            guard st.header == nil else { return }
            let fd = n.open(O_RDWR)
            guard fd >= 0 else { return }
            defer { close(fd) }
            var s = stat()
            guard fstat(fd, &s) == 0, s.st_size == 0 else { return }
            let raw = SecureKey(random: 32)
            defer { raw.wipe() }
            do {
                try HeaderSlots.writeNew(
                    fd: fd,
                    try FileHeader.create(fileKey: raw, class: cls, cipher: cipher, using: wrapKey, keySet: keySet))
                log(
                    "inode \(n.backingIno) had no header (0 bytes, left by a crash): now an empty \(cls.name) file")
            } catch {
                log("could not give the empty inode \(n.backingIno) a header: \(error)")
            }
        }
    }
}
