import CSystem
import Foundation
import Glibc
import KeybagCore

/// Entries removed and moved: unlink, rmdir (a folder of only store files is empty), rename.
extension Namespace {
    /// unlink (a long symlink target goes with its last link).
    func unlink(parent: UInt64, name: String) throws {
        let p = try table.known(parent)
        let e = try directories.backingName(p, name)
        var st = stat()
        var longTarget: String?
        let statted = fstatat(p.fd, e.name, &st, AT_SYMLINK_NOFOLLOW) == 0
        let xattrID = statted ? attributes.xattrIDOfLastLink(dirFD: p.fd, name: e.name, st: st) : nil
        if statted, (st.st_mode & S_IFMT) == S_IFLNK, st.st_nlink == 1 {
            var buf = [UInt8](repeating: 0, count: 256)
            let len = readlinkat(p.fd, e.name, &buf, buf.count)
            if len > 0 {
                longTarget = StoreNames.longTargetID(String(decoding: buf[0..<len], as: UTF8.self))
            }
        }
        try check(unlinkat(p.fd, e.name, 0))
        if statted, (st.st_mode & S_IFMT) == S_IFREG, st.st_nlink == 1 {
            journaling?.nameRemoved(ino: UInt64(st.st_ino), table: table, dev: UInt64(st.st_dev))
        }
        directories.removeSideFile(p, e)
        if let longTarget { unlinkat(targetsFD, longTarget, 0) }
        if let xattrID { attributes.dropXattrs(xattrID) }
    }

    /// Whether a backing directory's entries are only the store's own files: metadata (and a
    /// sync engine's copies of it), temporaries, and long-name side files whose entry is gone
    /// (left by a crash or an offline edit). Such a directory is empty to its users.
    static func holdsOnlyStoreFiles(_ names: [String]) -> Bool {
        let present = Set(names)
        return names.allSatisfy { n in
            switch BackingKind.of(n) {
            case .directoryMeta, .storeFile: return true
            case .sideFile(let entry): return !present.contains(entry)
            case .name, .longName, .syncEngine, .foreign: return MetadataCopy(backing: n) != nil
            }
        }
    }

    /// rmdir: a directory holding only the store's own files counts as empty.
    func rmdir(parent: UInt64, name: String) throws {
        let p = try table.known(parent)
        let e = try directories.backingName(p, name)
        if unlinkat(p.fd, e.name, AT_REMOVEDIR) == 0 { directories.removeSideFile(p, e); return }
        let err = errno
        guard err == ENOTEMPTY || err == EEXIST else { throw FSError(err) }
        let failed = try replacingDirectoryOfStoreFiles(parentFD: p.fd, name: e.name) {
            unlinkat(p.fd, e.name, AT_REMOVEDIR)
        }
        if failed != 0 { throw FSError(failed) }
        directories.removeSideFile(p, e)
    }

