import CCrypto
import CSystem
import Dispatch
import Glibc
import Synchronization

/// Reads and writes plaintext ranges of one encrypted backing file: offset math, the
/// read-modify-write of partial blocks, holes and truncation. Callers serialise writes
/// and truncations of one file (the daemon holds the inode's I/O lock).
public struct EncryptedContent: Sendable {
    /// The store's block layout.
    public let layout: BlockLayout

    public init(layout: BlockLayout) { self.layout = layout }

    /// Plaintext size of the backing file behind `fd`, from its size alone. A backing file cut
    /// inside its header (by a store writer, under a file already open) is damage, not EOF.
    public func plainSize(fd: Int32) throws -> Int {
        var st = stat()
        guard fstat(fd, &st) == 0 else { throw KeybagError.system("fstat", errno) }
        guard st.st_size == 0 || st.st_size >= FileHeader.size else {
            throw KeybagError.corrupt("the file's header was cut to \(st.st_size) bytes")
        }
        return layout.plainSize(backingSize: Int(st.st_size))
    }

    /// Blocks in one read from which the decryption is split over two threads (256 KiB).
    static let parallelBlocks = 64

    /// Reads up to `out.count` plaintext bytes at `offset`; returns the count (0 at EOF).
    /// A read of `parallelBlocks` blocks or more decrypts its two halves on two threads.
    /// With `journal`, blocks not yet in place are read from there.
    public func read(
        fd: Int32, key: FileContentKey, offset: Int, into out: UnsafeMutableRawBufferPointer,
        journal: (any StagedBlocks)? = nil
    ) throws -> Int {
        defer { kbfs_scrub_stack() }  // cipher locals left below this frame
        return try read(fd: fd, key: key, offset: offset, into: out, pending: journal?.pendingBlocks())
    }

    /// `read`, with the file's pending journaled blocks laid over what the backing file holds.
    private func read(
        fd: Int32, key: FileContentKey, offset: Int, into out: UnsafeMutableRawBufferPointer,
        pending: [Int: PendingBlock]?
    ) throws -> Int {
        let size = try plainSize(fd: fd)
        guard offset < size, out.count > 0 else { return 0 }
        let range = PlainRange(offset: offset, end: min(offset + out.count, size))
        let first = range.blocks.lowerBound, last = range.blocks.upperBound
        let sealed = layout.cipherRange(of: range.blocks, inFileOf: size)
        return try ScratchBuffers.shared.withBlock(sealed.count) { cbuf, plain in
            var got = try FullIO.preadFull(fd, cbuf, offset: sealed.lowerBound)
            if let pending {
                got = PendingBlock.overlay(
                    pending, onto: UnsafeMutableRawBufferPointer(rebasing: cbuf[0..<sealed.count]),
                    offset: sealed.lowerBound, got: got, stride: layout.cipherBlockSize)
            }
            let span = BlockSpan(first: first, range: range, size: size, got: got)
            guard last - first + 1 >= Self.parallelBlocks else {
                return try openBlocks(first...last, of: span, key: key, cbuf: cbuf, out: out, plain: plain).written
            }
            let mid = first + (last - first + 1) / 2
            let halves = UnsafeMutableBufferPointer<Result<(written: Int, whole: Bool), any Error>>.allocate(
                capacity: 2)
            defer { halves.deallocate() }
            let shared = SplitRead(cbuf: cbuf, out: out, plain: plain, results: halves)
            DispatchQueue.concurrentPerform(iterations: 2) { i in
                defer { kbfs_scrub_stack() }
                let r = Result {
                    if i == 0 {
                        return try openBlocks(
                            first...(mid - 1), of: span, key: key, cbuf: shared.cbuf, out: shared.out,
                            plain: shared.plain)
                    }
                    return try ScratchBuffers.shared.withBlock(0) { _, plain2 in
                        try openBlocks(
                            mid...last, of: span, key: key, cbuf: shared.cbuf, out: shared.out, plain: plain2)
                    }
                }
                (shared.results.baseAddress! + i).initialize(to: r)
            }
            defer { _ = halves.baseAddress!.deinitialize(count: 2) }
            let low = try halves[0].get(), high = try halves[1].get()
            return low.whole ? low.written + high.written : low.written
        }
    }

