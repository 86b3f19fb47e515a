import CSystem
import Foundation
import Glibc

/// Moves every file of an unmounted store to the newest key set: each header's file key is
/// rewrapped (same key, same class, no content rewritten) for that set's class key, into the
/// slot not in use; then the old slots are erased. Crash-safe and resumable: the new slots of a
/// batch are made durable (syncfs) before their old slots are erased, a header with both slots
/// opens under the newer, and a second run finishes what a cut one left (docs/FORMAT.md, "Key
/// sets"). Hard links share one header and are done once.
public struct StoreRewrap {
    /// What one run did.
    public struct Result: Sendable, Equatable {
        /// Files rewrapped to the newest set.
        public var rewrapped = 0
        /// Files already on it.
        public var current = 0
        /// Headers that do not parse or open (left alone; `fsck` names them).
        public var skipped = 0

        /// Nothing done yet.
        public init() {}
    }

    /// Files per batch: their new slots are synced together, then their old slots erased.
    static let batch = 512

    private let data: String
    private let keys: StoreKeys
    private var result = Result()
    /// Files whose new slot is written but not yet durable: descriptor and the old slot.
    private var pending: [(fd: Int32, oldSlot: Int)] = []
    private var seen = Set<UInt64>()
    /// Called every 1,000 files with the count so far.
    private let progress: ((Int) -> Void)?

    /// A run over `storePath`'s tree with every key of the store (`keys.current` the target set).
    public init(storePath: String, keys: StoreKeys, progress: ((Int) -> Void)? = nil) {
        data = storePath + "/" + Keybag.dataDirName
        self.keys = keys
        self.progress = progress
    }

    /// Rewraps the whole tree.
    public mutating func run() throws -> Result {
        let fd = open(data, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { throw KeybagError.system("cannot open \(data)", errno) }
        defer { close(fd) }
        try walk(fd)
        try flush(fd)
        guard kbfs_syncfs(fd) == 0 else { throw KeybagError.system("syncfs \(data)", errno) }
        return result
    }

    /// One directory and everything below it (`StoreTree`): every regular file once.
    private mutating func walk(_ dirFD: Int32) throws {
        try StoreTree.walk(
            dirFD, path: Keybag.dataDirName, (), enter: { _, _ in },
            visit: { folder, e, _ -> Void? in
                switch e.kind {
                case .directoryMeta, .storeFile, .sideFile, .syncEngine: return nil
                case .name, .longName, .foreign: break
                }
                if e.isFolder { return () }
                guard e.isRegularFile, let st = e.stat, seen.insert(UInt64(st.st_ino)).inserted else { return nil }
                try file(folder.fd, e.name)
                if pending.count >= Self.batch { try flush(folder.fd) }
                let done = result.rewrapped + result.current + result.skipped
                if done % 1000 == 0 { progress?(done) }
                return nil
            },
            unopenable: { _, _, e in throw KeybagError.system("cannot open a folder of the store", e) })
    }

    /// One file: its superseded slot erased, or its header rewrapped into the other slot.
    private mutating func file(_ dirFD: Int32, _ name: String) throws {
        let fd = openat(dirFD, name, O_RDWR | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { result.skipped += 1; return }
        guard let (h, superseded) = try? HeaderSlots.read(fd: fd) else {
            close(fd); result.skipped += 1; return
        }
        if Int(h.keySet) == keys.current {
            if let superseded { pending.append((fd, superseded)) } else { close(fd) }
            result.current += 1
            return
        }
        guard let old = classKey(h.protectionClass, set: Int(h.keySet)), let fileKey = try? h.unwrap(using: old) else {
            close(fd); result.skipped += 1; return
        }
        defer { fileKey.wipe() }
        let next = try h.rewrapped(
            fileKey: fileKey, to: h.protectionClass, using: classKey(h.protectionClass, set: keys.current)!,
            keySet: UInt8(keys.current))
        let slot = next.encodeSlot()
        try slot.withUnsafeBytes { try FullIO.pwriteFull(fd, $0, offset: next.slotOffset) }
        pending.append((fd, h.slot))
        result.rewrapped += 1
    }

    /// Makes the pending new slots durable, then erases the old ones (durable at the next flush or the end).
    private mutating func flush(_ anyFD: Int32) throws {
        guard !pending.isEmpty else { return }
        defer { pending.removeAll() }
        guard kbfs_syncfs(anyFD) == 0 else {
            for p in pending { close(p.fd) }
            throw KeybagError.system("syncfs \(data)", errno)
        }
        Failpoint.rewrapBetweenSlots.hit()
        let zeros = [UInt8](repeating: 0, count: FileHeader.slotSize)
        var failure: Error?
        for p in pending {
            do {
                try zeros.withUnsafeBytes {
                    try FullIO.pwriteFull(p.fd, $0, offset: p.oldSlot * FileHeader.slotSize)
                }
            } catch {
                failure = failure ?? error
            }
            close(p.fd)
        }
        if let failure { throw failure }
    }

    /// What wraps a file key of class `cls` in key set `n`; nil for a set this store lacks.
    private func classKey(_ cls: ProtectionClass, set n: Int) -> FileHeader.ClassKey? {
        guard n >= 0, n < keys.sets.count, n < keys.classD.count else { return nil }
        let s = keys.sets[n]
        switch cls {
        case .complete: return .symmetric(s.classA)
        case .completeUnlessOpen: return .classBPrivate(s.classBSecret, s.classBPublic)
        case .completeUntilFirstUserAuthentication: return .symmetric(s.classC)
        case .none: return .symmetric(keys.classD[n])
        }
    }

}
