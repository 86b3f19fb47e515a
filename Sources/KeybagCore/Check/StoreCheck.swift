import CSodium
import Foundation
import Glibc

/// `keybagfs fsck`: checks an unmounted store — keybag, every directory's metadata, every
/// name and long-name pair, every file header (both slots) and, where the class key is at
/// hand, every block — and repairs what can be repaired. Repairs that drop data (torn or
/// damaged blocks) happen only when `dropData` is set.
public final class StoreCheck {
    /// One problem found.
    public struct Problem: Sendable, Codable, Equatable {
        /// Stable kind, e.g. `torn-tail`.
        public let kind: String
        /// The backing path, relative to the store.
        public let path: String
        /// The plaintext path in the mount, when the names decrypt.
        public let name: String?
        /// What is wrong.
        public let detail: String
        /// `repaired`, `repairable`, `drops-data` (needs --yes), `needs-passcode`, `not-repairable`, `failed: …`.
        public var repair: String
    }

    /// What to do about problems.
    public struct Options: Sendable {
        /// Repair what loses no data.
        public var repair: Bool
        /// Also repair what drops data (torn tails, damaged blocks, truncated headers).
        public var dropData: Bool
        public init(repair: Bool, dropData: Bool) { self.repair = repair; self.dropData = dropData }
    }

    /// Problems in the order found.
    public private(set) var problems: [Problem] = []
    /// Directories, regular files, blocks checked, and files whose contents could not be
    /// checked for want of the passcode.
    public private(set) var directories = 0, files = 0, blocks = 0, keyless = 0

    private let store: String
    private let options: Options
    private let keybag: Keybag
    private let names: NameCipher
    /// Class D of every key set, and A, B, C too with the passcode.
    private let keyring: ClassKeyring
    /// The current key set's class B public key (class B headers without the passcode).
    private let classBPublic: [UInt8]
    private let content: EncryptedContent
    private var seenInodes = Set<UInt64>()
    private var xattrIDs = Set<String>()
    private var targetIDs = Set<String>()
    private var unreadableHeaders = 0
    /// Called now and then with the number of files checked (a progress line).
    public var progress: ((Int) -> Void)?

    /// Opens the store's keys: the device key always, the passcode when given (through the
    /// device's TPM when bound to one, reached at `tcti` when given).
    public init(
        storePath: String, deviceKey: SecureKey, passcode: SecureKey?, options: Options, tcti: String? = nil
    ) throws {
        store = storePath
        self.options = options
        var kb = try Keybag.load(storePath: storePath, deviceKey: deviceKey)
        if passcode != nil { try kb.attachTPM(tcti: tcti, deviceKey: deviceKey) }
        keybag = kb
        keyring = ClassKeyring(
            classD: try kb.classDKeys(deviceKey: deviceKey), current: UInt8(kb.currentKeySet),
            behind: StoreDevices.newestKeySet(storePath: storePath) > kb.currentKeySet)
        let volume = try kb.unwrapDeviceKeySlot("volume", deviceKey: deviceKey)
        defer { volume.wipe() }
        names = try NameCipher(volumeKey: volume)
        let set = kb.currentKeySet
        classBPublic = [UInt8](
            Data(base64Encoded: set == 0 ? kb.file.classBPublic : kb.file.classBPublics?[String(set)] ?? "") ?? Data())
        if let passcode { keyring.install(try kb.unlockCounting(passcode: passcode, deviceKey: deviceKey)) }
        content = EncryptedContent(layout: BlockLayout(cipher: kb.cipher))
        if try keybag.counterIsAuthentic(deviceKey: deviceKey) == false {
            note(
                "keybag-counter", "keybag", nil,
                "the failed-attempt counter does not authenticate (edited offline); the daemon answers with the " +
                    "longest lockout",
                "not-repairable")
        }
    }

    /// Wipes the class keys.
    public func wipe() { keyring.wipeAll() }