    /// The buffers of one read shared by its two decrypting threads.
    // @unchecked: the threads read `cbuf` only, write disjoint block ranges of `out` and
    // one result slot each, and `concurrentPerform` returns only after both are done.
    struct SplitRead: @unchecked Sendable {
        let cbuf: UnsafeMutableRawBufferPointer, out: UnsafeMutableRawBufferPointer,
            plain: UnsafeMutableRawBufferPointer
        let results: UnsafeMutableBufferPointer<Result<(written: Int, whole: Bool), any Error>>
    }

    /// The geometry of one read: its first block, plaintext range, file size and how many
    /// ciphertext bytes the `pread` returned.
    struct BlockSpan: Sendable {
        let first: Int, range: PlainRange, size: Int, got: Int
    }

    /// Decrypts `blocks` of a read (the ciphertext of block `span.first` at the start of
    /// `cbuf`) into their places in `out`; whole blocks go straight into `out`, partial ones
    /// through `plain`. Returns the bytes written and whether every block was there in full
    /// (a file truncated underneath the read ends it early).
    private func openBlocks(
        _ blocks: ClosedRange<Int>, of span: BlockSpan, key: FileContentKey, cbuf: UnsafeMutableRawBufferPointer,
        out: UnsafeMutableRawBufferPointer, plain: UnsafeMutableRawBufferPointer
    ) throws -> (written: Int, whole: Bool) {
        let fileLast = BlockLayout.lastBlock(ofSize: span.size)
        var written = 0
        var markedRun = 0
        for b in blocks {
            let bLen = BlockLayout.length(ofBlock: b, inFileOf: span.size)
            let rel = (b - span.first) * layout.cipherBlockSize
            guard rel + bLen + layout.overhead <= span.got else { return (written, false) }  // truncated underneath us
            let sealed = UnsafeRawBufferPointer(rebasing: cbuf[rel..<(rel + bLen + layout.overhead)])
            let part = span.range.part(ofBlock: b)
            let at = part.atInRange
            if part.coversAll(ofLength: bLen) {
                // The whole block is wanted: decrypt straight into the reply.
                let n = try key.open(
                    sealed, block: UInt64(b), last: b == fileLast, markedRun: &markedRun,
                    into: UnsafeMutableRawBufferPointer(rebasing: out[at..<(at + bLen)]))
                written += n
                if n < bLen { return (written, false) }
                continue
            }
            let n = try key.open(sealed, block: UInt64(b), last: b == fileLast, markedRun: &markedRun, into: plain)
            let hi = min(part.hi, n)
            guard hi > part.lo else { return (written, false) }
            (out.baseAddress! + at).copyMemory(from: plain.baseAddress! + part.lo, byteCount: hi - part.lo)
            written += hi - part.lo
        }
        return (written, true)
    }

    /// Writes `data` at plaintext `offset`, extending the file (with holes) as needed.
    /// A full old last block stays as it is when the file grows (its end mark is allowed
    /// inside the file); a partial one is re-sealed full first: in the same `pwrite` as the
    /// new data when adjacent, else before it (so a crash in between leaves a cut end that
    /// `fsck` re-seals, never a block of the wrong length).
    public func write(
        fd: Int32, key: FileContentKey, offset: Int, data: UnsafeRawBufferPointer, journal: (any StagedBlocks)? = nil
    ) throws {
        var noneKnown = 0
        try write(fd: fd, key: key, offset: offset, data: data, allocated: &noneKnown, journal: journal)
    }

