import Foundation
import Glibc
import KeybagCore

/// Each directory's names in the store: encrypted entry names (with hashed long names and
/// their side files), conflict copies, and a backing entry's plaintext name; its metadata and
/// the class it passes on are in `DirectoryMetadata.swift`. What changes names is `Namespace`'s.
struct DirectoryNames: Sendable {
    /// Names, symlink targets and directory metadata under the volume key; the mount's
    /// default class, its directory policy, and their generation.
    let names: NameCipher, classes: ClassDefaults
    /// The node table (its root ends every walk up the store), and where notes go.
    let table: NodeTable, log: EventLog

    /// Rejects names no directory entry may have.
    static func checkName(_ name: String) throws {
        if name.utf8.count > 255 { throw FSError(ENAMETOOLONG) }
        if name.isEmpty || name == "." || name == ".." || name.utf8.contains(UInt8(ascii: "/")) {
            throw FSError(EINVAL)
        }
    }

    /// The name of a `readdir` entry, read in place: glibc's records are only as long as
    /// their name, so copying the 256-byte `d_name` field reads past the last record.
    static func entryName(_ ent: UnsafeMutablePointer<dirent>) -> UnsafePointer<CChar> {
        (UnsafeRawPointer(ent) + MemoryLayout<dirent>.offset(of: \dirent.d_name)!).assumingMemoryBound(to: CChar.self)
    }

    /// Raw entries of a directory (without . and ..).
    static func backingEntries(dirFD: Int32) throws -> [(name: String, ino: UInt64, type: UInt8)] {
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

    /// A plaintext name's backing entry in one directory.
    struct BackingEntry {
        /// The directory entry in the store.
        let name: String
        /// For a long name: the side file holding `encrypted`.
        let sideFile: String?
        /// The full encrypted name.
        let encrypted: String
    }

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
            other.copy.readableName(of: c.plain).utf8.elementsEqual(name.utf8)
        else { return nil }
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
        return (try? Self.backingEntries(dirFD: dfd))?.contains { ConflictCopy(backing: $0.name)?.original == name }
            ?? true
    }

    /// Makes sure a long name's side file exists before its entry; returns whether it was
    /// created now (so a failed operation can remove it again).
    func ensureSideFile(_ dir: Node, _ e: BackingEntry) throws -> Bool {
        guard let side = e.sideFile else { return false }
        return try AtomicStoreFile.createIfAbsent(dirFD: dir.fd, side, Array(e.encrypted.utf8))
    }

    /// Removes a long name's side file after its entry is gone, unless a sync engine's
    /// conflict copy of the entry still names itself by it.
    func removeSideFile(_ dir: Node, _ e: BackingEntry) {
        guard let side = e.sideFile else { return }
        let dfd = openat(dir.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dfd >= 0 {
            defer { close(dfd) }
            let entries = try? Self.backingEntries(dirFD: dfd)
            if entries?.contains(where: { ConflictCopy(backing: $0.name)?.original == e.name }) != false { return }
        }
        unlinkat(dir.fd, side, 0)
    }

    /// The plaintext name of a backing entry (`StoreNames`); nil for the store's own files and
    /// side files. Throws `corrupt` for an entry that does not decrypt.
    func plaintextName(dirFD: Int32, backing: String, iv: [UInt8]) throws -> String? {
        try plaintextName(dirFD: dirFD, backing: backing, ivs: [iv])?.name
    }

    /// The plaintext name of a backing entry and the index in `ivs.all` of the IV it decrypts
    /// under; nil for the store's own files and side files.
    func plaintextName(dirFD: Int32, backing: String, ivs: DirectoryIVs) throws -> (name: String, index: Int)? {
        try plaintextName(dirFD: dirFD, backing: backing, ivs: ivs.all)
    }

    /// `StoreNames.plaintextName`, its problems as `corrupt` errors.
    private func plaintextName(dirFD: Int32, backing: String, ivs: [[UInt8]]) throws -> (name: String, index: Int)? {
        switch StoreNames(cipher: names).plaintextName(dirFD: dirFD, backing: backing, ivs: ivs) {
        case .success(let found): return found
        case .failure(let problem): throw KeybagError.corrupt(problem.message(backing))
        }
    }
}
