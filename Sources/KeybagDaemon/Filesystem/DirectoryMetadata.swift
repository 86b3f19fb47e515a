import CSystem
import Foundation
import Glibc
import KeybagCore

/// Directory metadata (`.kbfs-dir`: name IV, default class), its copies, and the class a
/// directory passes on to new files.
extension DirectoryNames {
    /// Reads a directory's `.kbfs-dir`; nil when absent.
    func readMeta(dirFD: Int32) throws -> DirectoryMeta? {
        let fd = StoreFileOpen.regular(dirFD, DirectoryMeta.fileName)
        if fd < 0 { if errno == ENOENT { return nil }; throw FSError(errno) }
        defer { close(fd) }
        var buf = [UInt8](repeating: 0, count: 512)
        let n = Glibc.read(fd, &buf, buf.count)
        guard n > 0 else { throw FSError(EIO) }
        return try DirectoryMeta.decode(Array(buf[0..<n]), names)
    }

    /// Gives the root of a new store its metadata and returns what is there now. Its IV is
    /// derived from the volume key (`NameCipher.rootIV`): two devices that mount a store
    /// before the first one's root metadata reached the other write the same bytes, so a sync
    /// engine has no two versions of it.
    func ensureMeta(dirFD: Int32) throws -> DirectoryMeta {
        if let m = try readMeta(dirFD: dirFD) { return m }
        let root = DirectoryMeta(iv: try names.rootIV(), defaultClass: nil)
        try AtomicStoreFile.createIfAbsent(dirFD: dirFD, DirectoryMeta.fileName, try root.encode(names))
        guard let m = try readMeta(dirFD: dirFD) else { throw FSError(EIO) }
        return m
    }

    /// A directory node's metadata, read once and cached. Only the root gets one made here (a
    /// new store); another directory without it is one a sync engine is still bringing in
    /// (folder first, then its files): EIO until it arrives, as an IV made now would hide
    /// every name that comes with it.
    func meta(of dir: Node) throws -> DirectoryMeta {
        guard let state = dir.directory else { throw FSError(ENOTDIR) }
        if let m = state.meta.withLock({ $0 }) { return m }
        guard let m = try dir.id == 1 ? ensureMeta(dirFD: dir.fd) : readMeta(dirFD: dir.fd) else {
            throw FSError(EIO)
        }
        state.meta.withLock { $0 = m }
        return m
    }

