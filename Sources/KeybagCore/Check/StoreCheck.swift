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
    public internal(set) var problems: [Problem] = []
    /// Directories, regular files, blocks checked, and files whose contents could not be
    /// checked for want of the passcode.
    public internal(set) var directories = 0, files = 0, blocks = 0, keyless = 0

    let store: String
    let options: Options
    let keybag: Keybag
    let names: NameCipher
    /// Class D of every key set, and A, B, C too with the passcode.
    let keyring: ClassKeyring
    /// The current key set's class B public key (class B headers without the passcode).
    let classBPublic: [UInt8]
    let content: EncryptedContent
    var seenInodes = Set<UInt64>()
    var xattrIDs = Set<String>()
    var targetIDs = Set<String>()
    var unreadableHeaders = 0
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
        if passcode != nil { try TPMBinding.attach(&kb, tcti: tcti, deviceKey: deviceKey) }
        keybag = kb
        keyring = ClassKeyring(
            classD: try kb.classDKeys(deviceKey: deviceKey), current: UInt8(kb.currentKeySet),
            behind: DeviceTrust.newestKeySet(kb) > kb.currentKeySet)
        let volume = try kb.unwrapDeviceKeySlot("volume", deviceKey: deviceKey)
        defer { volume.wipe() }
        names = try NameCipher(volumeKey: volume)
        let set = kb.currentKeySet
        classBPublic = [UInt8](
            Data(base64Encoded: set == 0 ? kb.file.classBPublic : kb.file.classBPublics?[String(set)] ?? "") ?? Data())
        if let passcode {
            keyring.install(try PasscodeAttempts.unlockCounting(&kb, passcode: passcode, deviceKey: deviceKey))
        }
        content = EncryptedContent(layout: BlockLayout(cipher: kb.cipher))
        if try KeybagMACs.counterIsAuthentic(keybag.file, deviceKey: deviceKey) == false {
            note(
                "keybag-counter", "keybag", nil,
                "the failed-attempt counter does not authenticate (edited offline); the daemon answers with the "
                    + "longest lockout",
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
        checkTree(fd: data)
        checkSideFolder(
            Keybag.xattrsDirName, referenced: xattrIDs, kind: "xattr-orphan",
            what: "an xattr set of no file or directory")
        checkXattrSets(xattrIDs)
        checkSideFolder(
            Keybag.targetsDirName, referenced: targetIDs, kind: "target-orphan", what: "a symlink target of no symlink")
        checkDeviceRecords()
    }

    /// The files of `devices/` this device refuses (forged, damaged, of another store, or not
    /// signed by a device it trusts), as the daemon does at mount; left for the user, since a
    /// record this device cannot judge yet may be another device's newer one.
    func checkDeviceRecords() {
        for line in DeviceTrust.of(keybag)?.refused ?? [] {
            let name = line.split(separator: ":", maxSplits: 1).first.map(String.init) ?? line
            note(
                "device-record-refused", StoreDevices.dirName + "/" + name, nil,
                "refused as the daemon refuses it: \(line)", Self.leftAlone)
        }
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
    func note(_ kind: String, _ path: String, _ name: String?, _ detail: String, _ repair: String) {
        problems.append(Problem(kind: kind, path: path, name: name, detail: detail, repair: repair))
    }

    /// Records a problem and runs its repair when allowed (`losesData`: needs `dropData`).
    func fix(
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
    func entries(_ fd: Int32) -> [String] { DirectoryEntries.names(of: fd) }

    /// The directory's metadata, or nil with the problem noted.
    private func directoryMeta(fd: Int32, rel: String, plain: String) -> DirectoryMeta? {
        let mfd = StoreFileOpen.regular(fd, DirectoryMeta.fileName)
        guard mfd >= 0 else {
            note(
                "dir-meta-missing", rel, plain,
                "no \(DirectoryMeta.fileName): the names in this directory cannot be decrypted", "not-repairable")
            return nil
        }
        var buf = [UInt8](repeating: 0, count: 512)
        let n = read(mfd, &buf, buf.count)
        close(mfd)
        do { return try DirectoryMeta.decode(Array(buf[0..<max(n, 0)]), names) } catch {
            note(
                "dir-meta-damaged", rel + "/" + DirectoryMeta.fileName, plain,
                "directory metadata does not authenticate: \(error)", "not-repairable")
            return nil
        }
    }

    /// Checks (and repairs) backing entry `e` when it is not an entry of the tree: a sync
    /// engine's file, a temporary, a long name's side file or a bare whiteout. True when it
    /// was one of those.
    private func checkedAsNoEntry(_ e: String, dirFD fd: Int32, path: String, all: [String], present: Set<String>)
        -> Bool
    {
        switch BackingKind.of(e) {
        case .syncEngine(let s):
            note("sync-engine-file", path, nil, s.description, Self.leftAlone)
            return true
        case .storeFile, .directoryMeta:
            fix("temporary", path, nil, "a temporary left by an interrupted write or mkdir") {
                try removeTemporary(fd, e)
            }
            return true
        case .sideFile(let entry):
            if !present.contains(entry) && !all.contains(where: { ConflictCopy(backing: $0)?.original == entry }) {
                fix("side-file-orphan", path, nil, "a long name's side file whose entry is gone") {
                    try unlinkOrThrow(fd, e)
                }
            }
            return true
        case .longName where !present.contains(e + NameCipher.longSuffix) && Self.isWhiteout(dirFD: fd, e):
            fix(
                "whiteout-without-name", path, nil,
                "a whiteout (left by a rename of keybagfs before 2026-11) without its side file: it has no name "
                    + "and hides nothing"
            ) {
                try unlinkOrThrow(fd, e)
            }
            return true
        case .name, .longName, .foreign:
            return false
        }
    }

    /// What a folder is walked with: its plaintext path (nil: its name does not decrypt) and
    /// the class its parent passes on.
    struct FolderWay {
        let plain: String, named: String?
        let inherited: ProtectionClass?
    }

    /// What a folder's entries are checked with: its plaintext path, class and name IVs.
    struct FolderSeen {
        let plain: String
        let cls: ProtectionClass?
        let ivs: DirectoryIVs?
        let present: Set<String>
    }

    /// Checks the tree below `data/` (`StoreTree`): each folder's metadata, then its entries.
    func checkTree(fd: Int32) {
        StoreTree.walk(
            fd, path: Keybag.dataDirName, FolderWay(plain: "", named: "", inherited: nil),
            enter: { folder, way in enterFolder(folder, way) },
            visit: { folder, e, seen in checkEntry(e, in: folder, seen) },
            unopenable: { e, way, err in
                let why = err == ELOOP ? "deeper than \(StoreTree.maxDepth) folders" : String(cString: strerror(err))
                note("unreadable", e.path, way.named, why, "not-repairable")
            })
    }

    /// A folder's metadata, counted; what its entries are checked with.
    private func enterFolder(_ folder: StoreTree.Folder, _ way: FolderWay) -> FolderSeen {
        directories += 1
        let meta = directoryMeta(fd: folder.fd, rel: folder.path, plain: way.plain)
        if let meta { xattrIDs.insert(Base64URL.encode(meta.iv)) }
        // Names made on another device under a sync engine's copy of the metadata decrypt too.
        let ivs = meta.map {
            DirectoryIVs(
                own: $0.iv, copies: DirectoryIVs.readCopies(dirFD: folder.fd, among: folder.names, cipher: names).copies
            )
        }
        // The losing device's own xattrs of this folder are under its IV: kept, not orphans.
        for other in ivs?.others ?? [] { xattrIDs.insert(Base64URL.encode(other.iv)) }
        return FolderSeen(
            plain: way.plain, cls: meta?.defaultClass ?? way.inherited, ivs: ivs, present: Set(folder.names))
    }

    /// Checks one entry of a folder; for a subfolder, returns what it is walked with.
    private func checkEntry(_ e: StoreTree.Entry, in folder: StoreTree.Folder, _ seen: FolderSeen) -> FolderWay? {
        let fd = folder.fd
        guard e.name != DirectoryMeta.fileName,
            !checkedAsNoEntry(e.name, dirFD: fd, path: e.path, all: folder.names, present: seen.present)
        else { return nil }
        let name = plaintextName(dirFD: fd, backing: e.name, ivs: seen.ivs, path: e.path).map { seen.plain + "/" + $0 }
        guard let st = e.stat else { return nil }
        switch st.st_mode & S_IFMT {
        case S_IFDIR:
            return FolderWay(plain: name ?? seen.plain + "/?", named: name, inherited: seen.cls)
        case S_IFREG:
            guard seenInodes.insert(UInt64(st.st_ino)).inserted else { return nil }  // another link of a checked file
            files += 1
            if files % 500 == 0 { progress?(files) }
            checkFile(
                dirFD: fd, backing: e.name, path: e.path, name: name,
                dirClass: seen.cls ?? .completeUntilFirstUserAuthentication)
        case S_IFLNK:
            checkSymlink(dirFD: fd, backing: e.name, path: e.path, name: name)
        default:
            break
        }
        return nil
    }

    /// Whether entry `name` of `dirFD` is a whiteout: a character device 0:0.
    static func isWhiteout(dirFD: Int32, _ name: String) -> Bool {
        var st = stat()
        return fstatat(dirFD, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_mode & S_IFMT == S_IFCHR && st.st_rdev == 0
    }

    /// The plaintext name of an entry (`StoreNames`), recording a name problem when it has none.
    func plaintextName(dirFD: Int32, backing: String, ivs: DirectoryIVs?, path: String) -> String? {
        guard let ivs else { return nil }
        switch StoreNames(cipher: names).plaintextName(dirFD: dirFD, backing: backing, ivs: ivs.all) {
        case .success(let found):
            return found?.name
        case .failure(.sideFileMissing):
            note(
                "side-file-missing", path, nil, "a long name without its side file: the name is lost", "not-repairable")
        case .failure(.sideFileMismatch):
            note("side-file-mismatch", path, nil, "the side file holds another name", "not-repairable")
        case .failure(.doesNotDecrypt):
            note(
                "name", path, nil, "the name does not decrypt in this directory (moved or edited offline)",
                "not-repairable")
        case .failure(.readableNameTooLong):
            note("name", path, nil, "a conflict copy whose readable name would be over 255 bytes", "not-repairable")
        }
        return nil
    }

    /// A symlink: its target decrypts; a long target's file exists.
    func checkSymlink(dirFD: Int32, backing: String, path: String, name: String?) {
        var buf = [UInt8](repeating: 0, count: Int(PATH_MAX) + 1)
        let len = readlinkat(dirFD, backing, &buf, buf.count)
        guard len > 0 else { return }
        var stored = String(decoding: buf[0..<len], as: UTF8.self)
        if let id = StoreNames.longTargetID(stored) {
            targetIDs.insert(id)
            guard let d = try? StoreFileOpen.contents(store + "/" + Keybag.targetsDirName + "/" + id) else {
                return note("target-missing", path, name, "the symlink's long target is gone", "not-repairable")
            }
            stored = String(decoding: d, as: UTF8.self)
        }
        if (try? names.decryptTarget(stored)) == nil {
            note("symlink-target", path, name, "the symlink target does not decrypt", "not-repairable")
        }
    }

    // MARK: store folders

    /// `xattrs/` or `targets/`: files nothing refers to.
    func checkSideFolder(_ folder: String, referenced: Set<String>, kind: String, what: String) {
        let fd = open(store + "/" + folder, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else { return }
        defer { close(fd) }
        for e in entries(fd).sorted() where !referenced.contains(e) {
            let path = folder + "/" + e
            let backingKind = BackingKind.of(e)
            if case .syncEngine(let s) = backingKind {
                note("sync-engine-file", path, nil, s.description, Self.leftAlone)
            } else if backingKind == .storeFile || backingKind == .directoryMeta {
                fix("temporary", path, nil, "a temporary left by an interrupted write") { try unlinkOrThrow(fd, e) }
            } else if let c = ConflictCopy(backing: e), referenced.contains(c.original) {
                // The other device's version of an xattr set (or target) both changed apart:
                // kept, as nothing may lose what either device wrote.
                note(
                    "sync-conflict-copy", path, nil, "a sync engine's conflict copy of \(c.original) (left alone)",
                    Self.leftAlone)
            } else if unreadableHeaders > 0 && kind == "xattr-orphan" {
                note(kind, path, nil, what + " (kept: some headers are unreadable, it may be theirs)", "not-repairable")
            } else {
                fix(kind, path, nil, what) { try unlinkOrThrow(fd, e) }
            }
        }
    }

    /// The xattr sets files and directories refer to: each must authenticate. One a power cut
    /// left empty or torn (set without an fsync of its object) holds nothing readable; the
    /// mount reads it as empty, and the repair removes it.
    func checkXattrSets(_ ids: Set<String>) {
        let fd = open(store + "/" + Keybag.xattrsDirName, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else { return }
        defer { close(fd) }
        for id in ids.sorted() {
            let f = StoreFileOpen.regular(fd, id)
            guard f >= 0 else { continue }
            var st = stat()
            let size = fstat(f, &st) == 0 ? Int(st.st_size) : -1
            var buf = [UInt8](repeating: 0, count: max(0, min(size, 16 << 20)))
            let n = buf.withUnsafeMutableBytes { (try? FullIO.preadFull(f, $0, offset: 0)) ?? -1 }
            close(f)
            guard n < 0 || (try? XattrSet.opened(Array(buf[0..<n]), id: id, names: names)) == nil else { continue }
            fix(
                "xattr-set-damaged", Keybag.xattrsDirName + "/" + id, nil,
                "an xattr set that does not authenticate (\(size) bytes; left empty or torn by a power cut before "
                    + "its object's fsync): it holds nothing readable"
            ) { try unlinkOrThrow(fd, id) }
        }
    }

    /// Removes a temporary: a file, or a folder a cut mkdir left (its metadata and temporaries).
    func removeTemporary(_ dirFD: Int32, _ name: String) throws {
        var st = stat()
        guard fstatat(dirFD, name, &st, AT_SYMLINK_NOFOLLOW) == 0, st.st_mode & S_IFMT == S_IFDIR else {
            return try unlinkOrThrow(dirFD, name)
        }
        let d = openat(dirFD, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard d >= 0 else { throw KeybagError.system("open \(name)", errno) }
        defer { close(d) }
        for e in entries(d) {
            guard BackingKind.of(e) == .directoryMeta || BackingKind.of(e) == .storeFile else {
                throw KeybagError.invalid("the temporary folder \(name) holds \(e): left alone")
            }
            try unlinkOrThrow(d, e)
        }
        guard unlinkat(dirFD, name, AT_REMOVEDIR) == 0 else { throw KeybagError.system("rmdir \(name)", errno) }
    }

    /// unlinkat or a thrown error.
    func unlinkOrThrow(_ dirFD: Int32, _ name: String) throws {
        guard unlinkat(dirFD, name, 0) == 0 else { throw KeybagError.system("unlink \(name)", errno) }
    }
}
