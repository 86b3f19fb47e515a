import CSystem
import Dispatch
import Glibc
import Synchronization

/// The store's overwrite journal while it is mounted (docs/FORMAT.md, "Overwrites"): every
/// sealed block that replaces bytes a backing file already has is first appended here and
/// written in place only once the journal is durable, so a power cut leaves each block whole
/// in one of the two places. Lock order: `appendLock`, `syncLock`, `applyLock`, `state`; the
/// journal takes no inode lock.
public final class OverwriteJournal: Sendable {
    /// The ring's size in new journal files.
    public static let defaultRingSize = 16 << 20

    /// The ring for a store of `bytes` (its file system's size; 0 when it reports none):
    /// 1/64 of it, between 256 KiB and `defaultRingSize`.
    public static func ringSize(storeBytes bytes: Int) -> Int {
        guard bytes > 0 else { return defaultRingSize }
        return min(defaultRingSize, max(256 << 10, bytes / 64 / 4096 * 4096))
    }
    /// Records larger than this are split (a quarter of the ring, at most what a reader takes).
    var largestRecord: Int { min(ringSize / 4, JournalRecord.largestData) }

    /// The journal file (read-write) and its ring's size.
    let fd: Int32
    let ringSize: Int
    /// The records' checksum key and the journal file's identity (from the superblock).
    let key: [UInt8]
    let identity: (ino: UInt64, stamp: UInt64)
    /// Held while a record is placed, while placed records are written out, and through a
    /// checkpoint; its value: the records placed and not yet written to the file.
    let appendLock = Locked<UnwrittenRecords>(UnwrittenRecords())
    /// Placed records are written out together once this many bytes wait (or at any sync).
    /// 0: each at once, into the store's page cache, so a killed daemon loses none (batched
    /// in memory, a ThreadSanitizer run lost unsynced class A writes across a lock and a
    /// restart; not diagnosed further).
    static let writeOutBytes = 0
    /// Held while the journal is made durable. (An Int, not Void: ThreadSanitizer reported
    /// an access race at the address of a zero-sized locked value, past the object's end.)
    let syncLock = Locked<Int>(0)
    /// Held while journaled blocks are written in place, and by readers of files with some.
    let applyLock = Locked<Int>(0)
    /// Positions, what is durable, the files with live records and the blocks not yet in place.
    let state: Locked<JournalState>
    /// `state.pendingBlocks`, readable without the lock (reads skip the journal when 0).
    let pendingCount = Atomic<Int>(0)
    /// Signalled when the ring's live part passes a quarter of it: the daemon's committer then
    /// retires records at once, on its own thread, long before a writer would have to.
    public let filling = DispatchSemaphore(value: 0)

    /// A journal whose superblock says `superblock` (its records replayed before).
    public init(fd: Int32, superblock: JournalSuperblock) {
        self.fd = fd
        ringSize = superblock.ringSize
        key = superblock.key
        identity = (superblock.journalIno, superblock.journalStamp)
        state = Locked(JournalState(tailPos: superblock.tailPos, tailSeq: superblock.tailSeq))
    }

    deinit {
        state.withLock { $0.closeFiles() }
        close(fd)
    }

    // MARK: appending

    /// Appends `bytes`, the sealed blocks of `file` from backing `offset` on, each `stride`
    /// bytes (the last may be shorter); they stay pending (read from here) until the journal
    /// is durable and they are written in place. `exactEnd`: see `JournalRecord.Kind`.
    public func append(
        _ file: JournaledFile, fd fileFD: Int32, offset: Int, bytes: UnsafeRawBufferPointer, stride: Int,
        pending: Bool = true, exactEnd: Bool = false
    ) throws {
        var at = 0
        let piece = max(stride, largestRecord / stride * stride)
        while at < bytes.count {
            let n = min(piece, bytes.count - at)
            let part = UnsafeRawBufferPointer(rebasing: bytes[at..<(at + n)])
            try appendRecord(
                exactEnd ? .exactEnd : .bytes, file, fd: fileFD, offset: offset + at, data: part, stride: stride,
                pending: pending)
            at += n
        }
    }

