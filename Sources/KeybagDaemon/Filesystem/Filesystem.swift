import CSystem
import Dispatch
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization

/// An operation's failure as an errno value (what the kernel gets back).
struct FSError: Error {
    let errno: Int32
    init(_ e: Int32) { errno = e }

    /// Maps core and system errors: evicted keys are EACCES, bad data is EIO.
    init(_ error: Error) {
        switch error {
        case let e as FSError: errno = e.errno
        case KeybagError.keyUnavailable: errno = EACCES
        case KeybagError.corrupt: errno = EIO
        case KeybagError.system(_, let e): errno = e
        default: errno = EIO
        }
    }
}

/// Runs a syscall-style call, throwing its errno when it returns -1.
@discardableResult
@inline(__always)
func check<T: BinaryInteger>(_ r: T) throws -> T {
    if r < 0 { throw FSError(errno) }
    return r
}

/// The filesystem behind the FUSE glue: the node table and the rooms each request goes to —
/// `Namespace` (names made, removed, moved, listed), `EntryLookup`, `Attributes` (attributes,
/// xattrs, ACLs, the class), `FileIO` (open files and their content) over `DirectoryNames`.
/// Every operation throws `FSError` with the errno to reply.
final class Filesystem: Sendable {
    /// The nodes the kernel knows, by id; each directory's names, metadata and class.
    let table: NodeTable, directories: DirectoryNames
    /// Lookups (entries become nodes); names made, removed, moved and listed.
    let lookups: EntryLookup, namespace: Namespace
    /// getattr, setattr, access, xattrs, ACLs and `user.protection`; open files and their content.
    let attributes: Attributes, io: FileIO

    init(
        dataFD: Int32, targetsFD: Int32, xattrsFD: Int32, names: NameCipher, keyring: ClassKeyring,
        cipher: ContentCipher, defaultClass: ProtectionClass,
        policy: ClassPolicy = ClassPolicy(), threads: Int = 16, kernel: KernelNotifier, journaling: Journaling? = nil,
        log: EventLog = .standardError
    ) throws {
        table = try NodeTable(rootFD: dataFD)
        directories = DirectoryNames(
            names: names, classes: ClassDefaults(mountDefault: defaultClass, policy: policy), table: table, log: log)
        let plaintext = PlaintextStat(layout: BlockLayout(cipher: cipher), targetsFD: targetsFD)
        lookups = EntryLookup(
            table: table, directories: directories, plaintext: plaintext, keyring: keyring, cipher: cipher)
        let space = StoreSpace(storeFD: dataFD, threads: threads) { [keyring] in keyring.access.canOpen(.complete) }
        let xattrs = XattrStorage(dirFD: xattrsFD, names: names, log: log)
        let acls = PosixACLs()
        io = FileIO(
            table: table, directories: directories, lookups: lookups,
            keyring: keyring, cipher: cipher, kernel: kernel, space: space, journaling: journaling,
            acls: acls, xattrs: xattrs, storeReportsHoles: kbfs_reports_holes(dataFD) == 1)
        attributes = Attributes(
            table: table, directories: directories, io: io, xattrs: xattrs, acls: acls, plaintext: plaintext)
        namespace = Namespace(
            table: table, directories: directories, lookups: lookups, io: io, attributes: attributes,
            targetsFD: targetsFD)
    }

    // MARK: what the daemon's other parts reach

    /// Where notes go (the daemon's standard error).
    var log: EventLog { directories.log }
    /// Page drops, attribute refreshes and off-thread work (see `KernelNotifier`).
    var kernel: KernelNotifier { io.kernel }
    /// What the store watcher reports of another writer.
    var underneath: ChangesUnderneath { io.underneath }
    /// The mount's default class, its directory policy, and their generation.
    var classes: ClassDefaults { directories.classes }
    /// The class keys and the lock state.
    var keyring: ClassKeyring { io.keyring }

    // MARK: lock

    /// Daemon exit: every file key zeroed.
    func wipeFileKeys() {
        for f in table.regularFiles() { f.file.io.write { $0.wipe() } }
    }

    /// statfs of the store's filesystem, in plaintext: each 4096-byte block of content takes
    /// `cipherBlockSize` bytes of the store, so the space a program can fill is that much
    /// smaller than the store's (a program that fallocates what df says is free must fit).
    func statfs() throws -> statvfs {
        var s = statvfs()
        try check(fstatvfs(table.root.fd, &s))
        let plain = UInt64(BlockLayout.plainBlockSize), cipher = UInt64(io.content.layout.cipherBlockSize)
        func scaled(_ n: fsblkcnt_t) -> fsblkcnt_t {
            fsblkcnt_t(UInt64(n) / cipher * plain + UInt64(n) % cipher * plain / cipher)
        }
        s.f_blocks = scaled(s.f_blocks)
        s.f_bfree = scaled(s.f_bfree)
        s.f_bavail = scaled(s.f_bavail)
        return s
    }
}

/// The lock's view of the filesystem: every regular file's key life, and the kernel's page cache.
extension Filesystem: EvictionTarget {
    func fileKeyLives() -> [(id: UInt64, life: RWLocked<FileKeyLife>)] {
        table.regularFiles().map { ($0.node.id, $0.file.io) }
    }

    func dropPageCache(_ ids: [UInt64], pass: Eviction.Pass, of kind: Eviction.Kind) {
        kernel.dropPageCache(ids, pass: "\(kind.rawValue) (\(pass.rawValue))")
    }
}