    /// The metadata copies (`MetadataCopy`) among the backing `entries` of `dirFD` (listed
    /// when nil) and the IVs they hold; a copy that does not parse is skipped and logged.
    func metadataCopies(dirFD: Int32, entries: [String]? = nil) -> [DirectoryIVs.Other] {
        var listed = entries ?? []
        if entries == nil {
            let dfd = openat(dirFD, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
            guard dfd >= 0 else { return [] }
            defer { close(dfd) }
            listed = ((try? Self.backingEntries(dirFD: dfd)) ?? []).map(\.name)
        }
        let read = DirectoryIVs.readCopies(dirFD: dirFD, among: listed, cipher: names)
        if read.leftOut {
            log(
                "a folder holds more than \(DirectoryIVs.maxCopies) copies of its metadata: the names under the "
                    + "others' IVs do not show")
        }
        for name in read.unreadable {
            log("skipping a copy of directory metadata that does not read (\(name))")
        }
        return read.copies
    }

    /// The metadata copies of a directory node, read once and cached.
    func metadataCopies(of dir: Node) -> [DirectoryIVs.Other] {
        if let c = dir.directory?.metadataCopies.withLock({ $0 }) { return c }
        let c = metadataCopies(dirFD: dir.fd)
        dir.directory?.metadataCopies.withLock { $0 = c }
        return c
    }

    /// Every name IV of a directory node: its own, then its metadata copies'.
    func nameIVs(of dir: Node) throws -> DirectoryIVs {
        DirectoryIVs(own: try meta(of: dir).iv, copies: metadataCopies(of: dir))
    }

    /// Stores (or with nil clears) a directory's default class.
    func setDirectoryClass(_ dir: Node, _ cls: ProtectionClass?) throws {
        var m = try meta(of: dir)
        m.defaultClass = cls
        try AtomicStoreFile.replace(dirFD: dir.fd, DirectoryMeta.fileName, try m.encode(names))
        dir.directory?.meta.withLock { $0 = m }
        classes.changed()
    }

    /// The default class for new children of `dir`: its own setting, else the nearest
    /// ancestor's, else the mount's default. Cached per directory until the next class
    /// change or rename anywhere.
    func inheritedClass(_ dir: Node) throws -> ProtectionClass {
        let gen = classes.current
        if let c = dir.directory?.inherited.withLock({ $0 }), c.generation == gen { return c.cls }
        var result = classes.mountDefault
        if let own = try meta(of: dir).defaultClass {
            result = own
        } else if dir.id != 1 {
            var cur = openat(dir.fd, "..", kbfs_O_PATH | O_DIRECTORY | O_CLOEXEC)
            defer { if cur >= 0 { close(cur) } }
            for _ in 0..<4096 where cur >= 0 {
                if let c = try readMeta(dirFD: cur)?.defaultClass { result = c; break }
                var st = stat()
                guard fstat(cur, &st) == 0 else { break }
                if UInt64(st.st_dev) == table.root.backingDev && UInt64(st.st_ino) == table.root.backingIno { break }
                let up = openat(cur, "..", kbfs_O_PATH | O_DIRECTORY | O_CLOEXEC)
                close(cur)
                cur = up
            }
        }
        dir.directory?.inherited.withLock { $0 = (gen, result) }
        return result
    }

    /// The last `count` plaintext names of directory `dir`'s path (nearest last), found by
    /// walking up the store and decrypting each name in its parent; `fromRoot` when the
    /// walk reached the mount root (the names are then the whole path).
    func pathTail(of dir: Node, upTo count: Int) throws -> (names: [String], fromRoot: Bool) {
        var names: [String] = []
        var cur = try check(openat(dir.fd, ".", kbfs_O_PATH | O_DIRECTORY | O_CLOEXEC))
        defer { close(cur) }
        while true {
            var st = stat()
            try check(fstat(cur, &st))
            if UInt64(st.st_dev) == table.root.backingDev && UInt64(st.st_ino) == table.root.backingIno {
                return (names, true)
            }
            if names.count >= count { return (names, false) }
            let up = try check(openat(cur, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC))
            close(cur)
            cur = up
            guard let iv = try readMeta(dirFD: up)?.iv,
                let entry = try childEntry(of: up, dev: st.st_dev, ino: st.st_ino),
                let found = try plaintextName(
                    dirFD: up, backing: entry, ivs: DirectoryIVs(own: iv, copies: metadataCopies(dirFD: up)))
            else { throw FSError(EIO) }
            names.insert(found.name, at: 0)
        }
    }

    /// The backing name of the subdirectory of `dirFD` that is (`dev`, `ino`): by the
    /// entry's inode number first (confirmed by a stat), else by a stat of every
    /// subdirectory (overlayfs and others report other inode numbers in readdir).
    private func childEntry(of dirFD: Int32, dev: dev_t, ino: ino_t) throws -> String? {
        let entries = try Self.backingEntries(dirFD: dirFD).filter {
            BackingKind.of($0.name).carriesName
        }
        func isIt(_ name: String) -> Bool {
            var s = stat()
            return fstatat(dirFD, name, &s, AT_SYMLINK_NOFOLLOW) == 0 && s.st_dev == dev && s.st_ino == ino
        }
        if let e = entries.first(where: { $0.ino == UInt64(ino) }), isIt(e.name) { return e.name }
        return entries.first { ($0.type == UInt8(DT_DIR) || $0.type == UInt8(DT_UNKNOWN)) && isIt($0.name) }?.name
    }
}