    /// Appends a record that makes `file`'s earlier records void.
    func appendVoid(_ file: JournaledFile, fd fileFD: Int32) throws {
        try appendRecord(.void, file, fd: fileFD, offset: 0, data: nil, stride: 1, pending: false)
    }

    /// Places one record at the head (after a checkpoint when the ring is full), writes it and
    /// notes its pending blocks.
    private func appendRecord(
        _ kind: JournalRecord.Kind, _ file: JournaledFile, fd fileFD: Int32, offset: Int,
        data: UnsafeRawBufferPointer?, stride: Int, pending: Bool
    ) throws {
        try appendLock.withLock { unwritten in
            try appendHolding(
                &unwritten, kind, file, fd: fileFD, offset: offset, data: data, stride: stride, pending: pending)
        }
    }

    /// `appendRecord` with `appendLock` held.
    func appendHolding(
        _ unwritten: inout UnwrittenRecords, _ kind: JournalRecord.Kind, _ file: JournaledFile, fd fileFD: Int32,
        offset: Int, data: UnsafeRawBufferPointer?, stride: Int, pending: Bool
    ) throws {
        let total = JournalRecord.encodedLength(pathLength: file.id.path.utf8.count, count: data?.count ?? 0)
        do {
            if !state.withLock({ $0.fits([total], ringSize: ringSize) }) { try checkpointHoldingAppend(&unwritten) }
            wrapIfNeeded(total, &unwritten)
            let (pos, seq) = state.withLock { ($0.headPos, $0.nextSeq) }
            let record = JournalRecord(kind: kind, seq: seq, file: file.id, offset: offset)
            let buffer = [UInt8](unsafeUninitializedCapacity: total) { b, n in  // every byte set by encode
                n = record.encode(into: UnsafeMutableRawBufferPointer(b), key: key, data: data)
            }
            unwritten.records.append((pos, buffer))
            unwritten.bytes += total
            let dataAt = JournalRecord.headerSize + file.id.path.utf8.count
            try state.withLock { st in
                try st.noteAppended(total, seq: seq, ino: file.id.key, fd: fileFD, data: kind != .void)
                if st.used >= ringSize / 4 && !st.fillingSignalled {
                    st.fillingSignalled = true
                    filling.signal()
                }
                guard pending, let count = data?.count else { return }
                var o = 0
                while o < count {
                    let n = min(stride, count - o)
                    let older = st.pending[file.id.key]?[offset + o]
                    let chunk = PendingBlock(seq: seq, bytes: buffer[(dataAt + o)..<(dataAt + o + n)], replacing: older)
                    if st.pending[file.id.key, default: [:]].updateValue(chunk, forKey: offset + o) == nil {
                        st.pendingBlocks += 1
                    }
                    pendingCount.store(st.pendingBlocks, ordering: .releasing)
                    o += n
                }
            }
            if unwritten.bytes >= Self.writeOutBytes { try writeOut(&unwritten) }
        }
    }

    /// Writes the placed records to the file (each run of adjacent ones with one `pwrite`);
    /// every record placed so far is then written.
    func writeOut(_ unwritten: inout UnwrittenRecords) throws {
        var i = 0
        let records = unwritten.records
        while i < records.count {
            var j = i
            while j + 1 < records.count && records[j + 1].pos == records[j].pos + records[j].bytes.count { j += 1 }
            let run = i == j ? records[i].bytes : records[i...j].flatMap { $0.bytes }
            try run.withUnsafeBytes {
                try FullIO.pwriteFull(fd, $0, offset: JournalSuperblock.ringStart + records[i].pos)
            }
            i = j + 1
        }
        unwritten.records.removeAll(keepingCapacity: true)
        unwritten.bytes = 0
        state.withLock { $0.writtenSeq = $0.nextSeq &- 1 }
    }

