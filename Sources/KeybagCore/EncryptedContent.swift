import CSodium
import Glibc
import Synchronization

/// Reads and writes plaintext ranges of one encrypted backing file: offset math, the
/// read-modify-write of partial blocks, holes and truncation. Callers serialise writes
/// and truncations of one file (the daemon holds the inode's I/O lock).
public struct EncryptedContent: Sendable {
    /// The store's block layout.
    public let layout: BlockLayout

    public init(layout: BlockLayout) { self.layout = layout }

    static let B = BlockLayout.plainBlockSize

    /// Plaintext size of the backing file behind `fd`, from its size alone.
    public func plainSize(fd: Int32) throws -> Int {
        var st = stat()
        guard fstat(fd, &st) == 0 else { throw KeybagError.system("fstat", errno) }
        return layout.plainSize(backingSize: Int(st.st_size))
    }

    /// Reads the header of the backing file.
    public static func readHeader(fd: Int32) throws -> FileHeader { try readHeaderSlots(fd: fd).current }

    /// Reads the header and the index of a superseded slot an interrupted class change left.
    public static func readHeaderSlots(fd: Int32) throws -> (current: FileHeader, superseded: Int?) {
        var buf = [UInt8](repeating: 0, count: FileHeader.size)
        let n = try buf.withUnsafeMutableBytes { try preadFull(fd, $0, offset: 0) }
        guard n == FileHeader.size else { throw KeybagError.corrupt("file header truncated") }
        return try FileHeader.parseSlots(buf)
    }

    /// Erases a header slot (the older class's wrap) and makes that durable.
    public static func eraseHeaderSlot(fd: Int32, index: Int) throws {
        let zeros = [UInt8](repeating: 0, count: FileHeader.slotSize)
        try zeros.withUnsafeBytes { try pwriteFull(fd, $0, offset: index * FileHeader.slotSize) }
        guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync", errno) }
    }

    /// Writes a new file's header (its slot and an empty other slot).
    public static func writeNewHeader(fd: Int32, _ header: FileHeader) throws {
        var buf = [UInt8](repeating: 0, count: FileHeader.size)
        let slot = header.encodeSlot()
        buf.replaceSubrange(header.slotOffset..<(header.slotOffset + FileHeader.slotSize), with: slot)
        try buf.withUnsafeBytes { try pwriteFull(fd, $0, offset: 0) }
    }

    /// Writes a header's slot and makes it durable: the crash-safe class change.
    public static func writeHeaderSlot(fd: Int32, _ header: FileHeader) throws {
        let slot = header.encodeSlot()
        try slot.withUnsafeBytes { try pwriteFull(fd, $0, offset: header.slotOffset) }
        guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync", errno) }
    }

    /// Reads up to `out.count` plaintext bytes at `offset`; returns the count (0 at EOF).
    public func read(fd: Int32, key: FileContentKey, offset: Int, into out: UnsafeMutableRawBufferPointer) throws -> Int {
        let size = try plainSize(fd: fd)
        guard offset < size, out.count > 0 else { return 0 }
        let end = min(offset + out.count, size)
        let first = offset / Self.B, last = (end - 1) / Self.B
        let cStart = layout.cipherOffset(ofBlock: first)
        let cEnd = layout.cipherOffset(ofBlock: last) + min(Self.B, size - last * Self.B) + layout.overhead
        return try ScratchBuffers.shared.withBlock(cEnd - cStart) { cbuf, plain in
            let got = try Self.preadFull(fd, cbuf, offset: cStart)
            var written = 0
            for b in first...last {
                let bStart = b * Self.B
                let bLen = min(Self.B, size - bStart)
                let rel = (b - first) * layout.cipherBlockSize
                guard rel + bLen + layout.overhead <= got else { break }   // truncated underneath us
                let sealed = UnsafeRawBufferPointer(rebasing: cbuf[rel..<(rel + bLen + layout.overhead)])
                let lo = max(offset, bStart) - bStart
                if lo == 0 && end - bStart >= bLen {
                    // The whole block is wanted: decrypt straight into the reply.
                    let n = try key.open(sealed, block: UInt64(b), into: UnsafeMutableRawBufferPointer(rebasing: out[written..<(written + bLen)]))
                    written += n
                    if n < bLen { break }
                    continue
                }
                let n = try key.open(sealed, block: UInt64(b), into: plain)
                let hi = min(end, bStart + n) - bStart
                guard hi > lo else { break }
                (out.baseAddress! + written).copyMemory(from: plain.baseAddress! + lo, byteCount: hi - lo)
                written += hi - lo
            }
            return written
        }
    }

