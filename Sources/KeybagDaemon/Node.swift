import Glibc
import KeybagCore
import Synchronization

/// Per-file key state of a backing inode: its header, its file key while loaded, and how
/// many handles are open. Hard links share one `Node`, so they share one key.
struct FileKeyState {
    /// The parsed header, once read.
    var header: FileHeader?
    /// The file key, while loaded.
    var key: FileContentKey?
    /// Open handles on this inode.
    var openCount = 0
}

/// One inode known to the kernel: an `O_PATH` descriptor of the backing object, the
/// kernel's lookup count, and (for regular files) the key state under the I/O lock.
final class Node: Sendable {
    /// FUSE node id.
    let id: UInt64
    /// `O_PATH | O_NOFOLLOW` descriptor of the backing object; closed on deinit.
    let fd: Int32
    /// Backing device and inode numbers (the identity hard links share).
    let backingDev: UInt64
    let backingIno: UInt64
    /// File type bits (`S_IFMT` part of st_mode).
    let type: mode_t
    /// Holds the key state: reads share it, writes, truncation and eviction take it alone.
    let io: RWLocked<FileKeyState>
    /// Directories: the parsed `.kbfs-dir` (name IV, default class), once read.
    let dirMeta = Mutex<DirectoryMeta?>(nil)
    /// Directories: the inherited default class and the class generation it was computed in.
    let inherited = Mutex<(generation: UInt64, cls: ProtectionClass)?>(nil)

    init(id: UInt64, fd: Int32, dev: UInt64, ino: UInt64, type: mode_t) {
        self.id = id
        self.fd = fd
        self.backingDev = dev
        self.backingIno = ino
        self.type = type
        self.io = RWLocked(FileKeyState())
    }

    deinit { close(fd) }

    /// True for regular files.
    var isRegular: Bool { type == S_IFREG }
    /// True for directories.
    var isDirectory: Bool { type == S_IFDIR }

    /// The `/proc/self/fd/N` path that reopens the backing object.
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
    private let tables = Mutex(Tables())

    /// The root node (FUSE id 1); never forgotten.
    let root: Node

    init(rootFD: Int32) throws {
        var st = stat()
        guard fstat(rootFD, &st) == 0 else { throw KeybagError.system("fstat store", errno) }
        root = Node(id: 1, fd: rootFD, dev: UInt64(st.st_dev), ino: UInt64(st.st_ino), type: S_IFDIR)
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

    /// Registers a lookup of the backing object open as `fd` (stat `st`): returns the
    /// existing node (closing `fd`) or a new one, and counts one lookup.
    func remember(fd: Int32, stat st: stat) -> Node {
        let key = BackingID(dev: UInt64(st.st_dev), ino: UInt64(st.st_ino))
        return tables.withLock { t -> Node in
            if let id = t.byBacking[key], let entry = t.byID[id] {
                t.byID[id] = (entry.node, entry.lookups + 1)
                if entry.node.fd != fd { close(fd) }
                return entry.node
            }
            let id = t.nextID
            t.nextID += 1
            let n = Node(id: id, fd: fd, dev: key.dev, ino: key.ino, type: st.st_mode & S_IFMT)
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
                let key = BackingID(dev: entry.node.backingDev, ino: entry.node.backingIno)
                if t.byBacking[key] == id { t.byBacking[key] = nil }
            } else {
                t.byID[id] = (entry.node, entry.lookups - count)
            }
        }
    }

    /// A snapshot of all regular-file nodes (for eviction on lock).
    func regularFiles() -> [Node] {
        tables.withLock { t in t.byID.values.compactMap { $0.node.isRegular ? $0.node : nil } }
    }
}

/// An open file: its node and the backing descriptor used for content I/O.
final class FileHandle: Sendable {
    /// The inode.
    let node: Node
    /// Backing descriptor (O_RDWR when the open allowed writing, else O_RDONLY).
    let fd: Int32
    /// Whether the open allowed writing.
    let writable: Bool

    init(node: Node, fd: Int32, writable: Bool) {
        self.node = node
        self.fd = fd
        self.writable = writable
    }

    deinit { close(fd) }
}

/// An open directory: a snapshot of its entries taken at opendir.
final class DirHandle: Sendable {
    /// One listed entry: plaintext name and the backing entry it came from.
    struct Entry: Sendable { let name: String; let backing: String; let ino: UInt64; let type: UInt8 }
    /// The entries (without reserved names).
    let entries: [Entry]
    init(entries: [Entry]) { self.entries = entries }
}
