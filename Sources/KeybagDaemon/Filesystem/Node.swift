import CSystem
import Glibc
import KeybagCore
import Synchronization

/// What a node is, with the state only that kind keeps.
enum NodeKind: Sendable {
    /// A regular file: its key life and open descriptors.
    case file(FileState)
    /// A directory: its metadata, once read.
    case directory(DirectoryState)
    /// A symlink, FIFO, socket or device (its `S_IFMT` bits).
    case other(mode_t)

    /// The kind of an object of file type `type` (`S_IFMT` bits), with fresh state.
    init(type: mode_t) {
        switch type {
        case S_IFREG: self = .file(FileState())
        case S_IFDIR: self = .directory(DirectoryState())
        default: self = .other(type)
        }
    }
}

/// The state of a regular file's node.
final class FileState: Sendable {
    /// The file key's life: reads share the lock, writes, truncation, class changes and
    /// eviction take it alone. Lock order: after `Controller.transitions`, before
    /// `ClassKeyring`'s keys and `SecureKey`'s lock; one node's at a time.
    let io = RWLocked(FileKeyLife())
    /// When this file's header was last rewritten (a class change): its backing modification
    /// time must not go back before it (see `Filesystem.storedModificationTime`).
    let headerRewritten = Locked<timespec?>(nil)
    /// The descriptors of the open handles. A handle leaves the list before its descriptor
    /// is closed, under the lock `withOpenFD` holds while it uses one.
    let openFDs = Locked<[Int32]>([])
    /// Backing bytes from the file's start known to hold no hole (writes there reserve no
    /// space first); -1 until first asked. Read and written under `io` taken alone.
    let allocated = Atomic<Int>(-1)
    /// Writes that reserved space since the store was last asked where the first hole is.
    let reservesSinceProbe = Atomic<Int>(0)
    /// The file's identity in overwrite-journal records, once written through the journal.
    let journalID = Locked<JournalFileID?>(nil)

    /// After a cut or a punched hole at backing offset `offset`: nothing past it is known.
    func noteHole(at offset: Int) {
        let known = allocated.load(ordering: .relaxed)
        if known > offset { allocated.store(offset, ordering: .relaxed) }
    }
}

/// The state of a directory's node, read from the store when first needed.
final class DirectoryState: Sendable {
    /// The parsed `.kbfs-dir` (name IV, default class), once read.
    let meta = Locked<DirectoryMeta?>(nil)
    /// The IVs of a sync engine's copies of `.kbfs-dir` (`DirectoryIVs`), once read.
    let metadataCopies = Locked<[DirectoryIVs.Other]?>(nil)
    /// The inherited default class and the class generation it was computed in.
    let inherited = Locked<(generation: UInt64, cls: ProtectionClass)?>(nil)

    /// Forgets the metadata and its copies read so far (changed underneath).
    func forget() {
        meta.withLock { $0 = nil }
        metadataCopies.withLock { $0 = nil }
    }
}

/// One inode known to the kernel and how to reach its backing object: directories keep
/// an `O_PATH` descriptor (they are the `dirfd` of every name operation); everything else
/// keeps a file handle (`name_to_handle_at`) and is opened on demand, so the daemon does
/// not hold a descriptor per cached inode (a tree of 100,000 files would exhaust the
/// descriptor limit). Its `kind` holds what only files or only directories keep.
final class Node: Sendable {
    /// FUSE node id.
    let id: UInt64
    /// `O_PATH | O_NOFOLLOW` descriptor of a directory (or of an object on a filesystem
    /// without file handles); -1 when the node is reached by `handle`. Closed on deinit.
    let fd: Int32
    /// File handle of a non-directory, with `mountFD` to open it by.
    let handle: [UInt8]?
    let mountFD: Int32
    /// Backing device and inode numbers (the identity hard links share).
    let backingDev: UInt64
    let backingIno: UInt64
    /// What the node is, and the state of that kind.
    let kind: NodeKind