    /// Writes `data` at plaintext `offset`, extending the file (with holes) as needed.
    public func write(fd: Int32, key: FileContentKey, offset: Int, data: UnsafeRawBufferPointer) throws {
        guard data.count > 0 else { return }
        let size = try plainSize(fd: fd)
        let first = offset / Self.B
        let end = offset + data.count
        let last = (end - 1) / Self.B
        // A partial last block followed by new blocks must first become a full block.
        if size % Self.B != 0, first > size / Self.B {
            try resealBlock(fd: fd, key: key, block: size / Self.B, oldLength: size % Self.B, newLength: Self.B)
        }
        let effSize = (size % Self.B != 0 && first > size / Self.B) ? (size / Self.B + 1) * Self.B : size
        try ScratchBuffers.shared.withBlock((last - first + 1) * layout.cipherBlockSize) { out, plain in
            var outLen = 0
            for b in first...last {
                let bStart = b * Self.B
                let lo = max(offset, bStart) - bStart
                let hi = min(end, bStart + Self.B) - bStart
                let existing = max(0, min(Self.B, effSize - bStart))
                let newLen = max(existing, hi)
                if existing > 0 && (lo > 0 || hi < existing) {
                    let n = try readBlock(fd: fd, key: key, block: b, length: existing, into: plain)
                    guard n == existing else { throw KeybagError.corrupt("block \(b) short") }
                }
                if lo > existing { memset(plain.baseAddress! + existing, 0, lo - existing) }
                (plain.baseAddress! + lo).copyMemory(from: data.baseAddress! + (bStart + lo - offset), byteCount: hi - lo)
                let dst = UnsafeMutableRawBufferPointer(rebasing: out[outLen..<(outLen + newLen + layout.overhead)])
                try key.seal(UnsafeRawBufferPointer(rebasing: plain[0..<newLen]), block: UInt64(b), into: dst)
                outLen += newLen + layout.overhead
            }
            try Self.pwriteFull(fd, UnsafeRawBufferPointer(rebasing: out[0..<outLen]), offset: layout.cipherOffset(ofBlock: first))
        }
    }

    /// Sets the plaintext size, re-sealing the block that the new end cuts or extends.
    public func truncate(fd: Int32, key: FileContentKey, to newSize: Int) throws {
        let size = try plainSize(fd: fd)
        if newSize < size {
            let b = newSize / Self.B
            let keep = newSize % Self.B
            if keep != 0 {
                try ScratchBuffers.shared.withBlock(keep + layout.overhead) { sealed, plain in
                    _ = try readBlock(fd: fd, key: key, block: b, length: min(Self.B, size - b * Self.B), into: plain)
                    try key.seal(UnsafeRawBufferPointer(rebasing: plain[0..<keep]), block: UInt64(b), into: sealed)
                    guard ftruncate(fd, off_t(layout.cipherOffset(ofBlock: b))) == 0 else { throw KeybagError.system("ftruncate", errno) }
                    try Self.pwriteFull(fd, UnsafeRawBufferPointer(sealed), offset: layout.cipherOffset(ofBlock: b))
                }
            }
            guard ftruncate(fd, off_t(layout.backingSize(plainSize: newSize))) == 0 else { throw KeybagError.system("ftruncate", errno) }
        } else if newSize > size {
            if size % Self.B != 0 {
                let b = size / Self.B
                let target = newSize / Self.B == b ? newSize - b * Self.B : Self.B
                try resealBlock(fd: fd, key: key, block: b, oldLength: size % Self.B, newLength: target)
            }
            guard ftruncate(fd, off_t(layout.backingSize(plainSize: newSize))) == 0 else { throw KeybagError.system("ftruncate", errno) }
        }
    }

    /// Makes the plaintext range [offset, offset+length) read as zeros (within the current
    /// size): whole blocks become backing holes (all zero bytes read as zeros), the partial
    /// blocks at the edges are re-sealed with zeros.
    public func zeroRange(fd: Int32, key: FileContentKey, offset: Int, length: Int, punch: (Int, Int) -> Bool) throws {
        let size = try plainSize(fd: fd)
        let end = min(offset + length, size)
        guard offset < end else { return }
        var pos = offset
        while pos < end {
            let b = pos / Self.B
            let bStart = b * Self.B
            let bEnd = min(bStart + Self.B, size)
            let stop = min(end, bEnd)
            if pos == bStart && stop == bEnd && punch(layout.cipherOffset(ofBlock: b), bEnd - bStart + layout.overhead) {
                pos = stop
                continue
            }
            let zeros = [UInt8](repeating: 0, count: stop - pos)
            try zeros.withUnsafeBytes { try write(fd: fd, key: key, offset: pos, data: $0) }
            pos = stop
        }
    }