    /// Ends the ring's lap when `total` bytes do not fit before its end (a wrap record where
    /// there is room for one).
    private func wrapIfNeeded(_ total: Int, _ unwritten: inout UnwrittenRecords) {
        let (pos, seq) = state.withLock { ($0.headPos, $0.nextSeq) }
        guard pos + total > ringSize else { return }
        if ringSize - pos >= JournalRecord.encodedLength(pathLength: 0, count: 0) {
            var b = [UInt8](repeating: 0, count: JournalRecord.encodedLength(pathLength: 0, count: 0))
            let r = JournalRecord(kind: .wrap, seq: seq, file: JournalFileID(ino: 0, fileID: [], path: ""))
            _ = b.withUnsafeMutableBytes { r.encode(into: $0, key: key) }
            unwritten.records.append((pos, b))
            unwritten.bytes += b.count
            state.withLock { $0.nextSeq += 1 }
        }
        state.withLock { st in
            st.used += ringSize - st.headPos
            st.headPos = 0
        }
    }

    /// Writes the journal's dirty pages to the device and waits (no cache flush): a later
    /// flush of the same device, such as the commit that makes a file's new size durable,
    /// then carries them.
    public func waitWritten() throws {
        try appendLock.withLock { try writeOut(&$0) }
        try waitWrittenOut()
    }

    /// `waitWritten` for records already written out.
    func waitWrittenOut() throws {
        guard kbfs_write_and_wait(fd, Int64(JournalSuperblock.ringStart), Int64(ringSize)) == 0 else {
            throw KeybagError.system("sync_file_range journal", errno)
        }
    }

    // MARK: reading

    /// `ino`'s pending blocks (backing offset → sealed bytes), nil when it has none: a snapshot
    /// taken before the caller reads the store, so a block written in place meanwhile is either
    /// still in it or already in place when it reads (it is forgotten only after its in-place
    /// write returned), and no newer one can come while the caller holds the inode's lock.
    public func pending(of ino: JournalFileKey) -> [Int: PendingBlock]? {
        if pendingCount.load(ordering: .acquiring) == 0 { return nil }
        return state.withLock { $0.pending[ino] }
    }

    /// Whether `ino` has records with bytes the journal has not retired or made void.
    public func hasLiveData(_ ino: JournalFileKey) -> Bool { state.withLock { $0.files[ino]?.hasData ?? false } }

    /// Forgets the files of inode `ino` that no name reaches any more (deleted, or replaced by
    /// a rename): their pending blocks are dropped and their descriptors closed, so their space
    /// comes back. Their records stay in the ring; a replay finds no file for them.
    public func forgetDeleted(ino: UInt64) {
        guard state.withLock({ $0.files.keys.contains { $0.ino == ino } }) else { return }
        applyLock.withLock { _ in
            let gone = state.withLock { st -> [Int32] in
                var fds: [Int32] = []
                for key in Array(st.files.keys) where key.ino == ino {
                    guard let tracked = st.files[key] else { continue }
                    var s = stat()
                    guard fstat(tracked.fd, &s) == 0, s.st_nlink == 0 else { continue }
                    st.pendingBlocks -= st.pending[key]?.count ?? 0
                    st.pending[key] = nil
                    st.inPlace[key] = nil
                    st.files[key] = nil
                    fds.append(tracked.fd)
                }
                pendingCount.store(st.pendingBlocks, ordering: .releasing)
                return fds
            }
            for fd in gone { close(fd) }
        }
    }

    /// Notes a write in place into `key`'s file (its next `fsync` syncs it).
    public func noteInPlace(_ key: JournalFileKey) {
        state.withLock { $0.inPlace[key, default: (0, 0)].written += 1 }
    }

    /// Blocks not yet in place, in all files.
    public var pendingBlocks: Int { pendingCount.load(ordering: .acquiring) }
}

// MARK: durability
extension OverwriteJournal {
    /// Makes every record appended so far durable (one `fdatasync` for all waiting callers).
    public func sync() throws {
        try appendLock.withLock { try writeOut(&$0) }
        try syncWrittenOut()
    }

    /// `sync` for records already written out.
    func syncWrittenOut() throws {
        try syncLock.withLock { _ in
            let target = state.withLock { $0.writtenSeq }
            if state.withLock({ $0.syncedSeq >= target }) { return }
            guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync journal", errno) }
            state.withLock { $0.syncedSeq = max($0.syncedSeq, target) }
        }
    }