    init(id: UInt64, fd: Int32, handle: [UInt8]? = nil, mountFD: Int32 = -1, dev: UInt64, ino: UInt64, type: mode_t) {
        self.id = id
        self.fd = fd
        self.handle = handle
        self.mountFD = mountFD
        self.backingDev = dev
        self.backingIno = ino
        self.kind = NodeKind(type: type)
    }

    deinit { if fd >= 0 { close(fd) } }

    /// A regular file's state; nil for every other kind.
    var file: FileState? { if case .file(let f) = kind { return f }; return nil }
    /// A directory's state; nil for every other kind.
    var directory: DirectoryState? { if case .directory(let d) = kind { return d }; return nil }

    /// File type bits (`S_IFMT` part of st_mode).
    var type: mode_t {
        switch kind {
        case .file: return S_IFREG
        case .directory: return S_IFDIR
        case .other(let t): return t
        }
    }

    /// A new descriptor of the backing object opened with `flags` (`O_PATH` allowed,
    /// never following a final symlink); the caller closes it. -1 with errno on failure.
    /// The node's own descriptor first, where it keeps one (an unnamed file has its handle
    /// too, for identity, but cannot be reopened by it).
    func open(_ flags: Int32) -> Int32 {
        if fd < 0, let handle {
            return handle.withUnsafeBufferPointer { kbfs_open_handle(mountFD, $0.baseAddress, flags | O_CLOEXEC) }
        }
        return Glibc.open(procPath, flags | O_CLOEXEC)
    }

    /// Runs `body` with a descriptor of the backing object: the node's own `O_PATH` one, an
    /// open handle's, or an `O_PATH` one opened for the call (only `body`'s `fstat`,
    /// `AT_EMPTY_PATH` and `/proc/self/fd` uses work on all three).
    func withPathFD<R: Sendable>(_ body: (Int32) throws -> R) throws -> R {
        if fd >= 0 { return try body(fd) }
        if let r = try withOpenFD(body) { return r }
        let f = open(kbfs_O_PATH)
        guard f >= 0 else { throw FSError(errno == ESTALE ? ENOENT : errno) }
        defer { close(f) }
        return try body(f)
    }

    /// Runs `body` with the descriptor of one of the node's open handles (a real descriptor,
    /// not `O_PATH`: fchmod, fchown and futimens work on it), or returns nil when none is
    /// open. Saves opening the node by handle for the attribute changes that follow a create.
    func withOpenFD<R: Sendable>(_ body: (Int32) throws -> R) throws -> R? {
        guard let file else { return nil }
        return try file.openFDs.withLock { fds throws -> R? in
            guard let fd = fds.last else { return nil }
            return try body(fd)
        }
    }

    /// A handle of this node was opened on `fd`.
    fileprivate func handleOpened(_ fd: Int32) { file?.openFDs.withLock { $0.append(fd) } }

    /// A handle of this node is about to close `fd`.
    fileprivate func handleClosing(_ fd: Int32) {
        file?.openFDs.withLock { fds in if let i = fds.lastIndex(of: fd) { fds.remove(at: i) } }
    }

    /// True for regular files.
    var isRegular: Bool { file != nil }
    /// True for directories.
    var isDirectory: Bool { directory != nil }
    /// True for symbolic links.
    var isSymlink: Bool { type == S_IFLNK }

    /// Whether the object of a node kept by descriptor still has a name (nodes kept by handle:
    /// true; their handle tells a reused inode number apart).
    var stillLinked: Bool {
        guard fd >= 0 else { return true }
        var st = stat()
        return fstat(fd, &st) != 0 || st.st_nlink > 0
    }

    /// The `/proc/self/fd/N` path that reopens a node held by descriptor.
    var procPath: String { "/proc/self/fd/\(fd)" }
}

/// The table of nodes by FUSE id and by backing identity, with lookup counts.
final class NodeTable: Sendable {
    private struct Tables {
        var byID: [UInt64: (node: Node, lookups: UInt64)] = [:]
        var byBacking: [BackingID: UInt64] = [:]
        var nextID: UInt64 = 2
    }
    private struct BackingID: Hashable { let dev: UInt64; let ino: UInt64 }
    private let tables = Locked(Tables())

