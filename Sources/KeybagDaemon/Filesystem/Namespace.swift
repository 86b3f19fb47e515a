import Foundation
import Glibc
import KeybagCore

/// Names: encrypted entry names (with hashed long names and their side files), conflict
/// copies, and a backing entry's plaintext name. Directory metadata and inheritance are in
/// `DirectoryMetadata.swift`, the operations in `NamespaceOperations.swift`, listings in
/// `DirectoryListing.swift`.
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
        return (try? backingEntries(dirFD: dfd))?.contains { ConflictCopy(backing: $0.name)?.original == name } ?? true
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
            let entries = try? backingEntries(dirFD: dfd)
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

    /// A regular backing file of 0 bytes has no header: left by a crash of a version that
    /// created the name before writing the header. It becomes an empty file of the
    /// directory's class (a fresh file key; there is no data to lose). Needs that class's
    /// wrapping key now; otherwise the file stays as it is (EIO) until it can.
    func giveHeaderToEmptyFile(_ n: Node, parent p: Node) {
        guard let file = n.file, let cls = try? inheritedClass(p),
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
                try EncryptedContent.writeNewHeader(
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