    /// `write`, given `allocated`: how many backing bytes from the file's start are known to
    /// hold no hole (0: none known). A write whose sealed blocks all lie below it overwrites
    /// blocks the file has, and reserves nothing first; a reservation that continues the
    /// known part moves it on. Returns whether space was reserved. With `journal`, sealed
    /// blocks that replace bytes the file has go through the store's journal
    /// (`StagedBlocks.store`).
    @discardableResult
    public func write(
        fd: Int32, key: FileContentKey, offset: Int, data: UnsafeRawBufferPointer, allocated: inout Int,
        journal: (any StagedBlocks)? = nil
    ) throws -> Bool {
        defer { kbfs_scrub_stack() }  // cipher locals left below this frame
        guard data.count > 0 else { return false }
        let (size, backing) = try sizes(fd: fd)
        // What is known holds only within the file as it is now (another writer may have cut it).
        allocated = min(allocated, layout.backingSize(plainSize: size))
        let range = PlainRange(offset: offset, end: offset + data.count)
        let newSize = max(size, range.end)
        let oldLast = BlockLayout.lastBlock(ofSize: size), newLast = BlockLayout.lastBlock(ofSize: newSize)
        let dataFirst = range.blocks.lowerBound, dataLast = range.blocks.upperBound
        let oldLastGrows = oldLast >= 0 && oldLast < dataFirst && size % BlockLayout.plainBlockSize != 0
        // A full disk must refuse the write before any byte of it lands: a short pwrite
        // (at the end, or into a hole) would leave a torn block that reads as damage.
        var reserved = false
        if oldLastGrows {
            reserved = try reserve(fd: fd, blocks: oldLast...oldLast, newSize: newSize, allocated: &allocated)
        }
        reserved =
            try reserve(fd: fd, blocks: dataFirst...dataLast, newSize: newSize, allocated: &allocated) || reserved
        if oldLastGrows && oldLast < dataFirst - 1 {
            let sink = BlockSink(fd: fd, journal: journal, backingSize: backing)
            try sealAndWrite(
                fd: fd, key: key, blocks: oldLast...oldLast, size: size, newSize: newSize, newLast: newLast,
                data: NewData(range: nil, bytes: nil), sink: sink)
        }
        let first = oldLastGrows && oldLast == dataFirst - 1 ? oldLast : dataFirst
        // The backing size as it is now: the old last block's growth above changed it.
        let now = oldLastGrows && oldLast < dataFirst - 1 ? try sizes(fd: fd).backing : backing
        let sink = BlockSink(fd: fd, journal: journal, backingSize: now)
        try sealAndWrite(
            fd: fd, key: key, blocks: first...dataLast, size: size, newSize: newSize, newLast: newLast,
            data: NewData(range: range, bytes: data), sink: sink)
        return reserved
    }

    /// Reserves the backing space of `blocks` (sealed for a file of `newSize` bytes) without
    /// changing the file's size: ENOSPC or EDQUOT are thrown; a file system that cannot
    /// reserve (EOPNOTSUPP) is written without. Nothing is reserved below `allocated` (the
    /// file's start known to hold no hole); a reservation that continues it moves it on.
    /// Returns whether it asked the store to reserve.
    private func reserve(fd: Int32, blocks: ClosedRange<Int>, newSize: Int, allocated: inout Int) throws -> Bool {
        let sealed = layout.cipherRange(of: blocks, inFileOf: newSize)
        guard !sealed.isEmpty, sealed.upperBound > allocated else { return false }
        if kbfs_reserve(fd, Int64(sealed.lowerBound), Int64(sealed.count)) != 0 {
            if errno == ENOSPC || errno == EDQUOT { throw KeybagError.system("fallocate", errno) }
            return true
        }
        if sealed.lowerBound <= allocated { allocated = sealed.upperBound }
        return true
    }

    /// New bytes of a write at a plaintext offset (none: only old blocks are re-sealed).
    // @unchecked: the bytes are read only, by the threads of one write, while it runs.
    struct NewData: @unchecked Sendable {
        let range: PlainRange?, bytes: UnsafeRawBufferPointer?
        /// The slice of new bytes for block b: start and end within the block, and the bytes.
        func slice(_ b: Int) -> (Int, Int, UnsafeRawPointer)? {
            guard let range, let base = bytes?.baseAddress else { return nil }
            let part = range.part(ofBlock: b)
            return part.count > 0 ? (part.lo, part.hi, base + part.atInRange) : nil
        }
    }

