import CFuse
import Glibc
import KeybagCore
import Synchronization

/// The store's folder of user xattr sets (`STORE/xattrs/<id>`, sealed under the volume key)
/// and how many it holds: loads, saves and drops sets by id. Read-modify-write of a set
/// runs under `update` (lock order: after a node's `io`, alone among the daemon's locks).
final class XattrStorage: Sendable {
    /// The folder's descriptor.
    let dirFD: Int32
    /// Seals and opens the sets.
    private let names: NameCipher
    /// Serialises read-modify-write of stored sets.
    private let updates = Locked(())
    /// Ids of sets written or removed since they were last made durable (an fsync of their
    /// object makes them durable, as an fsync of a file does its xattrs on ext4).
    private let unsynced = Locked(Set<String>())
    /// How many sets are stored (while none are, removals skip looking for one).
    private let count: Atomic<Int>
    /// Where notes go.
    private let log: EventLog

    init(dirFD: Int32, names: NameCipher, log: EventLog) {
        self.dirFD = dirFD
        self.names = names
        self.log = log
        count = Atomic(Self.countSets(dirFD))
    }

    /// Most bytes of user xattrs one object may hold (names and values); ENOSPC beyond.
    static let maxBytes = 256 * 1024

    /// Sets in the folder of `dirFD` (temporary files not counted).
    static func countSets(_ dirFD: Int32) -> Int {
        let fd = openat(dirFD, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0, let dir = fdopendir(fd) else { if fd >= 0 { close(fd) }; return 0 }
        defer { closedir(dir) }
        var n = 0
        while let ent = readdir(dir) {
            if DirectoryNames.entryName(ent).pointee != CChar(UInt8(ascii: ".")) { n += 1 }
        }
        return n
    }

    /// Counts the sets again (another writer added or removed some).
    func recount() { count.store(Self.countSets(dirFD), ordering: .relaxed) }

    /// Whether any set is stored.
    var holdsAny: Bool { count.load(ordering: .relaxed) > 0 }

    /// Whether a set is stored under `id`.
    func exists(_ id: String) -> Bool { faccessat(dirFD, id, F_OK, 0) == 0 }

    /// Runs a read-modify-write of sets.
    func update<R>(_ body: () throws -> R) rethrows -> R { try updates.withLock { _ in try body() } }

    /// The set stored under `id` (empty when none).
    func load(_ id: String) throws -> XattrSet {
        let fd = StoreFileOpen.regular(dirFD, id)
        if fd < 0 { if errno == ENOENT { return XattrSet() }; throw FSError(errno) }
        defer { close(fd) }
        var st = stat()
        try check(fstat(fd, &st))
        guard st.st_size <= 16 << 20 else { throw FSError(EIO) }
        var buf = [UInt8](repeating: 0, count: Int(st.st_size))
        let n = try buf.withUnsafeMutableBytes { try FullIO.preadFull(fd, $0, offset: 0) }
        // A set a power cut left empty or torn (its rename reached the disk before its bytes)
        // holds nothing that can be read: the object has no stored xattrs (fsck names it),
        // rather than every xattr call on it answering EIO.
        guard let set = try? XattrSet.opened(Array(buf[0..<n]), id: id, names: names) else {
            log("the xattr set \(id) does not authenticate (a power cut?): read as empty; fsck names it")
            return XattrSet()
        }
        return set
    }

    /// The value of xattr `name` in the set `id`; ENODATA when it has none.
    func value(_ id: String, name: String) throws -> [UInt8] {
        guard let v = try load(id).values[name] else { throw FSError(ENODATA) }
        return v
    }

    /// Sets xattr `name` in the set `id`, with XATTR_CREATE / XATTR_REPLACE semantics.
    func set(_ id: String, name: String, value: [UInt8], flags: Int32) throws {
        try update {
            var set = try load(id)
            let existed = !set.values.isEmpty
            let exists = set.values[name] != nil
            if flags & kbfs_XATTR_CREATE != 0 && exists { throw FSError(EEXIST) }
            if flags & kbfs_XATTR_REPLACE != 0 && !exists { throw FSError(ENODATA) }
            set.values[name] = value
            try save(id, set, existed: existed)
        }
    }

    /// Removes xattr `name` from the set `id`; ENODATA when it has none.
    func remove(_ id: String, name: String) throws {
        try update {
            var set = try load(id)
            guard set.values.removeValue(forKey: name) != nil else { throw FSError(ENODATA) }
            try save(id, set, existed: true)
        }
    }

    /// The names stored in the set `id`, sorted.
    func names(_ id: String) throws -> [String] { try load(id).values.keys.sorted() }

    /// Replaces the set under `id` atomically (removes it when empty); `existed`: whether
    /// one was stored before. Called inside `update`.
    func save(_ id: String, _ set: XattrSet, existed: Bool) throws {
        unsynced.withLock { _ = $0.insert(id) }
        if set.values.isEmpty {
            if unlinkat(dirFD, id, 0) == 0 {
                count.subtract(1, ordering: .relaxed)
            } else if errno != ENOENT {
                throw FSError(errno)
            }
            return
        }
        guard set.encode().count <= Self.maxBytes else { throw FSError(ENOSPC) }
        // Atomic by rename; not synced here (like xattrs on ext4: durable at the next sync, or
        // at an fsync of their object, `makeDurable`).
        try AtomicStoreFile.replace(dirFD: dirFD, id, try set.sealed(id: id, names: names), durable: false)
        if !existed { count.add(1, ordering: .relaxed) }
    }

    /// Whether any set changed since it was last made durable.
    var changedSinceSync: Bool { unsynced.withLock { !$0.isEmpty } }

    /// Makes the set stored under `id` (or its removal) durable, when it changed since it last
    /// was: the set's file, then the folder's entry for it (the rename that put it there).
    func makeDurable(_ id: String) throws {
        guard unsynced.withLock({ $0.remove(id) }) != nil else { return }
        do {
            let fd = StoreFileOpen.regular(dirFD, id)
            if fd >= 0 {
                defer { close(fd) }
                try check(fsync(fd))
            } else if errno != ENOENT {
                throw FSError(errno)
            }
            let dir = try check(openat(dirFD, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC))
            defer { close(dir) }
            try check(fsync(dir))
        } catch {
            unsynced.withLock { _ = $0.insert(id) }
            throw error
        }
    }

    /// Deletes the set stored under `id`, if any (its object is gone).
    func drop(_ id: String) {
        updates.withLock { _ in
            if unlinkat(dirFD, id, 0) == 0 { count.subtract(1, ordering: .relaxed) }
        }
    }
}
