import CCrypto
import Glibc

/// Growing, shrinking and zeroing a file's plaintext (the offset math in `EncryptedContent`).
extension EncryptedContent {
    /// Sets the plaintext size. Shrinking keeps the new last block intact on disk until
    /// its re-sealed copy replaces it (cut after it first, then rewrite it in place); growing
    /// writes a sealed last block, so the end is never a hole.
    /// With `journal` (staged overwrites), see `shrinkStaged`.
    public func truncate(fd: Int32, key: FileContentKey, to newSize: Int, journal: (any StagedBlocks)? = nil) throws {
        defer { kbfs_scrub_stack() }  // cipher locals left below this frame
        let size = try plainSize(fd: fd)
        if newSize < size, let journal {
            try shrinkStaged(fd: fd, key: key, from: size, to: newSize, journal: journal)
        } else if newSize < size {
            let oldLast = BlockLayout.lastBlock(ofSize: size), newLast = BlockLayout.lastBlock(ofSize: newSize)
            guard newLast >= 0 else {
                guard ftruncate(fd, off_t(FileHeader.size)) == 0 else { throw KeybagError.system("ftruncate", errno) }
                return
            }
            let keepLen = BlockLayout.length(ofBlock: newLast, inFileOf: newSize)
            let oldLen = BlockLayout.length(ofBlock: newLast, inFileOf: size)
            if keepLen == oldLen && !key.sealsEnd {
                // Block-aligned cut of a file whose end is not sealed: nothing to re-seal.
                guard ftruncate(fd, off_t(layout.backingSize(plainSize: newSize))) == 0 else {
                    throw KeybagError.system("ftruncate", errno)
                }
                return
            }
            try ScratchBuffers.shared.withBlock(keepLen + layout.overhead) { sealed, plain in
                let n = try readBlock(
                    fd: fd, key: key, block: newLast, length: oldLen, last: newLast == oldLast, into: plain)
                guard n == oldLen else { throw KeybagError.corrupt("block \(newLast) short") }
                try key.seal(
                    UnsafeRawBufferPointer(rebasing: plain[0..<keepLen]), block: UInt64(newLast), last: true,
                    into: sealed)
                let blockStart = layout.cipherOffset(ofBlock: newLast)
                guard ftruncate(fd, off_t(blockStart + oldLen + layout.overhead)) == 0 else {
                    throw KeybagError.system("ftruncate", errno)
                }
                try FullIO.pwriteFull(fd, UnsafeRawBufferPointer(sealed), offset: blockStart)
                guard ftruncate(fd, off_t(layout.backingSize(plainSize: newSize))) == 0 else {
                    throw KeybagError.system("ftruncate", errno)
                }
            }
        } else if newSize > size {
            // Write zeros over the part of the new last block beyond the old end.
            let from = max(size, BlockLayout.lastBlock(ofSize: newSize) * BlockLayout.plainBlockSize)
            try ScratchBuffers.shared.with(newSize - from) { z in
                memset(z.baseAddress!, 0, z.count)
                try write(fd: fd, key: key, offset: from, data: UnsafeRawBufferPointer(z), journal: journal)
            }
        }
    }

    /// Shrinks a file whose overwrites are staged: its new last block is re-sealed (read with
    /// its staged version) and `StagedBlocks.shrink` puts the cut and the block in place so
    /// that a power cut leaves the old block whole or the new one.
    func shrinkStaged(
        fd: Int32, key: FileContentKey, from size: Int, to newSize: Int, journal: any StagedBlocks
    ) throws {
        let oldLast = BlockLayout.lastBlock(ofSize: size), newLast = BlockLayout.lastBlock(ofSize: newSize)
        let keepLen = newLast >= 0 ? BlockLayout.length(ofBlock: newLast, inFileOf: newSize) : 0
        let oldLen = newLast >= 0 ? BlockLayout.length(ofBlock: newLast, inFileOf: size) : 0
        let reseal = newLast >= 0 && !(keepLen == oldLen && !key.sealsEnd)
        let cut = newLast >= 0 ? layout.backingSize(plainSize: newSize) : FileHeader.size
        let blockStart = newLast >= 0 ? layout.cipherOffset(ofBlock: newLast) : cut
        guard reseal else { return try journal.shrink(fd: fd, to: cut, newLast: nil, at: blockStart) }
        try ScratchBuffers.shared.withBlock(keepLen + layout.overhead) { sealed, plain in
            let n = try readBlock(
                fd: fd, key: key, block: newLast, length: oldLen, last: newLast == oldLast, into: plain,
                journal: journal)
            guard n == oldLen else { throw KeybagError.corrupt("block \(newLast) short") }
            try key.seal(
                UnsafeRawBufferPointer(rebasing: plain[0..<keepLen]), block: UInt64(newLast), last: true, into: sealed)
            try journal.shrink(fd: fd, to: cut, newLast: UnsafeRawBufferPointer(sealed), at: blockStart)
        }
    }

    /// Makes the plaintext range [offset, offset+length) read as zeros (within the current
    /// size): whole blocks inside the file become backing holes (all zero bytes read as
    /// zeros), the partial blocks at the edges and a sealed last block are re-sealed with zeros.
    /// With `journal`, its staged blocks are settled in place before anything is punched.
    public func zeroRange(
        fd: Int32, key: FileContentKey, offset: Int, length: Int, journal: (any StagedBlocks)? = nil,
        punch: (Int, Int) -> Bool
    ) throws {
        defer { kbfs_scrub_stack() }  // cipher locals left below this frame
        let size = try plainSize(fd: fd)
        let end = min(offset + length, size)
        guard offset < end else { return }
        let range = PlainRange(offset: offset, end: end)
        try journal?.settleBeforeCut(fd: fd)
        let fileLast = BlockLayout.lastBlock(ofSize: size)
        for b in range.blocks {
            let part = range.part(ofBlock: b)
            let bLen = BlockLayout.length(ofBlock: b, inFileOf: size)
            if part.coversAll(ofLength: bLen) && !(key.sealsEnd && b == fileLast)
                && punch(layout.cipherOffset(ofBlock: b), bLen + layout.overhead)
            {
                continue
            }
            let zeros = [UInt8](repeating: 0, count: part.count)
            try zeros.withUnsafeBytes {
                try write(
                    fd: fd, key: key, offset: b * BlockLayout.plainBlockSize + part.lo, data: $0, journal: journal)
            }
        }
    }
}