    /// Seals the new contents of `blocks` for a file growing (or staying) from `size` to
    /// `newSize` and writes them with one `pwrite`: the new bytes where `data` has them, the
    /// old plaintext elsewhere, zero-extended to the block's new length. From
    /// `parallelBlocks` blocks on, the two halves are sealed on two threads.
    private func sealAndWrite(
        fd: Int32, key: FileContentKey, blocks: ClosedRange<Int>, size: Int, newSize: Int, newLast: Int,
        data: NewData, sink: BlockSink
    ) throws {
        let geometry = SealSpan(first: blocks.lowerBound, size: size, newSize: newSize, newLast: newLast)
        try ScratchBuffers.shared.withBlock(blocks.count * layout.cipherBlockSize) { out, plain in
            var outLen = 0
            if blocks.count < Self.parallelBlocks {
                outLen = try sealBlocks(
                    blocks, of: geometry, fd: fd, key: key, data: data, out: out, plain: plain, journal: sink.journal)
            } else {
                let mid = blocks.lowerBound + blocks.count / 2
                let lengths = UnsafeMutableBufferPointer<Result<Int, any Error>>.allocate(capacity: 2)
                defer { lengths.deallocate() }
                let shared = SplitWrite(out: out, plain: plain, results: lengths)
                DispatchQueue.concurrentPerform(iterations: 2) { i in
                    defer { kbfs_scrub_stack() }
                    let r = Result {
                        if i == 0 {
                            return try sealBlocks(
                                blocks.lowerBound...(mid - 1), of: geometry, fd: fd, key: key, data: data,
                                out: shared.out, plain: shared.plain, journal: sink.journal)
                        }
                        return try ScratchBuffers.shared.withBlock(0) { _, plain2 in
                            try sealBlocks(
                                mid...blocks.upperBound, of: geometry, fd: fd, key: key, data: data, out: shared.out,
                                plain: plain2, journal: sink.journal)
                        }
                    }
                    (shared.results.baseAddress! + i).initialize(to: r)
                }
                defer { _ = lengths.baseAddress!.deinitialize(count: 2) }
                outLen = try lengths[0].get() + lengths[1].get()
            }
            try sink.put(
                UnsafeRawBufferPointer(rebasing: out[0..<outLen]), at: layout.cipherOffset(ofBlock: blocks.lowerBound),
                stride: layout.cipherBlockSize)
        }
    }

    /// The geometry of one sealing write: its first block and the file's sizes before and after.
    struct SealSpan: Sendable {
        let first: Int, size: Int, newSize: Int, newLast: Int
    }

    /// The buffers of one write shared by its two sealing threads.
    // @unchecked: the threads write disjoint block ranges of `out` and one result slot
    // each, and `concurrentPerform` returns only after both are done.
    struct SplitWrite: @unchecked Sendable {
        let out: UnsafeMutableRawBufferPointer, plain: UnsafeMutableRawBufferPointer
        let results: UnsafeMutableBufferPointer<Result<Int, any Error>>
    }

    /// Seals `blocks` into their places in `out` (every block before the file's last is
    /// whole, so block b starts at (b - first) cipher blocks); returns the bytes sealed.
    /// A block the new bytes cover whole is sealed straight from them.
    private func sealBlocks(
        _ blocks: ClosedRange<Int>, of span: SealSpan, fd: Int32, key: FileContentKey, data: NewData,
        out: UnsafeMutableRawBufferPointer, plain: UnsafeMutableRawBufferPointer, journal: (any StagedBlocks)?
    ) throws -> Int {
        let oldLast = BlockLayout.lastBlock(ofSize: span.size)
        var outLen = 0
        for b in blocks {
            let existing = BlockLayout.length(ofBlock: b, inFileOf: span.size)
            let newLen = BlockLayout.length(ofBlock: b, inFileOf: span.newSize)
            let at = (b - span.first) * layout.cipherBlockSize
            let dst = UnsafeMutableRawBufferPointer(rebasing: out[at..<(at + newLen + layout.overhead)])
            let slice = data.slice(b)
            if let (lo, hi, src) = slice, lo == 0, hi == newLen {
                try key.seal(
                    UnsafeRawBufferPointer(start: src, count: newLen), block: UInt64(b), last: b == span.newLast,
                    into: dst)
                outLen += newLen + layout.overhead
                continue
            }
            if existing > 0 && !(slice.map { $0.0 == 0 && $0.1 >= existing } ?? false) {
                let n = try readBlock(
                    fd: fd, key: key, block: b, length: existing, last: b == oldLast, into: plain, journal: journal)
                guard n == existing else { throw KeybagError.corrupt("block \(b) short") }
            }
            if newLen > existing { memset(plain.baseAddress! + existing, 0, newLen - existing) }
            if let (lo, hi, src) = slice { (plain.baseAddress! + lo).copyMemory(from: src, byteCount: hi - lo) }
            try key.seal(
                UnsafeRawBufferPointer(rebasing: plain[0..<newLen]), block: UInt64(b), last: b == span.newLast,
                into: dst)
            outLen += newLen + layout.overhead
        }
        return outLen
    }