    /// Runs every check (and repair).
    public func run() throws {
        let data = open(store + "/" + Keybag.dataDirName, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard data >= 0 else { throw KeybagError.system("cannot open \(store)/\(Keybag.dataDirName)", errno) }
        defer { close(data) }
        checkDirectory(fd: data, rel: Keybag.dataDirName, plain: "", inherited: nil)
        checkSideFolder(
            Keybag.xattrsDirName, referenced: xattrIDs, kind: "xattr-orphan",
            what: "an xattr set of no file or directory")
        checkSideFolder(
            Keybag.targetsDirName, referenced: targetIDs, kind: "target-orphan", what: "a symlink target of no symlink")
    }

    /// True when no problem was found (a sync engine's files are reported, and left alone,
    /// but are no problem).
    public var isClean: Bool { problems.allSatisfy { $0.repair == Self.leftAlone } }

    /// The repair state of a sync engine's file: never touched, not even by `--repair --yes`.
    public static let leftAlone = "left-alone"

    /// Why a file may be cut short besides a crash: a copy still coming in.
    static let halfSynced = "; or a file a sync engine or a copy had not finished writing"

    // MARK: recording

    /// Records a problem with its repair state.
    private func note(_ kind: String, _ path: String, _ name: String?, _ detail: String, _ repair: String) {
        problems.append(Problem(kind: kind, path: path, name: name, detail: detail, repair: repair))
    }

    /// Records a problem and runs its repair when allowed (`losesData`: needs `dropData`).
    private func fix(
        _ kind: String, _ path: String, _ name: String?, _ detail: String, losesData: Bool = false,
        _ repair: () throws -> Void
    ) {
        guard options.repair else { return note(kind, path, name, detail, losesData ? "drops-data" : "repairable") }
        guard !losesData || options.dropData else { return note(kind, path, name, detail, "drops-data") }
        do { try repair(); note(kind, path, name, detail, "repaired") } catch {
            note(kind, path, name, detail, "failed: \(error)")
        }
    }

    // MARK: walk

    /// Entries of a directory (without . and ..).
    private func entries(_ fd: Int32) -> [String] {
        let d = dup(fd)
        guard d >= 0, let dir = fdopendir(d) else { return [] }
        defer { closedir(dir) }
        rewinddir(dir)
        var out: [String] = []
        while let e = readdir(dir) {
            let name = withUnsafePointer(to: &e.pointee.d_name) {
                $0.withMemoryRebound(to: CChar.self, capacity: 256) { String(cString: $0) }
            }
            if name != "." && name != ".." { out.append(name) }
        }
        return out
    }

    /// Checks one directory of the tree and everything below it.
    private func checkDirectory(fd: Int32, rel: String, plain: String, inherited: ProtectionClass?) {
        directories += 1
        var meta: DirectoryMeta?
        let mfd = StoreFileOpen.regular(fd, DirectoryMeta.fileName)
        if mfd < 0 {
            note(
                "dir-meta-missing", rel, plain,
                "no \(DirectoryMeta.fileName): the names in this directory cannot be decrypted", "not-repairable")
        } else {
            var buf = [UInt8](repeating: 0, count: 512)
            let n = read(mfd, &buf, buf.count)
            close(mfd)
            do { meta = try DirectoryMeta.decode(Array(buf[0..<max(n, 0)]), names) } catch {
                note(
                    "dir-meta-damaged", rel + "/" + DirectoryMeta.fileName, plain,
                    "directory metadata does not authenticate: \(error)", "not-repairable")
            }
        }
        if let meta { xattrIDs.insert(Base64URL.encode(meta.iv)) }
        let cls = meta?.defaultClass ?? inherited
        let all = entries(fd)
        let present = Set(all)
        // Names made on another device under a sync engine's copy of the metadata decrypt too.
        let ivs = meta.map {
            DirectoryIVs(own: $0.iv, copies: DirectoryIVs.readCopies(dirFD: fd, among: all, cipher: names).copies)
        }
        // The losing device's own xattrs of this folder are under its IV: kept, not orphans.
        for other in ivs?.others ?? [] { xattrIDs.insert(Base64URL.encode(other.iv)) }
        for e in all.sorted() where e != DirectoryMeta.fileName {
            let path = rel + "/" + e
            if let s = SyncEngineFile(backing: e) {
                note("sync-engine-file", path, nil, s.description, Self.leftAlone)
                continue
            }
            if e.hasPrefix(NameCipher.reservedPrefix) {
                fix("temporary", path, nil, "a temporary left by an interrupted write") { try unlinkOrThrow(fd, e) }
                continue
            }
            if NameCipher.isSideFile(e) {
                let entry = String(e.dropLast(NameCipher.longSuffix.count))
                if !present.contains(entry) && !all.contains(where: { ConflictCopy(backing: $0)?.original == entry }) {
                    fix("side-file-orphan", path, nil, "a long name's side file whose entry is gone") {
                        try unlinkOrThrow(fd, e)
                    }
                }
                continue
            }
            if NameCipher.isLongName(e) && !present.contains(e + NameCipher.longSuffix) && Self.isWhiteout(dirFD: fd, e)
            {
                fix(
                    "whiteout-without-name", path, nil,
                    "a whiteout (left by a rename of keybagfs before 2026-11) without its side file: it has no name " +
                        "and hides nothing"
                ) {
                    try unlinkOrThrow(fd, e)
                }
                continue
            }
            let name = plaintextName(dirFD: fd, backing: e, ivs: ivs, path: path).map { plain + "/" + $0 }
            var st = stat()
            guard fstatat(fd, e, &st, AT_SYMLINK_NOFOLLOW) == 0 else { continue }
            switch st.st_mode & S_IFMT {
            case S_IFDIR:
                let sub = openat(fd, e, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                guard sub >= 0 else {
                    note("unreadable", path, name, String(cString: strerror(errno)), "not-repairable"); continue
                }
                checkDirectory(fd: sub, rel: path, plain: name ?? plain + "/?", inherited: cls)
                close(sub)
            case S_IFREG:
                guard seenInodes.insert(UInt64(st.st_ino)).inserted else { continue }  // another link of a checked file
                files += 1
                if files % 500 == 0 { progress?(files) }
                checkFile(
                    dirFD: fd, backing: e, path: path, name: name,
                    dirClass: cls ?? .completeUntilFirstUserAuthentication)
            case S_IFLNK:
                checkSymlink(dirFD: fd, backing: e, path: path, name: name)
            default:
                break
            }
        }
    }

    /// Whether entry `name` of `dirFD` is a whiteout: a character device 0:0.
    static func isWhiteout(dirFD: Int32, _ name: String) -> Bool {
        var st = stat()
        return fstatat(dirFD, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_mode & S_IFMT == S_IFCHR && st.st_rdev == 0
    }

    /// The plaintext name of an entry, recording a name problem when it does not decrypt.
    private func plaintextName(dirFD: Int32, backing: String, ivs: DirectoryIVs?, path: String) -> String? {
        guard let ivs else { return nil }
        if let copy = ConflictCopy(backing: backing), copy.isLong {
            // A copy of a long name reads its name from the original's side file.
            guard let plain = plaintextName(dirFD: dirFD, backing: copy.original, ivs: ivs, path: path) else {
                return nil
            }
            return copy.readableName(of: plain)
        }
        var encrypted = backing
        if NameCipher.isLongName(backing) {
            let fd = StoreFileOpen.regular(dirFD, backing + NameCipher.longSuffix)
            guard fd >= 0 else {
                note(
                    "side-file-missing", path, nil, "a long name without its side file: the name is lost",
                    "not-repairable")
                return nil
            }
            var buf = [UInt8](repeating: 0, count: 1024)
            let n = read(fd, &buf, buf.count)
            close(fd)
            encrypted = String(decoding: buf[0..<max(n, 0)], as: UTF8.self)
            guard NameCipher.backingEntry(for: encrypted).name == backing else {
                note("side-file-mismatch", path, nil, "the side file holds another name", "not-repairable")
                return nil
            }
        }
        let shown = ivs.all.lazy.compactMap { iv in
            NameCipher.isLongName(backing)
                ? (try? self.names.decrypt(encrypted, dirIV: iv)).map { String(decoding: $0, as: UTF8.self) }
                : try? self.names.shownName(ofShort: backing, dirIV: iv)
        }.first
        guard let shown else {
            note(
                "name", path, nil, "the name does not decrypt in this directory (moved or edited offline)",
                "not-repairable")
            return nil
        }
        return shown
    }

    /// A symlink: its target decrypts; a long target's file exists.
    private func checkSymlink(dirFD: Int32, backing: String, path: String, name: String?) {
        var buf = [UInt8](repeating: 0, count: Int(PATH_MAX) + 1)
        let len = readlinkat(dirFD, backing, &buf, buf.count)
        guard len > 0 else { return }
        var stored = String(decoding: buf[0..<len], as: UTF8.self)
        if stored.hasPrefix(NameCipher.longTargetPrefix) {
            let id = String(stored.dropFirst(NameCipher.longTargetPrefix.count))
            targetIDs.insert(id)
            guard let d = FileManager.default.contents(atPath: store + "/" + Keybag.targetsDirName + "/" + id) else {
                return note("target-missing", path, name, "the symlink's long target is gone", "not-repairable")
            }
            stored = String(decoding: d, as: UTF8.self)
        }
        if (try? names.decryptTarget(stored)) == nil {
            note("symlink-target", path, name, "the symlink target does not decrypt", "not-repairable")
        }
    }

    // MARK: files

    /// The unwrapping key of a class in a key set, when at hand (B needs its private key).
    private func classKey(_ cls: ProtectionClass, keySet: UInt8) -> FileHeader.ClassKey? {
        keyring.unwrappingKey(for: cls, keySet: keySet)
    }

    /// Gives a headerless file a header of `cls` (a fresh key; it holds no data).
    private func writeFreshHeader(_ fd: Int32, _ cls: ProtectionClass) throws {
        let set = keyring.currentKeySet
        guard !keyring.refusesNewWraps else { throw KeybagError.keyUnavailable }   // a removed device would open it
        let wrap: FileHeader.ClassKey
        if cls == .completeUnlessOpen { wrap = .classBPublic(classBPublic) } else {
            guard let k = classKey(cls, keySet: set) else { throw KeybagError.keyUnavailable }
            wrap = k
        }
        guard ftruncate(fd, 0) == 0 else { throw KeybagError.system("ftruncate", errno) }
        let raw = SecureKey(random: 32)
        defer { raw.wipe() }
        try EncryptedContent.writeNewHeader(
            fd: fd, try FileHeader.create(fileKey: raw, class: cls, cipher: keybag.cipher, using: wrap, keySet: set))
        guard fsync(fd) == 0 else { throw KeybagError.system("fsync", errno) }
    }

    /// Checks one regular file: header slots, layout, and with its class key every block.
    private func checkFile(dirFD: Int32, backing: String, path: String, name: String?, dirClass: ProtectionClass) {
        let fd = openat(dirFD, backing, (options.repair ? O_RDWR : O_RDONLY) | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { return note("unreadable", path, name, String(cString: strerror(errno)), "not-repairable") }
        defer { close(fd) }
        var st = stat()
        fstat(fd, &st)
        let size = Int(st.st_size)
        if size < FileHeader.size {
            let keyAtHand = dirClass == .completeUnlessOpen || classKey(dirClass, keySet: keyring.currentKeySet) != nil
            let detail =
                size == 0
                ? "an empty file without header (a crash during create); it becomes an empty \(dirClass.name) file"
                : "a header cut to \(size) bytes: the file key is lost" + Self.halfSynced
            if !keyAtHand && options.repair {
                return note(size == 0 ? "no-header" : "header-truncated", path, name, detail, "needs-passcode")
            }
            return fix(size == 0 ? "no-header" : "header-truncated", path, name, detail, losesData: size > 0) {
                try writeFreshHeader(fd, dirClass)
            }
        }
        let header: FileHeader
        do {
            let (h, superseded) = try EncryptedContent.readHeaderSlots(fd: fd)
            header = h
            if let superseded {
                fix(
                    "header-superseded-slot", path, name,
                    "a class change was cut off: slot \(superseded) still holds the older class's wrap"
                ) {
                    try EncryptedContent.eraseHeaderSlot(fd: fd, index: superseded)
                }
            }
        } catch {
            unreadableHeaders += 1
            return note("header-damaged", path, name, "\(error): the file key is lost", "not-repairable")
        }
        xattrIDs.insert(Base64URL.encode(header.fileID))
        guard header.cipher.sharesLayout(with: keybag.cipher) else {
            return note(
                "header-cipher", path, name,
                "the header names \(header.cipher.name), whose blocks have another layout than the store's " +
                    "\(keybag.cipher.name)",
                "not-repairable")
        }
        let layout = content.layout
        let rest = (size - FileHeader.size) % layout.cipherBlockSize
        if rest > 0 && rest <= layout.overhead {
            let detail = "\(rest) bytes after the last block hold no data (a write cut off" + Self.halfSynced + ")"
            fix("torn-fragment", path, name, detail) {
                guard ftruncate(fd, off_t(size - rest)) == 0 else { throw KeybagError.system("ftruncate", errno) }
            }
        }
        guard let ck = classKey(header.protectionClass, keySet: header.keySet) else { keyless += 1; return }
        let key: FileContentKey
        do { key = try FileContentKey(key: try header.unwrap(using: ck), header: header) } catch {
            return note(
                "header-wrap", path, name, "the file key does not unwrap (header edited offline)", "not-repairable")
        }
        defer { key.wipe() }
        checkBlocks(fd: fd, key: key, path: path, name: name)
    }

    /// Every block of a file; repairs end marks, torn tails and damaged blocks.
    private func checkBlocks(fd: Int32, key: FileContentKey, path: String, name: String?) {
        guard let checks = try? content.blockChecks(fd: fd, key: key) else {
            return note("unreadable", path, name, "cannot read the blocks", "not-repairable")
        }
        blocks += checks.count
        let n = checks.count
        guard n > 0 else { return }
        // The last block that authenticates: everything after it is torn.
        let lastGood = checks.lastIndex { $0 == .authentic || $0 == .wrongEnd } ?? -1
        if lastGood < n - 1 {
            let lost = n - 1 - lastGood
            fix(
                "torn-tail", path, name,
                "the last \(lost) block(s) do not authenticate (a write cut off before fsync" + Self.halfSynced +
                    "); repair cuts the file after block \(lastGood)",
                losesData: true
            ) {
                try content.cut(fd: fd, afterBlocks: lastGood + 1)
                if lastGood >= 0 && key.sealsEnd {
                    try content.resealEndMark(fd: fd, key: key, block: lastGood, from: false, to: true)
                }
            }
        } else if checks[n - 1] == .wrongEnd {
            fix(
                "end-not-sealed", path, name,
                "the file ends at block \(n - 1) but that block is not sealed as the end (a cut, or a truncate " +
                    "cut off" + Self.halfSynced + ")"
            ) {
                try content.resealEndMark(fd: fd, key: key, block: n - 1, from: false, to: true)
            }
        }
        for (b, c) in checks.enumerated() where b < lastGood && c == .damaged {
            fix(
                "block-damaged", path, name, "block \(b) does not authenticate; repair turns it into a hole (zeros)",
                losesData: true
            ) {
                let zeros = [UInt8](repeating: 0, count: content.layout.cipherBlockSize)
                try zeros.withUnsafeBytes {
                    try EncryptedContent.pwriteFull(fd, $0, offset: content.layout.cipherOffset(ofBlock: b))
                }
            }
        }
        if options.repair { _ = fsync(fd) }
    }

    // MARK: store folders

    /// `xattrs/` or `targets/`: files nothing refers to.
    private func checkSideFolder(_ folder: String, referenced: Set<String>, kind: String, what: String) {
        let fd = open(store + "/" + folder, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else { return }
        defer { close(fd) }
        for e in entries(fd).sorted() where !referenced.contains(e) {
            let path = folder + "/" + e
            if let s = SyncEngineFile(backing: e) {
                note("sync-engine-file", path, nil, s.description, Self.leftAlone)
            } else if e.hasPrefix(NameCipher.reservedPrefix) {
                fix("temporary", path, nil, "a temporary left by an interrupted write") { try unlinkOrThrow(fd, e) }
            } else if let c = ConflictCopy(backing: e), referenced.contains(c.original) {
                // The other device's version of an xattr set (or target) both changed apart:
                // kept, as nothing may lose what either device wrote.
                note("sync-conflict-copy", path, nil, "a sync engine's conflict copy of \(c.original) (left alone)",
                     Self.leftAlone)
            } else if unreadableHeaders > 0 && kind == "xattr-orphan" {
                note(kind, path, nil, what + " (kept: some headers are unreadable, it may be theirs)", "not-repairable")
            } else {
                fix(kind, path, nil, what) { try unlinkOrThrow(fd, e) }
            }
        }
    }

    /// unlinkat or a thrown error.
    private func unlinkOrThrow(_ dirFD: Int32, _ name: String) throws {
        guard unlinkat(dirFD, name, 0) == 0 else { throw KeybagError.system("unlink \(name)", errno) }
    }
}