    /// Decrypts block `block` of `length` plaintext bytes into `plain`.
    private func readBlock(fd: Int32, key: FileContentKey, block: Int, length: Int, into plain: UnsafeMutableRawBufferPointer) throws -> Int {
        try ScratchBuffers.shared.with(length + layout.overhead) { buffer in
            let sealed = UnsafeMutableRawBufferPointer(rebasing: buffer[0..<(length + layout.overhead)])
            let got = try Self.preadFull(fd, sealed, offset: layout.cipherOffset(ofBlock: block))
            guard got == sealed.count else { throw KeybagError.corrupt("block \(block) truncated") }
            return try key.open(UnsafeRawBufferPointer(sealed), block: UInt64(block), into: plain)
        }
    }

    /// Re-seals a block zero-extended from `oldLength` to `newLength` plaintext bytes.
    private func resealBlock(fd: Int32, key: FileContentKey, block: Int, oldLength: Int, newLength: Int) throws {
        try ScratchBuffers.shared.withBlock(newLength + layout.overhead) { sealed, plain in
            let n = try readBlock(fd: fd, key: key, block: block, length: oldLength, into: plain)
            guard n == oldLength else { throw KeybagError.corrupt("block \(block) short") }
            memset(plain.baseAddress! + oldLength, 0, newLength - oldLength)
            try key.seal(UnsafeRawBufferPointer(rebasing: plain[0..<newLength]), block: UInt64(block), into: sealed)
            try Self.pwriteFull(fd, UnsafeRawBufferPointer(sealed), offset: layout.cipherOffset(ofBlock: block))
        }
    }

    /// pread until `buf` is full or EOF; returns bytes read.
    public static func preadFull(_ fd: Int32, _ buf: UnsafeMutableRawBufferPointer, offset: Int) throws -> Int {
        var done = 0
        while done < buf.count {
            let n = pread(fd, buf.baseAddress! + done, buf.count - done, off_t(offset + done))
            if n < 0 { if errno == EINTR { continue }; throw KeybagError.system("pread", errno) }
            if n == 0 { break }
            done += n
        }
        return done
    }

    /// pwrite all of `buf` (ENOSPC and friends surface as errors).
    public static func pwriteFull(_ fd: Int32, _ buf: UnsafeRawBufferPointer, offset: Int) throws {
        var done = 0
        while done < buf.count {
            let n = pwrite(fd, buf.baseAddress! + done, buf.count - done, off_t(offset + done))
            if n < 0 { if errno == EINTR { continue }; throw KeybagError.system("pwrite", errno) }
            done += n
        }
    }
}

/// Reusable aligned buffers for the data path, so a request does not allocate (and, for
/// large sizes, map and fault in) fresh memory. Buffers up to `pooledSize` are pooled.
public final class ScratchBuffers: Sendable {
    /// The process-wide pool.
    public static let shared = ScratchBuffers()
    /// Size of every pooled buffer: a 1 MiB request plus block overhead.
    public static let pooledSize = (1 << 20) + 64 * 1024
    private let free = Locked<[UInt]>([])

    /// Runs `body` with a buffer of `count` bytes and a separate block-sized buffer, both
    /// from one pooled buffer. Every block buffer of the data path comes from here: a heap
    /// block per request fragments the heap between long-lived inode objects.
    public func withBlock<R>(_ count: Int, _ body: (UnsafeMutableRawBufferPointer, UnsafeMutableRawBufferPointer) throws -> R) rethrows -> R {
        let split = (count + 63) & ~63
        let block = BlockLayout.plainBlockSize
        return try with(split + block) { b in
            let plain = UnsafeMutableRawBufferPointer(rebasing: b[split..<(split + block)])
            defer { sodium_memzero(plain.baseAddress!, block) }   // partial-block plaintext never outlives the request
            return try body(UnsafeMutableRawBufferPointer(rebasing: b[0..<count]), plain)
        }
    }

    /// Runs `body` with a buffer of at least `count` bytes (contents undefined).
    public func with<R>(_ count: Int, _ body: (UnsafeMutableRawBufferPointer) throws -> R) rethrows -> R {
        guard count <= Self.pooledSize else {
            let b = UnsafeMutableRawBufferPointer.allocate(byteCount: max(count, 1), alignment: 64)
            defer { b.deallocate() }
            return try body(b)
        }
        let addr = free.withLock { $0.popLast() } ?? UInt(bitPattern: UnsafeMutableRawPointer.allocate(byteCount: Self.pooledSize, alignment: 64))
        defer { free.withLock { $0.append(addr) } }
        return try body(UnsafeMutableRawBufferPointer(start: UnsafeMutableRawPointer(bitPattern: addr)!, count: count))
    }
}