    /// How every block of the file checks (`fsck`).
    public func blockChecks(fd: Int32, key: FileContentKey) throws -> [FileContentKey.BlockCheck] {
        defer { kbfs_scrub_stack() }  // cipher locals left below this frame
        let size = try plainSize(fd: fd)
        let last = BlockLayout.lastBlock(ofSize: size)
        guard last >= 0 else { return [] }
        return try ScratchBuffers.shared.withBlock(layout.cipherBlockSize) { sealed, plain in
            try (0...last).map { b in
                let len = BlockLayout.length(ofBlock: b, inFileOf: size) + layout.overhead
                let got = try FullIO.preadFull(
                    fd, UnsafeMutableRawBufferPointer(rebasing: sealed[0..<len]),
                    offset: layout.cipherOffset(ofBlock: b))
                guard got == len else { return .damaged }
                return key.check(
                    UnsafeRawBufferPointer(rebasing: sealed[0..<len]), block: UInt64(b), last: b == last, scratch: plain
                )
            }
        }
    }

    /// Re-seals block `block` (authentic under end mark `from`) with end mark `to`, same
    /// length: the repair of an end mark an interrupted write or truncate left wrong.
    public func resealEndMark(fd: Int32, key: FileContentKey, block: Int, from: Bool, to: Bool) throws {
        defer { kbfs_scrub_stack() }  // cipher locals left below this frame
        let size = try plainSize(fd: fd)
        let len = BlockLayout.length(ofBlock: block, inFileOf: size)
        try ScratchBuffers.shared.withBlock(len + layout.overhead) { sealed, plain in
            let n = try readBlock(fd: fd, key: key, block: block, length: len, last: from, into: plain)
            guard n == len else { throw KeybagError.corrupt("block \(block) short") }
            try key.seal(UnsafeRawBufferPointer(rebasing: plain[0..<len]), block: UInt64(block), last: to, into: sealed)
            try FullIO.pwriteFull(fd, UnsafeRawBufferPointer(sealed), offset: layout.cipherOffset(ofBlock: block))
        }
    }

    /// Cuts the backing file after `blocks` whole blocks (fsck's repair of a torn tail; the
    /// caller then seals the new end).
    public func cut(fd: Int32, afterBlocks blocks: Int) throws {
        guard ftruncate(fd, off_t(layout.cipherOffset(ofBlock: blocks))) == 0 else {
            throw KeybagError.system("ftruncate", errno)
        }
    }

    /// Decrypts block `block` of `length` plaintext bytes (`last`: the file's last) into `plain`;
    /// with `journal`, from the journal where the block is pending there.
    func readBlock(
        fd: Int32, key: FileContentKey, block: Int, length: Int, last: Bool, into plain: UnsafeMutableRawBufferPointer,
        journal: (any StagedBlocks)? = nil
    ) throws -> Int {
        try ScratchBuffers.shared.with(length + layout.overhead) { buffer in
            let sealed = UnsafeMutableRawBufferPointer(rebasing: buffer[0..<(length + layout.overhead)])
            let at = layout.cipherOffset(ofBlock: block)
            // The pending snapshot first, then the store (see `StagedBlocks.pendingBlocks`).
            let got =
                try journal?.pendingBlocks().map { pending in
                    PendingBlock.overlay(
                        pending, onto: sealed, offset: at, got: try FullIO.preadFull(fd, sealed, offset: at),
                        stride: layout.cipherBlockSize)
                } ?? FullIO.preadFull(fd, sealed, offset: at)
            guard got == sealed.count else { throw KeybagError.corrupt("block \(block) truncated") }
            return try key.open(UnsafeRawBufferPointer(sealed), block: UInt64(block), last: last, into: plain)
        }
    }

    /// The plaintext and backing sizes of the file behind `fd`.
    func sizes(fd: Int32) throws -> (plain: Int, backing: Int) {
        var st = stat()
        guard fstat(fd, &st) == 0 else { throw KeybagError.system("fstat", errno) }
        return (layout.plainSize(backingSize: Int(st.st_size)), Int(st.st_size))
    }

    /// Where a write's sealed blocks go: staged (the journal) when there is one, else in place.
    struct BlockSink {
        let fd: Int32, journal: (any StagedBlocks)?, backingSize: Int

        /// Stores `sealed` at backing offset `offset`.
        func put(_ sealed: UnsafeRawBufferPointer, at offset: Int, stride: Int) throws {
            guard let journal else { return try FullIO.pwriteFull(fd, sealed, offset: offset) }
            try journal.store(sealed, at: offset, fd: fd, backingSize: backingSize, stride: stride)
        }
    }
}