    /// The root node (FUSE id 1); never forgotten.
    let root: Node

    /// Whether the store's filesystem gives file handles (else every node keeps a descriptor).
    let handlesWork: Bool
    /// A real (not `O_PATH`) descriptor of the store's tree, for `open_by_handle_at`.
    private let mountFD: Int32

    init(rootFD: Int32) throws {
        var st = stat()
        guard fstat(rootFD, &st) == 0 else { throw KeybagError.system("fstat store", errno) }
        root = Node(id: 1, fd: rootFD, dev: UInt64(st.st_dev), ino: UInt64(st.st_ino), type: S_IFDIR)
        let mfd = Glibc.open("/proc/self/fd/\(rootFD)", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        mountFD = mfd
        var probe = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
        let len = kbfs_handle_of(rootFD, &probe, Int32(probe.count))
        handlesWork =
            mfd >= 0 && len > 0
            && probe.withUnsafeBufferPointer { p in
                let f = kbfs_open_handle(mfd, p.baseAddress, kbfs_O_PATH | O_CLOEXEC)
                if f >= 0 { close(f) }
                return f >= 0
            }
        tables.withLock { t in
            t.byID[1] = (root, 1)
            t.byBacking[BackingID(dev: root.backingDev, ino: root.backingIno)] = 1
        }
    }

    /// The node with a FUSE id, if the kernel still knows it.
    func node(_ id: UInt64) -> Node? {
        if id == 1 { return root }
        return tables.withLock { $0.byID[id]?.node }
    }

    /// A node the kernel knows by `id`, or ESTALE.
    func known(_ id: UInt64) throws -> Node {
        guard let n = node(id) else { throw FSError(ESTALE) }
        return n
    }

    /// The node of a backing object, if the kernel knows it (no lookup is counted).
    func node(dev: UInt64, ino: UInt64) -> Node? {
        tables.withLock { t in t.byBacking[BackingID(dev: dev, ino: ino)].flatMap { t.byID[$0]?.node } }
    }

    /// Registers a lookup of the backing object open as `fd` (stat `st`, an `O_PATH`
    /// descriptor this call takes over): returns the existing node or a new one, and counts
    /// one lookup. A new non-directory keeps a file handle and the descriptor is closed.
    func remember(fd: Int32, stat st: stat) -> Node {
        var handle: [UInt8]? = nil
        if (st.st_mode & S_IFMT) != S_IFDIR && handlesWork {
            var buf = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
            let len = kbfs_handle_of(fd, &buf, Int32(buf.count))
            if len > 0 {
                handle = Array(buf[0..<Int(len)])
                close(fd)
                return insert(fd: -1, handle: handle, stat: st)
            }
        }
        return insert(fd: fd, handle: nil, stat: st)
    }

    /// Registers a new object that keeps the descriptor `fd` (`O_PATH`, taken over): a file
    /// without a name (O_TMPFILE) cannot be reopened by handle. Its handle is kept too, so a
    /// lookup of the name `linkat` gives it later finds this node (and no other object
    /// that got the same inode number finds it).
    func remember(keeping fd: Int32, stat st: stat) -> Node {
        var buf = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
        let len = handlesWork ? kbfs_handle_of(fd, &buf, Int32(buf.count)) : 0
        return insert(fd: fd, handle: len > 0 ? Array(buf[0..<Int(len)]) : nil, stat: st)
    }

    /// Registers a lookup of a non-directory known by its file handle (stat `st`).
    func remember(handle: [UInt8], stat st: stat) -> Node { insert(fd: -1, handle: handle, stat: st) }

    /// The node of a backing object, new or existing; counts one lookup. A descriptor
    /// passed in belongs to the table afterwards.
    private func insert(fd nodeFD: Int32, handle: [UInt8]?, stat st: stat) -> Node {
        let key = BackingID(dev: UInt64(st.st_dev), ino: UInt64(st.st_ino))
        let type = st.st_mode & S_IFMT
        return tables.withLock { t -> Node in
            // The same object: same inode and, for handle nodes, the same handle (the
            // handle carries the generation, so a reused inode number is a new object).
            // A node kept by descriptor whose object is gone (a directory removed underneath,
            // whose inode number the backing filesystem gave to a new one) is not reused.
            if let id = t.byBacking[key], let entry = t.byID[id], entry.node.handle == handle, entry.node.type == type,
                handle != nil || entry.node.stillLinked
            {
                t.byID[id] = (entry.node, entry.lookups + 1)
                if nodeFD >= 0 && nodeFD != entry.node.fd { close(nodeFD) }
                return entry.node
            }
            let id = t.nextID
            t.nextID += 1
            let n = Node(id: id, fd: nodeFD, handle: handle, mountFD: mountFD, dev: key.dev, ino: key.ino, type: type)
            t.byID[id] = (n, 1)
            t.byBacking[key] = id
            return n
        }
    }

    /// The kernel forgot `count` lookups of `id`.
    func forget(_ id: UInt64, count: UInt64) {
        guard id != 1 else { return }
        tables.withLock { t in
            guard let entry = t.byID[id] else { return }
            if entry.lookups <= count {
                t.byID[id] = nil
                HeapTrimmer.shared.note()
                let key = BackingID(dev: entry.node.backingDev, ino: entry.node.backingIno)
                if t.byBacking[key] == id { t.byBacking[key] = nil }
            } else {
                t.byID[id] = (entry.node, entry.lookups - count)
            }
        }
    }

    /// Makes the next lookup of `node`'s backing object give a new node (what the kernel holds
    /// of this one is stale: a file rewritten underneath); the node lives until forgotten.
    func retire(_ node: Node) {
        tables.withLock { t in
            let key = BackingID(dev: node.backingDev, ino: node.backingIno)
            if t.byBacking[key] == node.id { t.byBacking[key] = nil }
        }
    }

    /// A snapshot of every node the kernel knows (for a store watcher that lost events).
    func allNodes() -> [Node] { tables.withLock { t in t.byID.values.map(\.node) } }

    /// A snapshot of all regular-file nodes with their state (for eviction on lock).
    func regularFiles() -> [(node: Node, file: FileState)] {
        tables.withLock { t in t.byID.values.compactMap { e in e.node.file.map { (e.node, $0) } } }
    }
}

/// An open file: its node and the backing descriptor used for content I/O.
final class OpenFile: Sendable {
    /// The inode.
    let node: Node
    /// The inode's file state (its key life).
    let file: FileState
    /// Backing descriptor (O_RDWR when the open allowed writing, else O_RDONLY).
    let fd: Int32
    /// Whether the open allowed writing.
    let writable: Bool
    /// Whether the kernel is told to bypass its page cache for this handle (class A: a
    /// write the daemon refuses must never sit in the cache where another reader finds it).
    let directIO: Bool

    init(node: Node, file: FileState, fd: Int32, writable: Bool, directIO: Bool = false) {
        self.node = node
        self.file = file
        self.fd = fd
        self.writable = writable
        self.directIO = directIO
        node.handleOpened(fd)
    }

    deinit {
        node.handleClosing(fd)
        close(fd)
    }
}

/// An open directory: a snapshot of its entries, taken by each read from offset 0 (the start
/// of a listing, or a rewinddir), so that names created since opendir appear.
final class DirHandle: Sendable {
    /// One listed entry: plaintext name and the backing entry it came from.
    struct Entry: Sendable { let name: String; let backing: String; let ino: UInt64; let type: UInt8 }
    /// The entries (without reserved names) of the last read from offset 0.
    private let snapshot = Locked<[Entry]?>(nil)

    /// The entries to serve a page from `offset`: those `list` finds now for a read from
    /// offset 0 (or when none were taken yet), else the snapshot the listing started with.
    func entries(from offset: Int, list: () throws -> [Entry]) rethrows -> [Entry] {
        try snapshot.withLock { s in
            if offset == 0 || s == nil { s = try list() }
            return s ?? []
        }
    }
}