    /// rename (flags: RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT): the name is
    /// re-encrypted for the target directory; the target's side file is written first, the
    /// source's removed last unless an entry stays under the source name (the other file of
    /// an exchange, or the whiteout the backing filesystem leaves there). A replaced file's
    /// xattr set goes with it, whatever the flags.
    func rename(parent: UInt64, name: String, newParent: UInt64, newName: String, flags: UInt32) throws {
        let p = try table.known(parent), np = try table.known(newParent)
        let src = try directories.backingName(p, name)
        let dst = try directories.backingName(np, newName)
        let exchange = flags & kbfs_RENAME_EXCHANGE != 0, noReplace = flags & kbfs_RENAME_NOREPLACE != 0
        let created = try directories.ensureSideFile(np, dst)
        let replacedXattrs = exchange || noReplace ? nil : xattrIDOfReplaced(p, src.name, np, dst.name)
        var replaced = stat()
        let replacing = !exchange && !noReplace && fstatat(np.fd, dst.name, &replaced, AT_SYMLINK_NOFOLLOW) == 0
        var rc = kbfs_renameat2(p.fd, src.name, np.fd, dst.name, flags)
        if rc != 0 && (errno == ENOTEMPTY || errno == EEXIST) && !exchange && !noReplace {
            // The target is a directory; one holding only the store's own files is empty.
            rc = renameOverEmptyDirectory(p, src.name, np, dst.name, flags: flags)
        }
        if rc != 0 {
            let e = errno
            if created { directories.removeSideFile(np, dst) }
            throw FSError(e)
        }
        if let replacedXattrs { attributes.dropXattrs(replacedXattrs) }
        if replacing, (replaced.st_mode & S_IFMT) == S_IFREG, replaced.st_nlink == 1 {
            journaling?.nameRemoved(ino: UInt64(replaced.st_ino), table: table, dev: UInt64(replaced.st_dev))
        }
        var moved = stat()
        if let journaling, fstatat(np.fd, dst.name, &moved, AT_SYMLINK_NOFOLLOW) == 0,
            (moved.st_mode & S_IFMT) == S_IFREG,
            let f = table.node(dev: UInt64(moved.st_dev), ino: UInt64(moved.st_ino))?.file
        {
            journaling.renamed(f)
        }
        classes.changed()  // a moved directory may inherit differently
        let same = p.id == np.id && src.name == dst.name
        if !exchange && flags & kbfs_RENAME_WHITEOUT == 0 && !same { directories.removeSideFile(p, src) }
    }

    /// The xattr id of a regular file that renaming `from` over `to` would delete (nil when
    /// the target is absent, another link of the source, or keeps other links).
    private func xattrIDOfReplaced(_ p: Node, _ from: String, _ np: Node, _ to: String) -> String? {
        guard attributes.hasStoredXattrs else { return nil }
        var a = stat(), b = stat()
        guard fstatat(np.fd, to, &b, AT_SYMLINK_NOFOLLOW) == 0, fstatat(p.fd, from, &a, AT_SYMLINK_NOFOLLOW) == 0,
            a.st_ino != b.st_ino || a.st_dev != b.st_dev
        else { return nil }
        return attributes.xattrIDOfLastLink(dirFD: np.fd, name: to, st: b)
    }

    /// Retries a rename whose target directory holds only the store's own files, after
    /// removing them (restored if the rename still fails). Returns the rename's result.
    private func renameOverEmptyDirectory(
        _ p: Node, _ from: String, _ np: Node, _ to: String, flags: UInt32
    ) -> Int32 {
        let failed: Int32
        do {
            failed = try replacingDirectoryOfStoreFiles(parentFD: np.fd, name: to) {
                kbfs_renameat2(p.fd, from, np.fd, to, flags)
            }
        } catch {
            failed = ENOTEMPTY
        }
        errno = failed
        return failed == 0 ? 0 : -1
    }

    /// Runs `replace` (which removes, or renames over, the directory `name` of `parentFD`)
    /// once that directory, holding only the store's own files (it counts as empty), is
    /// cleared of them; its metadata is put back when `replace` fails, and its xattr set
    /// dropped when it succeeds. Throws the error of opening it, and ENOTEMPTY when it holds
    /// anything else. Returns 0, or the errno `replace` failed with.
    private func replacingDirectoryOfStoreFiles(parentFD: Int32, name: String, _ replace: () -> Int32) throws -> Int32 {
        let dfd = try check(openat(parentFD, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC))
        defer { close(dfd) }
        let entries = try DirectoryNames.backingEntries(dirFD: dfd)
        guard Self.holdsOnlyStoreFiles(entries.map(\.name)) else { throw FSError(ENOTEMPTY) }
        let saved = try? directories.readMeta(dirFD: dfd)
        for r in entries { unlinkat(dfd, r.name, 0) }
        guard replace() == 0 else {
            let e = errno
            if let saved {
                _ = try? AtomicStoreFile.createIfAbsent(dirFD: dfd, DirectoryMeta.fileName, try saved.encode(names))
            }
            return e
        }
        attributes.dropXattrs(ofDirectory: saved)
        return 0
    }
}
