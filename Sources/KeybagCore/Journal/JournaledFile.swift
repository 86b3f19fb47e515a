import Glibc

/// One backing file whose overwrites the store's journal stages (`StagedBlocks`): the journal,
/// and the file's identity in records.
public struct JournaledFile: StagedBlocks {
    public let journal: OverwriteJournal
    public let id: JournalFileID

    public init(journal: OverwriteJournal, id: JournalFileID) {
        self.journal = journal
        self.id = id
    }

    /// Stores sealed bytes destined for backing `offset` of `fd`, whose backing size is
    /// `backingSize` before this write: the whole blocks that start inside the file (they
    /// replace bytes a power cut must not tear) go to the journal, the rest is written in
    /// place. When the write grows the file, the journal's pages are on the device first, so
    /// the commit that makes the new size durable carries the journaled blocks too.
    public func store(
        _ sealed: UnsafeRawBufferPointer, at offset: Int, fd: Int32, backingSize: Int, stride: Int
    ) throws {
        var journaled =
            offset >= backingSize ? 0 : min(sealed.count, (backingSize - offset + stride - 1) / stride * stride)
        // Blocks filling a hole (all zero bytes: a gap left by write-back that came out of
        // order) replace no sealed version; with no live record of the file, none is pending.
        if journaled > 0 && !journal.hasLiveData(id.key) && Self.allZero(fd, offset: offset, count: journaled) {
            journaled = 0
        }
        if journaled > 0 {
            try journal.append(
                self, fd: fd, offset: offset, bytes: UnsafeRawBufferPointer(rebasing: sealed[0..<journaled]),
                stride: stride)
        }
        let end = offset + sealed.count
        guard end > backingSize || journaled == 0 else { return }
        if journaled > 0 { try journal.waitWritten() }
        if journaled < sealed.count {
            try FullIO.pwriteFull(
                fd, UnsafeRawBufferPointer(rebasing: sealed[journaled...]), offset: offset + journaled)
        } else if ftruncate(fd, off_t(end)) != 0 {
            throw KeybagError.system("ftruncate", errno)
        }
        journal.noteInPlace(id.key)
    }

    /// Whether the backing bytes [offset, offset + count) are all zero (a hole, or never
    /// written), read in pieces of 64 KiB.
    static func allZero(_ fd: Int32, offset: Int, count: Int) -> Bool {
        withUnsafeTemporaryAllocation(byteCount: min(count, 1 << 16), alignment: 64) { buf in
            var at = 0
            while at < count {
                let n = pread(fd, buf.baseAddress!, min(buf.count, count - at), off_t(offset + at))
                guard n > 0 else { return n == 0 }
                // Byte 0 is zero and every byte equals the next (glibc's memcmp: vectorised, and
                // it stops at the first difference; sodium_is_zero always reads all, bytewise).
                let p = buf.baseAddress!
                guard p.load(as: UInt8.self) == 0, memcmp(p, p + 1, n - 1) == 0 else { return false }
                at += n
            }
            return true
        }
    }

    /// This file's blocks not yet in place.
    public func pendingBlocks() -> [Int: PendingBlock]? { journal.pending(of: id.key) }

    /// Before a punched hole or a cut: where the file has live records, its blocks are made
    /// durable in place and a void record ends them, on the device before the caller goes on.
    public func settleBeforeCut(fd: Int32) throws {
        if try journal.endRecords(of: self, fd: fd) { try journal.waitWritten() }
    }

    /// A shrink: earlier records ended (`settleBeforeCut`); the new last block goes out as an
    /// `exactEnd` record and reaches the device before the cut, the cut is synced, then the
    /// block goes out as a plain record and in place. Appends are held throughout (room for
    /// both records made first), so no checkpoint retires either midway.
    public func shrink(fd: Int32, to cut: Int, newLast: UnsafeRawBufferPointer?, at blockStart: Int) throws {
        guard let bytes = newLast else {
            try settleBeforeCut(fd: fd)
            guard ftruncate(fd, off_t(cut)) == 0 else { throw KeybagError.system("ftruncate", errno) }
            return journal.noteInPlace(id.key)
        }
        try journal.endRecords(of: self, fd: fd)
        let j = journal
        try j.appendLock.withLock { u in
            let total = JournalRecord.encodedLength(pathLength: id.path.utf8.count, count: bytes.count)
            try j.makeRoom(for: [total, total], &u)
            try j.appendHolding(
                &u, .exactEnd, self, fd: fd, offset: blockStart, data: bytes, stride: bytes.count, pending: false)
            try j.writeOut(&u)
            try j.waitWrittenOut()
            guard ftruncate(fd, off_t(cut)) == 0 else { throw KeybagError.system("ftruncate", errno) }
            guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync", errno) }
            try j.appendHolding(
                &u, .bytes, self, fd: fd, offset: blockStart, data: bytes, stride: bytes.count, pending: false)
            try j.writeOut(&u)
            try j.waitWrittenOut()
            try FullIO.pwriteFull(fd, bytes, offset: blockStart)
        }
        journal.noteInPlace(id.key)
    }

    /// Notes a write in place that went around the journal (its next `fsync` syncs the file).
    public func noteInPlace() { journal.noteInPlace(id.key) }

    /// The `fsync` of this file through the journal (`OverwriteJournal.fsync`).
    public func fsync(fd: Int32, dataOnly: Bool) throws { try journal.fsync(self, fd: fd, dataOnly: dataOnly) }
}