    /// The `fsync` of a file: its journaled blocks (the journal), and the file itself where it
    /// was written in place since its last sync or `dataOnly` is false. Both at once take one
    /// cache flush: the journal's pages are written first, and the file's sync flushes them.
    /// Blocks whose records are then durable go in place.
    public func fsync(_ file: JournaledFile, fd fileFD: Int32, dataOnly: Bool) throws {
        let ino = file.id.key
        let needJournal = state.withLock { st in (st.files[ino]?.lastSeq).map { $0 > st.syncedSeq } ?? false }
        let counts = state.withLock { $0.inPlace[ino] }
        let needFile = !dataOnly || counts.map { $0.written != $0.synced } ?? true
        if needJournal && needFile {
            try appendLock.withLock { try writeOut(&$0) }
            try syncLock.withLock { _ in
                let target = state.withLock { $0.writtenSeq }
                try waitWrittenOut()
                try Self.sync(fileFD, dataOnly: dataOnly)
                state.withLock { $0.syncedSeq = max($0.syncedSeq, target) }
            }
        } else if needJournal {
            try sync()
        } else if needFile {
            try Self.sync(fileFD, dataOnly: dataOnly)
        }
        if needFile {
            state.withLock { st in
                let seen = counts?.written ?? 0
                if let now = st.inPlace[ino] {
                    st.inPlace[ino]!.synced = max(now.synced, seen)
                } else {
                    if st.inPlace.count >= 65536 { st.inPlace = [:] }
                    st.inPlace[ino] = (0, 0)
                }
            }
        }
        if needJournal || pendingBlocks > 0 { try apply() }
    }

    /// fsync or fdatasync of a backing file.
    static func sync(_ fd: Int32, dataOnly: Bool) throws {
        guard (dataOnly ? fdatasync(fd) : Glibc.fsync(fd)) == 0 else { throw KeybagError.system("fsync", errno) }
    }

    /// Writes in place every pending block whose record is durable (file by file, in offset
    /// order), then forgets them, unless a newer version of one came meanwhile.
    public func apply() throws {
        try applyLock.withLock { _ in
            let work = state.withLock { $0.durablePending() }
            var failure: (any Error)?
            for file in work {
                var done: [(offset: Int, seq: UInt64)] = []
                done.reserveCapacity(file.blocks.count)
                for (offset, block) in file.blocks {
                    do {
                        try block.bytes.withUnsafeBytes { try FullIO.pwriteFull(file.fd, $0, offset: offset) }
                        done.append((offset, block.seq))
                    } catch { failure = failure ?? error }
                }
                state.withLock { st in
                    st.forgetApplied(file.key, done)
                    pendingCount.store(st.pendingBlocks, ordering: .releasing)
                }
            }
            if let failure { throw failure }
        }
    }

    /// Retires every record: the journal durable, its blocks in place and their files
    /// synced, then the superblock moves the tail to the head.
    public func checkpoint() throws {
        try appendLock.withLock { try checkpointHoldingAppend(&$0) }
    }

    /// `checkpoint` with `appendLock` held (its placed records are written out first).
    func checkpointHoldingAppend(_ unwritten: inout UnwrittenRecords) throws {
        try writeOut(&unwritten)
        try syncWrittenOut()
        try apply()
        // Under applyLock: `forgetDeleted` closes descriptors only while holding it.
        try applyLock.withLock { _ in
            let fds = state.withLock { $0.files.values.map(\.fd) }
            for f in fds where fdatasync(f) != 0 { throw KeybagError.system("fdatasync", errno) }
        }
        let sb = try state.withLock { st -> JournalSuperblock in
            guard st.pendingBlocks == 0 else { throw KeybagError.system("journal blocks not in place", EIO) }
            return superblock(tailPos: st.headPos, tailSeq: st.nextSeq)
        }
        try sb.encoded().withUnsafeBytes { try FullIO.pwriteFull(fd, $0, offset: 0) }
        guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync journal", errno) }
        state.withLock { st in
            st.closeFiles()
            st.tailPos = sb.tailPos
            st.tailSeq = sb.tailSeq
            st.used = 0
            st.checkpoints += 1
            st.fillingSignalled = false
        }
    }

