/// A file's sealed blocks held somewhere safe before they go in place (the store's overwrite
/// journal, in Journal/): where a write's blocks go, where reads find those not yet in place,
/// and what a cut or a punched hole needs first. The content layer names only this; it never
/// calls the journal, and the journal never calls it.
public protocol StagedBlocks: Sendable {
    /// Stores `sealed`, the blocks for backing `offset` of `fd` (each `stride` bytes, the last
    /// may be shorter), whose backing size is `backingSize` before this write.
    func store(_ sealed: UnsafeRawBufferPointer, at offset: Int, fd: Int32, backingSize: Int, stride: Int) throws
    /// The blocks not yet in place (backing offset → sealed bytes), nil when there are none: a
    /// snapshot to take before the store is read (a block put in place meanwhile is then
    /// either still in it or already in place).
    func pendingBlocks() -> [Int: PendingBlock]?
    /// Before a punched hole or a cut: the file's staged blocks are made durable in place, so
    /// none is put back later over what follows.
    func settleBeforeCut(fd: Int32) throws
    /// Shrinks `fd` to `cut` backing bytes, with `newLast` (nil: none to re-seal) the re-sealed
    /// new last block at `blockStart`, so that a power cut at any point leaves the old block
    /// whole or the new one.
    func shrink(fd: Int32, to cut: Int, newLast: UnsafeRawBufferPointer?, at blockStart: Int) throws
}

/// A block not yet in place: its sealed bytes, the order it was staged in, and the oldest
/// version it replaced before that one went in place (`floor`; its own `seq` when none).
public struct PendingBlock: Sendable {
    public let seq: UInt64
    public let bytes: ArraySlice<UInt8>
    public let floor: UInt64

    public init(seq: UInt64, bytes: ArraySlice<UInt8>, replacing older: PendingBlock? = nil) {
        self.seq = seq
        self.bytes = bytes
        floor = min(older?.floor ?? seq, seq)
    }

    /// Lays `pending` over the sealed bytes just read from backing `offset` into `buffer`
    /// (`got` of them; blocks start every `stride` bytes after the header); returns the count
    /// with the pending blocks (they may reach further).
    public static func overlay(
        _ pending: [Int: PendingBlock], onto buffer: UnsafeMutableRawBufferPointer, offset: Int, got: Int,
        stride: Int
    ) -> Int {
        var got = got
        var candidates: [Int] = []
        if pending.count <= buffer.count / stride + 1 {
            candidates = pending.keys.filter { $0 < offset + buffer.count && $0 + stride > offset }
        } else {
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
