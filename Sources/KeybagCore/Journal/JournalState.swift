import Glibc

/// What the live journal knows, under its `state` lock: where its ring's live part starts and
/// ends, what is durable, the files with live records and the blocks not yet in place.
public struct JournalState: Sendable {
    /// A file with live records: a descriptor of its own (to write blocks in place and make
    /// them durable at a checkpoint, whatever the handles do) and its newest record.
    struct Tracked: Sendable {
        let fd: Int32
        var lastSeq: UInt64
        /// Whether a record with bytes came after the file's last void record.
        var hasData: Bool
    }

    var tailPos: Int, tailSeq: UInt64
    var headPos: Int, nextSeq: UInt64
    /// Ring bytes between the tail and the head (records and the ends of laps).
    var used = 0
    /// How many times the tail moved (a retirement begun before one is void).
    var checkpoints = 0
    /// Whether `OverwriteJournal.filling` was signalled since the tail last moved.
    var fillingSignalled = false
    /// Every record up to this one is written to the file.
    var writtenSeq: UInt64
    /// Every record up to this one is durable.
    var syncedSeq: UInt64
    var files: [JournalFileKey: Tracked] = [:]
    /// Per inode: backing offset → the newest journaled block there not yet in place.
    var pending: [JournalFileKey: [Int: PendingBlock]] = [:]
    var pendingBlocks = 0
    /// Per file: writes in place counted, and how many of them its last sync covered. A
    /// file missing here has an unknown past: its next `fsync` syncs it.
    var inPlace: [JournalFileKey: (written: UInt64, synced: UInt64)] = [:]

    init(tailPos: Int, tailSeq: UInt64) {
        self.tailPos = tailPos
        self.tailSeq = tailSeq
        headPos = tailPos
        nextSeq = tailSeq
        syncedSeq = tailSeq &- 1
        writtenSeq = tailSeq &- 1
    }

    /// Whether records of `totals` bytes, placed one after another, fit without overwriting
    /// live ones (counting the rest of a lap where one must wrap).
    func fits(_ totals: [Int], ringSize: Int) -> Bool {
        var head = headPos, taken = used
        for total in totals {
            if head + total > ringSize {
                taken += ringSize - head
                head = 0
            }
            taken += total
            head += total
        }
        return taken <= ringSize
    }

    /// Whether every block version staged by a record before `seq` is in place (none pending,
    /// and none replaced in memory by a newer one that is not).
    func allInPlace(before seq: UInt64) -> Bool {
        !pending.values.contains { $0.values.contains { $0.floor < seq } }
    }

    /// Stops tracking the files whose records all came before `seq` and that have no block
    /// pending; returns their descriptors, to be closed.
    mutating func letGo(before seq: UInt64) -> [Int32] {
        var fds: [Int32] = []
        for (key, tracked) in files where tracked.lastSeq < seq && pending[key] == nil {
            files[key] = nil
            fds.append(tracked.fd)
        }
        return fds
    }

    /// Notes a record written at the head; `ino`'s file is tracked from here on.
    mutating func noteAppended(_ total: Int, seq: UInt64, ino: JournalFileKey, fd: Int32, data: Bool) throws {
        headPos += total
        used += total
        nextSeq = seq + 1
        if files[ino] == nil {
            let own = fcntl(fd, F_DUPFD_CLOEXEC, 0)
            guard own >= 0 else { throw KeybagError.system("dup", errno) }
            files[ino] = Tracked(fd: own, lastSeq: seq, hasData: data)
        } else {
            files[ino]!.lastSeq = seq
            files[ino]!.hasData = data
        }
    }

    /// Every pending block whose record is durable, by file, in offset order.
    func durablePending() -> [(key: JournalFileKey, fd: Int32, blocks: [(Int, PendingBlock)])] {
        var out: [(key: JournalFileKey, fd: Int32, blocks: [(Int, PendingBlock)])] = []
        for (key, blocks) in pending {
            guard let fd = files[key]?.fd else { continue }
            var durable: [(Int, PendingBlock)] = []
            durable.reserveCapacity(blocks.count)
            for (offset, block) in blocks where block.seq <= syncedSeq { durable.append((offset, block)) }
            durable.sort { $0.0 < $1.0 }
            if !durable.isEmpty { out.append((key, fd, durable)) }
        }
        return out
    }

    /// Forgets the pending blocks of `key`'s file written in place (offset and the version
    /// written), unless a newer one replaced one meanwhile.
    mutating func forgetApplied(_ key: JournalFileKey, _ done: [(offset: Int, seq: UInt64)]) {
        guard var blocks = pending[key] else { return }
        pending[key] = nil  // uniquely referenced while it changes
        for (offset, seq) in done where blocks[offset]?.seq == seq {
            blocks[offset] = nil
            pendingBlocks -= 1
        }
        if !blocks.isEmpty { pending[key] = blocks }
    }

    /// Closes the descriptors of tracked files.
    mutating func closeFiles() {
        for f in files.values { close(f.fd) }
        files = [:]
    }
}
