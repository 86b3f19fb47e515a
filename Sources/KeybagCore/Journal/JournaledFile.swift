import CSystem
import Glibc

/// One backing file as the content layer writes it through the journal: the store's journal,
/// and the file's identity in records.
public struct JournaledFile: Sendable {
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
        var buf = [UInt8](repeating: 0, count: min(count, 1 << 16))
        var at = 0
        while at < count {
            let n = buf.withUnsafeMutableBytes {
                pread(fd, $0.baseAddress!, min($0.count, count - at), off_t(offset + at))
            }
            guard n > 0, buf[0..<n].allSatisfy({ $0 == 0 }) else { return n == 0 }
            at += n
        }
        return true
    }

    /// Lays this file's pending blocks over the sealed bytes just read from backing `offset`
    /// (`got` of them); returns the count with the pending blocks (they may reach further).
    public static func overlay(
        _ pending: [Int: JournalState.Chunk], onto buffer: UnsafeMutableRawBufferPointer, offset: Int, got: Int,
        stride: Int
    ) -> Int {
        var got = got
        var candidates: [Int] = []
        if pending.count <= buffer.count / stride + 1 {
            candidates = pending.keys.filter { $0 < offset + buffer.count && $0 + stride > offset }
        } else {  // blocks start every `stride` bytes after the header
            var b = FileHeader.size + max(0, offset - FileHeader.size) / stride * stride
            while b < offset + buffer.count {
                candidates.append(b)
                b += stride
            }
        }
        for start in candidates {
            guard let chunk = pending[start] else { continue }
            let lo = max(start, offset), hi = min(start + chunk.bytes.count, offset + buffer.count)
            guard hi > lo else { continue }
            chunk.bytes.withUnsafeBytes { src in
                (buffer.baseAddress! + (lo - offset)).copyMemory(
                    from: src.baseAddress! + (lo - start), byteCount: hi - lo)
            }
            got = max(got, hi - offset)
        }
        return got
    }
}
