import CSodium
import CSystem
import Foundation
import Glibc
import KeybagCore

/// Names and directories: encrypted entry names (with hashed long names and their side
/// files), directory metadata (name IV, default class), inheritance of classes, and the
/// namespace operations built on them.
extension Filesystem {
    /// A plaintext name's backing entry in one directory.
    struct BackingEntry {
        /// The directory entry in the store.
        let name: String
        /// For a long name: the side file holding `encrypted`.
        let sideFile: String?
        /// The full encrypted name.
        let encrypted: String
    }

    // MARK: directory metadata

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

    /// Writes `bytes` to a fresh temporary file in `dirFD` and returns its name; `durable`
    /// syncs it before it is linked or renamed into place.
    private func writeTemporary(dirFD: Int32, _ bytes: [UInt8], durable: Bool = true) throws -> String {
        let tmp = Self.reservedPrefix + "tmp-" + Base64URL.encode(Sodium.randomArray(9))
        let fd = try check(openat(dirFD, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o644))
        let ok = Glibc.write(fd, bytes, bytes.count) == bytes.count && (!durable || fdatasync(fd) == 0)
        let e = errno
        close(fd)
        guard ok else { unlinkat(dirFD, tmp, 0); throw FSError(e == 0 ? EIO : e) }
        return tmp
    }

    /// Creates `name` in `dirFD` with `bytes` unless it exists (atomic: temp file + link).
    /// Returns whether this call created it.
    @discardableResult
    func createFileIfAbsent(dirFD: Int32, _ name: String, _ bytes: [UInt8]) throws -> Bool {
        let tmp = try writeTemporary(dirFD: dirFD, bytes)
        defer { unlinkat(dirFD, tmp, 0) }
        if linkat(dirFD, tmp, dirFD, name, 0) == 0 { return true }
        if errno == EEXIST { return false }
        throw FSError(errno)
    }

    /// Replaces `name` in `dirFD` with `bytes` atomically (temp file + rename).
    func replaceFile(dirFD: Int32, _ name: String, _ bytes: [UInt8], durable: Bool = true) throws {
        let tmp = try writeTemporary(dirFD: dirFD, bytes, durable: durable)
        guard renameat(dirFD, tmp, dirFD, name) == 0 else { let e = errno; unlinkat(dirFD, tmp, 0); throw FSError(e) }
    }

    /// Gives the root of a new store its metadata and returns what is there now. Its IV is
    /// derived from the volume key (`NameCipher.rootIV`): two devices that mount a store
    /// before the first one's root metadata reached the other write the same bytes, so a sync
    /// engine has no two versions of it.
    func ensureMeta(dirFD: Int32) throws -> DirectoryMeta {
        if let m = try readMeta(dirFD: dirFD) { return m }
        let root = DirectoryMeta(iv: try names.rootIV(), defaultClass: nil)
        try createFileIfAbsent(dirFD: dirFD, DirectoryMeta.fileName, try root.encode(names))
        guard let m = try readMeta(dirFD: dirFD) else { throw FSError(EIO) }
        return m
    }

