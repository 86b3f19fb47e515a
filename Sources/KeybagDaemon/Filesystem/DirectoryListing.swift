import Foundation
import Glibc
import KeybagCore

/// Directory listings: opendir, the names a directory shows, and fsyncdir.
extension Namespace {
    /// opendir: the names are listed by the first read (see `DirHandle`).
    func opendir(_ id: UInt64) throws -> DirHandle {
        let n = try table.known(id)
        guard n.isDirectory else { throw FSError(ENOTDIR) }
        _ = try directories.meta(of: n)
        return DirHandle()
    }

    /// The entries of directory `n` with plaintext names, `.` and `..` first; entries that do
    /// not decrypt are skipped and logged.
    func listing(_ n: Node) throws -> [DirHandle.Entry] {
        guard n.isDirectory else { throw FSError(ENOTDIR) }
        let iv = try directories.meta(of: n).iv
        let dfd = try check(openat(n.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC))
        defer { close(dfd) }
        // `..` needs an inode number (readdir(3) skips entries with 0): the backing parent's,
        // and the mount root's own at the root, as the root of any filesystem lists it.
        var up = stat()
        let upIno = n.id != 1 && fstatat(dfd, "..", &up, 0) == 0 ? UInt64(up.st_ino) : n.backingIno
        var entries = [
            DirHandle.Entry(name: ".", backing: ".", ino: n.backingIno, type: UInt8(DT_DIR)),
            DirHandle.Entry(name: "..", backing: "..", ino: upIno, type: UInt8(DT_DIR)),
        ]
        var copies: [DirHandle.Entry] = []
        let raw = try DirectoryNames.backingEntries(dirFD: dfd)
        // The folder made on two devices apart: names under its metadata copies' IVs too.
        let metaCopies = directories.metadataCopies(dirFD: dfd, entries: raw.map(\.name))
        n.directory?.metadataCopies.withLock { $0 = metaCopies }
        let ivs = DirectoryIVs(own: iv, copies: metaCopies)
        var underOthers: [(entry: DirHandle.Entry, index: Int)] = []
        for e in raw {
            do {
                guard let (name, index) = try directories.plaintextName(dirFD: dfd, backing: e.name, ivs: ivs) else {
                    continue
                }
                let entry = DirHandle.Entry(name: name, backing: e.name, ino: e.ino, type: e.type)
                if index > 0 {
                    underOthers.append((entry, index))
                } else if ConflictCopy(backing: e.name) != nil {
                    copies.append(entry)
                } else {
                    entries.append(entry)
                }
            } catch {
                // A sync engine's transfer in progress or folder file (.stfolder) is no damage.
                if case .syncEngine = BackingKind.of(e.name) { continue }
                log("skipping a store entry that does not decrypt (\(e.name.prefix(24))…): \(error)")
            }
        }
        // A conflict copy whose readable name an entry really has stays hidden behind it.
        if !copies.isEmpty {
            let taken = Set(entries.map(\.name))
            entries += copies.filter { !taken.contains($0.name) }
        }
        // Entries under a copy's IV come after, each copy's in turn; one whose name is taken
        // shows under the copy's conflict name.
        if !underOthers.isEmpty {
            var taken = Set(entries.map(\.name))
            for (e, index) in underOthers.sorted(by: { ($0.index, $0.entry.backing) < ($1.index, $1.entry.backing) }) {
                let shown = ivs.shownName(plain: e.name, index: index, taken: taken)
                guard shown.utf8.count <= NameCipher.backingNameMax, taken.insert(shown).inserted else { continue }
                entries.append(DirHandle.Entry(name: shown, backing: e.backing, ino: e.ino, type: e.type))
            }
        }
        return entries
    }

    /// fsync of a directory: its backing folder (the entries of the names in it, long names'
    /// side files, its metadata), then its xattr set when that changed.
    func fsyncdir(_ id: UInt64) throws {
        let n = try table.known(id)
        guard n.isDirectory else { throw FSError(ENOTDIR) }
        let fd = try check(openat(n.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC))
        defer { close(fd) }
        try check(Glibc.fsync(fd))
        if attributes.xattrs.changedSinceSync, let meta = try? directories.meta(of: n) {
            try attributes.xattrs.makeDurable(Base64URL.encode(meta.iv))
        }
    }
}