    /// The superblock of this journal with its live part starting at `tailPos` (taken modulo
    /// the ring: a record that ends exactly at the ring's end leaves the head there).
    func superblock(tailPos: Int, tailSeq: UInt64) -> JournalSuperblock {
        var sb = JournalSuperblock(ringSize: ringSize, tailPos: tailPos % ringSize, tailSeq: tailSeq, key: key)
        (sb.journalIno, sb.journalStamp) = identity
        return sb
    }

    /// Retires the records whose blocks are durable in place, without holding appends for
    /// the flushes: the records up to now are made durable, their blocks go in place, the
    /// files with records are synced, and the superblock moves the tail past them; files
    /// with no record left are let go. A checkpoint meanwhile (the ring full) makes it a no-op.
    /// Run every `commitInterval` by the daemon, so no record outlives its blocks' durability
    /// for long (a file a sync engine replaces later never meets them at a replay).
    public func retire() throws {
        let mark = try appendLock.withLock { u -> (pos: Int, seq: UInt64, used: Int, epoch: Int)? in
            try writeOut(&u)
            return state.withLock { st in st.used == 0 ? nil : (st.headPos, st.nextSeq, st.used, st.checkpoints) }
        }
        guard let mark else { return }
        try syncWrittenOut()
        try apply()
        try applyLock.withLock { _ in
            let fds = state.withLock { $0.files.values.map(\.fd) }
            for f in fds where fdatasync(f) != 0 { throw KeybagError.system("fdatasync", errno) }
        }
        let sb = superblock(tailPos: mark.pos, tailSeq: mark.seq)
        let wrote = try appendLock.withLock { _ -> Bool in
            let current = state.withLock { st in st.checkpoints == mark.epoch && st.allInPlace(before: mark.seq) }
            guard current else { return false }
            try sb.encoded().withUnsafeBytes { try FullIO.pwriteFull(fd, $0, offset: 0) }
            return true
        }
        guard wrote else { return }
        guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync journal", errno) }
        appendLock.withLock { _ in
            applyLock.withLock { _ in
                let gone = state.withLock { st -> [Int32] in
                    guard st.checkpoints == mark.epoch else { return [] }
                    st.tailPos = sb.tailPos
                    st.tailSeq = sb.tailSeq
                    st.used -= mark.used
                    st.checkpoints += 1
                    st.fillingSignalled = false
                    return st.letGo(before: mark.seq)
                }
                for f in gone { close(f) }
            }
        }
    }

    /// Whether the ring holds live records.
    public var hasLiveRecords: Bool { state.withLock { $0.used > 0 } }

    /// Places nothing, but makes room now (a checkpoint, with `appendLock` held) for records of
    /// `totals` bytes to follow one another without one, so no checkpoint can come between
    /// them (a shrink's two records).
    func makeRoom(for totals: [Int], _ unwritten: inout UnwrittenRecords) throws {
        if !state.withLock({ $0.fits(totals, ringSize: ringSize) }) { try checkpointHoldingAppend(&unwritten) }
    }

    /// Before a cut or a punched hole in `file` (under its inode lock): where it has live
    /// records, its blocks are made durable in place and a void record ends them, so none is
    /// replayed over what the cut leaves or the file grows back into. Returns whether a void
    /// record was written (the caller then waits for it before the cut).
    @discardableResult
    public func endRecords(of file: JournaledFile, fd fileFD: Int32) throws -> Bool {
        let ino = file.id.key
        guard hasLiveData(ino) else { return false }
        try sync()
        try apply()
        guard fdatasync(fileFD) == 0 else { throw KeybagError.system("fdatasync", errno) }
        try appendVoid(file, fd: fileFD)
        return true
    }
}

/// Journal records placed in the ring but not yet written to its file (`appendLock`'s value).
struct UnwrittenRecords: Sendable {
    var records: [(pos: Int, bytes: [UInt8])] = []
    var bytes = 0
}