    /// A directory node's metadata, read once and cached. Only the root gets one made here (a
    /// new store); another directory without it is one a sync engine is still bringing in
    /// (folder first, then its files): EIO until it arrives, as an IV made now would hide
    /// every name that comes with it.
    func meta(of dir: Node) throws -> DirectoryMeta {
        guard dir.isDirectory else { throw FSError(ENOTDIR) }
        if let m = dir.dirMeta.withLock({ $0 }) { return m }
        guard let m = try dir.id == 1 ? ensureMeta(dirFD: dir.fd) : readMeta(dirFD: dir.fd) else {
            throw FSError(EIO)
        }
        dir.dirMeta.withLock { $0 = m }
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
            listed = ((try? backingEntries(dirFD: dfd)) ?? []).map(\.name)
        }
        let read = DirectoryIVs.readCopies(dirFD: dirFD, among: listed, cipher: names)
        if read.leftOut {
            MountDaemon.log(
                "a folder holds more than \(DirectoryIVs.maxCopies) copies of its metadata: the names under the " +
                    "others' IVs do not show")
        }
        for name in read.unreadable {
            MountDaemon.log("skipping a copy of directory metadata that does not read (\(name))")
        }
        return read.copies
    }

    /// The metadata copies of a directory node, read once and cached.
    func metadataCopies(of dir: Node) -> [DirectoryIVs.Other] {
        if let c = dir.metadataCopies.withLock({ $0 }) { return c }
        let c = metadataCopies(dirFD: dir.fd)
        dir.metadataCopies.withLock { $0 = c }
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
        try replaceFile(dirFD: dir.fd, DirectoryMeta.fileName, try m.encode(names))
        dir.dirMeta.withLock { $0 = m }
        classGeneration.add(1, ordering: .relaxed)
    }

    /// The default class for new children of `dir`: its own setting, else the nearest
    /// ancestor's, else the mount's default. Cached per directory until the next class
    /// change or rename anywhere.
    func inheritedClass(_ dir: Node) throws -> ProtectionClass {
        let gen = classGeneration.load(ordering: .relaxed)
        if let c = dir.inherited.withLock({ $0 }), c.generation == gen { return c.cls }
        var result = defaultClass
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
        dir.inherited.withLock { $0 = (gen, result) }
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
        let entries = try backingEntries(dirFD: dirFD).filter {
            !Self.isReserved($0.name) && !NameCipher.isSideFile($0.name)
        }
        func isIt(_ name: String) -> Bool {
            var s = stat()
            return fstatat(dirFD, name, &s, AT_SYMLINK_NOFOLLOW) == 0 && s.st_dev == dev && s.st_ino == ino
        }
        if let e = entries.first(where: { $0.ino == UInt64(ino) }), isIt(e.name) { return e.name }
        return entries.first { ($0.type == UInt8(DT_DIR) || $0.type == UInt8(DT_UNKNOWN)) && isIt($0.name) }?.name
    }

    // MARK: names

    /// The backing entry of a plaintext name in directory `dir`: a sync engine's conflict
    /// copy where `name` is the readable name of one that exists, else the name's own.
    ///
    /// In a directory with metadata copies (`DirectoryIVs`), a name that has no entry under the
    /// directory's own IV is the first entry that exists under a copy's IV; new names are made
    /// under the own IV.
    func backingName(_ dir: Node, _ name: String) throws -> BackingEntry {
        try Self.checkName(name)
        let iv = try meta(of: dir).iv
        let copies = metadataCopies(of: dir)
        if let copy = try conflictCopy(dir, readable: name, iv: iv, copies: copies) { return copy }
        let own = try entry(name, iv: iv)
        guard !copies.isEmpty, !exists(dir, own.name) else { return own }
        for other in DirectoryIVs(own: iv, copies: copies).others {
            let e = try entry(name, iv: other.iv)
            if exists(dir, e.name) { return e }
        }
        return own
    }

    /// The backing entry of the plaintext `name` under the name IV `iv`.
    private func entry(_ name: String, iv: [UInt8]) throws -> BackingEntry {
        let enc = try names.encrypt(Array(name.utf8), dirIV: iv)
        let (b, side) = NameCipher.backingEntry(for: enc)
        return BackingEntry(name: b, sideFile: side, encrypted: enc)
    }

    /// Whether the backing entry `name` exists in `dir`.
    private func exists(_ dir: Node, _ name: String) -> Bool {
        faccessat(dir.fd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0
    }

    /// The backing entry of the conflict copy the mount shows as `name`, if it is in `dir`
    /// and no entry really has that name (which then wins, as in `listing`). Only the exact
    /// readable name finds it. A copy of a hashed long name shares the original's side file:
    /// the entry names none, so removing the copy keeps it. The copy is either a sync engine's
    /// copy of a file, or an entry under a metadata copy's IV whose plaintext name an entry
    /// before it shows (`DirectoryIVs.shownName`).
    private func conflictCopy(
        _ dir: Node, readable name: String, iv: [UInt8], copies: [DirectoryIVs.Other]
    ) throws -> BackingEntry? {
        guard let c = ConflictCopy.parse(readable: name),
              !exists(dir, NameCipher.backingEntry(for: try names.encrypt(Array(name.utf8), dirIV: iv)).name)
        else { return nil }
        let ivs = DirectoryIVs(own: iv, copies: copies)
        // A sync engine's copy of a file, made under any of the directory's IVs.
        for candidateIV in ivs.all {
            let enc = try names.encrypt(Array(c.plain.utf8), dirIV: candidateIV)
            let copy = ConflictCopy(
                original: NameCipher.backingEntry(for: enc).name, date: c.date, time: c.time, device: c.device)
            if copy.readableName(of: c.plain).utf8.elementsEqual(name.utf8), exists(dir, copy.backing) {
                return BackingEntry(name: copy.backing, sideFile: nil, encrypted: enc)
            }
        }
        guard let (index, other) = ivs.other(date: c.date, time: c.time, device: c.device),
              other.copy.readableName(of: c.plain).utf8.elementsEqual(name.utf8) else { return nil }
        let candidate = try entry(c.plain, iv: other.iv)
        // Shown so only while an entry under an IV before it holds the plaintext name.
        guard exists(dir, candidate.name),
              try ivs.all[0..<index].contains(where: { exists(dir, try entry(c.plain, iv: $0).name) })
        else { return nil }
        return candidate
    }

    /// Whether the entry `name` of `dirFD` may share its file id, and so its xattr set, with
    /// another entry: it is a sync engine's conflict copy, or a copy of it is there. Removing
    /// it then keeps the set (fsck reports the set as an orphan once no entry uses it).
    func mayShareXattrSet(dirFD: Int32, name: String) -> Bool {
        if ConflictCopy(backing: name) != nil { return true }
        let dfd = openat(dirFD, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard dfd >= 0 else { return true }
        defer { close(dfd) }
        return (try? backingEntries(dirFD: dfd))?.contains { ConflictCopy(backing: $0.name)?.original == name } ?? true
    }

    /// Makes sure a long name's side file exists before its entry; returns whether it was
    /// created now (so a failed operation can remove it again).
    func ensureSideFile(_ dir: Node, _ e: BackingEntry) throws -> Bool {
        guard let side = e.sideFile else { return false }
        return try createFileIfAbsent(dirFD: dir.fd, side, Array(e.encrypted.utf8))
    }

    /// Removes a long name's side file after its entry is gone, unless a sync engine's
    /// conflict copy of the entry still names itself by it.
    func removeSideFile(_ dir: Node, _ e: BackingEntry) {
        guard let side = e.sideFile else { return }
        let dfd = openat(dir.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dfd >= 0 {
            defer { close(dfd) }
            let entries = try? backingEntries(dirFD: dfd)
            if entries?.contains(where: { ConflictCopy(backing: $0.name)?.original == e.name }) != false { return }
        }
        unlinkat(dir.fd, side, 0)
    }

    /// The plaintext name of a backing entry; nil for the store's own files and side files.
    /// Throws `corrupt` for an entry that does not decrypt.
    func plaintextName(dirFD: Int32, backing: String, iv: [UInt8]) throws -> String? {
        if Self.isReserved(backing) || NameCipher.isSideFile(backing) { return nil }
        if let copy = ConflictCopy(backing: backing), copy.isLong {
            let plain = try plaintextName(dirFD: dirFD, backing: copy.original, iv: iv) ?? ""
            let readable = copy.readableName(of: plain)
            guard !plain.isEmpty, readable.utf8.count <= NameCipher.backingNameMax else {
                throw KeybagError.corrupt("the readable name of a conflict copy is over 255 bytes")
            }
            return readable
        }
        guard NameCipher.isLongName(backing) else { return try names.shownName(ofShort: backing, dirIV: iv) }
        let fd = StoreFileOpen.regular(dirFD, backing + NameCipher.longSuffix)
        guard fd >= 0 else { throw KeybagError.corrupt("long name \(backing) has no side file") }
        defer { close(fd) }
        var buf = [UInt8](repeating: 0, count: 1024)
        let n = Glibc.read(fd, &buf, buf.count)
        guard n > 0 else { throw KeybagError.corrupt("side file of \(backing) is empty") }
        let encrypted = String(decoding: buf[0..<n], as: UTF8.self)
        guard NameCipher.backingEntry(for: encrypted).name == backing else {
            throw KeybagError.corrupt("side file of \(backing) does not match")
        }
        return String(decoding: try names.decrypt(encrypted, dirIV: iv), as: UTF8.self)
    }

    /// The plaintext name of a backing entry and the index in `ivs.all` of the IV it decrypts
    /// under; nil for the store's own files and side files. Throws as under the own IV when
    /// no IV decrypts it.
    func plaintextName(dirFD: Int32, backing: String, ivs: DirectoryIVs) throws -> (name: String, index: Int)? {
        do {
            return try plaintextName(dirFD: dirFD, backing: backing, iv: ivs.own).map { ($0, 0) }
        } catch {
            for (k, other) in ivs.others.enumerated() {
                if let name = try? plaintextName(dirFD: dirFD, backing: backing, iv: other.iv) { return (name, k + 1) }
            }
            throw error
        }
    }

    // MARK: namespace operations

    /// Chowns a new object to the caller when running as root (the group stays the
    /// directory's where it is setgid, as the backing filesystem already set it). What is
    /// not a directory is made without set-ID bits; those of `mode` (which the kernel already
    /// let the caller ask for) are set once it is the caller's, never on one left as root's.
    private func own(_ dirFD: Int32, _ backing: String, _ caller: Caller, mode: mode_t) {
        let group = groupFor(caller, dirFD: dirFD)
        let owned =
            !chownToCaller
            || !Failpoint.chownRefused.isOn && fchownat(dirFD, backing, caller.uid, group, AT_SYMLINK_NOFOLLOW) == 0
        var st = stat()
        if owned && mode & (S_ISUID | S_ISGID) != 0 && mode & S_IFMT != S_IFLNK && mode & S_IFMT != S_IFDIR,
           fstatat(dirFD, backing, &st, AT_SYMLINK_NOFOLLOW) == 0 {
            fchmodat(dirFD, backing, st.st_mode & 0o1777 | mode & (S_ISUID | S_ISGID), AT_SYMLINK_NOFOLLOW)
        }
    }

    /// Creates an entry with `make`, its side file first; undoes the side file on failure.
    /// A new object (`caller` given) is owned by the caller, with `mode`'s set-ID bits.
    private func makeEntry(
        parent: UInt64, name: String, caller: Caller?, mode: mode_t = 0, _ make: (Int32, String) throws -> Void
    ) throws -> (Node, stat) {
        let p = try node(parent)
        let e = try backingName(p, name)
        let created = try ensureSideFile(p, e)
        do {
            try make(p.fd, e.name)
        } catch {
            if created { removeSideFile(p, e) }
            throw FSError(error)
        }
        if let caller { own(p.fd, e.name, caller, mode: mode) }
        return try lookupBacking(p, e.name)
    }

    /// mkdir: the new directory gets its own random name IV, and the class the mount's policy
    /// gives its path, before anyone can see it. (Not derived from its path: a folder moved
    /// away and made again under the same name would share the IV, and with it the xattr set
    /// a directory's IV names.)
    func mkdir(parent: UInt64, name: String, mode: mode_t, caller: Caller) throws -> (Node, stat) {
        var meta = DirectoryMeta.fresh()
        if policy.mayMatch(name: name) {
            let p = try node(parent)
            // A rename of an ancestor during the walk can hide a name: one more try.
            let (tail, fromRoot) =
                try (try? pathTail(of: p, upTo: policy.depth - 1)) ?? pathTail(of: p, upTo: policy.depth - 1)
            meta.defaultClass = policy.protectionClass(tail: tail + [name], fromRoot: fromRoot)
        }
        let made = try makeEntry(parent: parent, name: name, caller: caller) { [self] dirFD, backing in
            try check(mkdirat(dirFD, backing, creationMode(mode, in: node(parent), by: caller) & 0o7777))
            do {
                let d = try check(openat(dirFD, backing, kbfs_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC))
                defer { close(d) }
                try createFileIfAbsent(dirFD: d, DirectoryMeta.fileName, try meta.encode(names))
            } catch {
                unlinkat(dirFD, backing, AT_REMOVEDIR)
                throw error
            }
        }
        // A new folder's metadata is the one just written, and it has no copies: its first
        // lookups need neither a read nor a listing to know.
        made.0.dirMeta.withLock { if $0 == nil { $0 = meta } }
        made.0.metadataCopies.withLock { if $0 == nil { $0 = [] } }
        return made
    }

    /// mknod: regular files (through `create`), FIFOs, sockets, and device nodes as root.
    func mknod(parent: UInt64, name: String, mode: mode_t, rdev: dev_t, caller: Caller) throws -> (Node, stat) {
        if (mode & S_IFMT) == S_IFREG {
            // A regular file needs its header: made as create makes it, then its handle closed.
            let (n, st, h) = try create(
                parent: parent, name: name, mode: mode, flags: O_WRONLY | O_EXCL, caller: caller)
            release(h)
            return (n, st)
        }
        return try makeEntry(parent: parent, name: name, caller: caller, mode: mode) { [self] dirFD, backing in
            try check(
                mknodat(dirFD, backing, mode & S_IFMT | creationMode(mode, in: node(parent), by: caller) & 0o1777, rdev)
            )
        }
    }

    /// symlink: the target is encrypted; one too long for a backing symlink lives in the
    /// store's `targets/` folder under its hash, written before the link.
    func symlink(target: String, parent: UInt64, name: String, caller: Caller) throws -> (Node, stat) {
        let t = Array(target.utf8)
        guard !t.isEmpty, t.count < Int(PATH_MAX) else { throw FSError(t.isEmpty ? ENOENT : ENAMETOOLONG) }
        var stored = try names.encryptTarget(t)
        if stored.utf8.count >= 4000 {
            var h = [UInt8](repeating: 0, count: 32)
            let b = Array(stored.utf8)
            crypto_generichash(&h, 32, b, UInt64(b.count), nil, 0)
            let id = Base64URL.encode(h)
            try createFileIfAbsent(dirFD: targetsFD, id, b)
            stored = NameCipher.longTargetPrefix + id
        }
        return try makeEntry(parent: parent, name: name, caller: caller) { dirFD, backing in
            try check(symlinkat(stored, dirFD, backing))
        }
    }

    /// readlink: decrypts the stored target.
    func readlink(_ id: UInt64) throws -> [UInt8] {
        let n = try node(id)
        var buf = [UInt8](repeating: 0, count: Int(PATH_MAX) + 1)
        let len = try n.withPathFD { try check(readlinkat($0, "", &buf, buf.count)) }
        var stored = String(decoding: buf[0..<len], as: UTF8.self)
        if stored.hasPrefix(NameCipher.longTargetPrefix) {
            let fd = try check(
                openat(
                    targetsFD, String(stored.dropFirst(NameCipher.longTargetPrefix.count)),
                    O_RDONLY | O_CLOEXEC | O_NOFOLLOW))
            defer { close(fd) }
            var big = [UInt8](repeating: 0, count: 8192)
            let m = Glibc.read(fd, &big, big.count)
            guard m > 0 else { throw FSError(EIO) }
            stored = String(decoding: big[0..<m], as: UTF8.self)
        }
        return try names.decryptTarget(stored)
    }

    /// unlink (a long symlink target goes with its last link).
    func unlink(parent: UInt64, name: String) throws {
        let p = try node(parent)
        let e = try backingName(p, name)
        var st = stat()
        var longTarget: String?
        let statted = fstatat(p.fd, e.name, &st, AT_SYMLINK_NOFOLLOW) == 0
        let xattrID = statted ? xattrIDOfLastLink(dirFD: p.fd, name: e.name, st: st) : nil
        if statted, (st.st_mode & S_IFMT) == S_IFLNK, st.st_nlink == 1 {
            var buf = [UInt8](repeating: 0, count: 256)
            let len = readlinkat(p.fd, e.name, &buf, buf.count)
            if len > 0 {
                let s = String(decoding: buf[0..<len], as: UTF8.self)
                if s.hasPrefix(NameCipher.longTargetPrefix) {
                    longTarget = String(s.dropFirst(NameCipher.longTargetPrefix.count))
                }
            }
        }
        try check(unlinkat(p.fd, e.name, 0))
        removeSideFile(p, e)
        if let longTarget { unlinkat(targetsFD, longTarget, 0) }
        if let xattrID { dropXattrs(xattrID) }
    }

    /// Whether a backing directory's entries are only the store's own files: metadata (and a
    /// sync engine's copies of it), temporaries, and long-name side files whose entry is gone
    /// (left by a crash or an offline edit). Such a directory is empty to its users.
    static func holdsOnlyStoreFiles(_ names: [String]) -> Bool {
        let present = Set(names)
        return names.allSatisfy { n in
            isReserved(n) || MetadataCopy(backing: n) != nil
                || (NameCipher.isSideFile(n) && !present.contains(String(n.dropLast(NameCipher.longSuffix.count))))
        }
    }

    /// rmdir: a directory holding only the store's own files counts as empty.
    func rmdir(parent: UInt64, name: String) throws {
        let p = try node(parent)
        let e = try backingName(p, name)
        if unlinkat(p.fd, e.name, AT_REMOVEDIR) == 0 { removeSideFile(p, e); return }
        let err = errno
        guard err == ENOTEMPTY || err == EEXIST else { throw FSError(err) }
        let failed = try replacingDirectoryOfStoreFiles(parentFD: p.fd, name: e.name) {
            unlinkat(p.fd, e.name, AT_REMOVEDIR)
        }
        if failed != 0 { throw FSError(failed) }
        removeSideFile(p, e)
    }

    /// rename (flags: RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT): the name is
    /// re-encrypted for the target directory; the target's side file is written first, the
    /// source's removed last unless an entry stays under the source name (the other file of
    /// an exchange, or the whiteout the backing filesystem leaves there). A replaced file's
    /// xattr set goes with it, whatever the flags.
    func rename(parent: UInt64, name: String, newParent: UInt64, newName: String, flags: UInt32) throws {
        let p = try node(parent), np = try node(newParent)
        let src = try backingName(p, name)
        let dst = try backingName(np, newName)
        let exchange = flags & kbfs_RENAME_EXCHANGE != 0, noReplace = flags & kbfs_RENAME_NOREPLACE != 0
        let created = try ensureSideFile(np, dst)
        let replacedXattrs = exchange || noReplace ? nil : xattrIDOfReplaced(p, src.name, np, dst.name)
        var rc = kbfs_renameat2(p.fd, src.name, np.fd, dst.name, flags)
        if rc != 0 && (errno == ENOTEMPTY || errno == EEXIST) && !exchange && !noReplace {
            // The target is a directory; one holding only the store's own files is empty.
            rc = renameOverEmptyDirectory(p, src.name, np, dst.name, flags: flags)
        }
        if rc != 0 {
            let e = errno
            if created { removeSideFile(np, dst) }
            throw FSError(e)
        }
        if let replacedXattrs { dropXattrs(replacedXattrs) }
        classGeneration.add(1, ordering: .relaxed)   // a moved directory may inherit differently
        let same = p.id == np.id && src.name == dst.name
        if !exchange && flags & kbfs_RENAME_WHITEOUT == 0 && !same { removeSideFile(p, src) }
    }

    /// The xattr id of a regular file that renaming `from` over `to` would delete (nil when
    /// the target is absent, another link of the source, or keeps other links).
    private func xattrIDOfReplaced(_ p: Node, _ from: String, _ np: Node, _ to: String) -> String? {
        guard hasStoredXattrs else { return nil }
        var a = stat(), b = stat()
        guard fstatat(np.fd, to, &b, AT_SYMLINK_NOFOLLOW) == 0, fstatat(p.fd, from, &a, AT_SYMLINK_NOFOLLOW) == 0,
              a.st_ino != b.st_ino || a.st_dev != b.st_dev else { return nil }
        return xattrIDOfLastLink(dirFD: np.fd, name: to, st: b)
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
        let entries = try backingEntries(dirFD: dfd)
        guard Self.holdsOnlyStoreFiles(entries.map(\.name)) else { throw FSError(ENOTEMPTY) }
        let saved = try? readMeta(dirFD: dfd)
        for r in entries { unlinkat(dfd, r.name, 0) }
        guard replace() == 0 else {
            let e = errno
            if let saved { _ = try? createFileIfAbsent(dirFD: dfd, DirectoryMeta.fileName, try saved.encode(names)) }
            return e
        }
        dropXattrs(ofDirectory: saved)
        return 0
    }

    /// link: hard links share the backing inode, so its header, key and class.
    func link(_ id: UInt64, newParent: UInt64, newName: String) throws -> (Node, stat) {
        let n = try node(id)
        guard !n.isDirectory else { throw FSError(EPERM) }
        return try makeEntry(parent: newParent, name: newName, caller: nil) { dirFD, backing in
            try n.withPathFD { try check(linkat(AT_FDCWD, "/proc/self/fd/\($0)", dirFD, backing, AT_SYMLINK_FOLLOW)) }
        }
    }

    // MARK: directories

    /// The name of a `readdir` entry, read in place: glibc's records are only as long as
    /// their name, so copying the 256-byte `d_name` field reads past the last record.
    static func entryName(_ ent: UnsafeMutablePointer<dirent>) -> UnsafePointer<CChar> {
        (UnsafeRawPointer(ent) + MemoryLayout<dirent>.offset(of: \dirent.d_name)!).assumingMemoryBound(to: CChar.self)
    }

    /// Raw entries of a directory (without . and ..).
    func backingEntries(dirFD: Int32) throws -> [(name: String, ino: UInt64, type: UInt8)] {
        let dup2fd = try check(dup(dirFD))
        guard let dir = fdopendir(dup2fd) else { let e = errno; close(dup2fd); throw FSError(e) }
        defer { closedir(dir) }
        rewinddir(dir)
        var out: [(String, UInt64, UInt8)] = []
        while let ent = readdir(dir) {
            let name = String(cString: Self.entryName(ent))
            if name == "." || name == ".." { continue }
            out.append((name, UInt64(ent.pointee.d_ino), ent.pointee.d_type))
        }
        return out
    }

    /// opendir: the names are listed by the first read (see `DirHandle`).
    func opendir(_ id: UInt64) throws -> DirHandle {
        let n = try node(id)
        guard n.isDirectory else { throw FSError(ENOTDIR) }
        _ = try meta(of: n)
        return DirHandle()
    }

    /// The entries of directory `n` with plaintext names, `.` and `..` first; entries that do
    /// not decrypt are skipped and logged.
    func listing(_ n: Node) throws -> [DirHandle.Entry] {
        guard n.isDirectory else { throw FSError(ENOTDIR) }
        let iv = try meta(of: n).iv
        let dfd = try check(openat(n.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC))
        defer { close(dfd) }
        // `..` needs an inode number (readdir(3) skips entries with 0): the backing parent's,
        // and the mount root's own at the root, as the root of any filesystem lists it.
        var up = stat()
        let upIno = n.id != 1 && fstatat(dfd, "..", &up, 0) == 0 ? UInt64(up.st_ino) : n.backingIno
        var entries = [DirHandle.Entry(name: ".", backing: ".", ino: n.backingIno, type: UInt8(DT_DIR)),
                       DirHandle.Entry(name: "..", backing: "..", ino: upIno, type: UInt8(DT_DIR))]
        var copies: [DirHandle.Entry] = []
        let raw = try backingEntries(dirFD: dfd)
        // The folder made on two devices apart: names under its metadata copies' IVs too.
        let metaCopies = metadataCopies(dirFD: dfd, entries: raw.map(\.name))
        n.metadataCopies.withLock { $0 = metaCopies }
        let ivs = DirectoryIVs(own: iv, copies: metaCopies)
        var underOthers: [(entry: DirHandle.Entry, index: Int)] = []
        for e in raw {
            do {
                guard let (name, index) = try plaintextName(dirFD: dfd, backing: e.name, ivs: ivs) else { continue }
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
                if SyncEngineFile(backing: e.name) != nil { continue }
                MountDaemon.log("skipping a store entry that does not decrypt (\(e.name.prefix(24))…): \(error)")
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
}
