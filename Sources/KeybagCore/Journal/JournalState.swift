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
    func durablePending() -> [(fd: Int32, ino: JournalFileKey, offset: Int, chunk: PendingBlock)] {
        var out: [(fd: Int32, ino: JournalFileKey, offset: Int, chunk: PendingBlock)] = []
        for (ino, blocks) in pending {
            guard let fd = files[ino]?.fd else { continue }
            for (offset, chunk) in blocks where chunk.seq <= syncedSeq { out.append((fd, ino, offset, chunk)) }
        }
        return out.sorted { ($0.ino.ino, $0.offset) < ($1.ino.ino, $1.offset) }
    }

    /// Forgets a pending block written in place, unless a newer one replaced it meanwhile.
    mutating func forgetApplied(ino: JournalFileKey, offset: Int, seq: UInt64) {
        guard pending[ino]?[offset]?.seq == seq else { return }
        pending[ino]![offset] = nil
        pendingBlocks -= 1
        if pending[ino]!.isEmpty { pending[ino] = nil }
    }

    /// Closes the descriptors of tracked files.
    mutating func closeFiles() {
        for f in files.values { close(f.fd) }
        files = [:]
    }
}
