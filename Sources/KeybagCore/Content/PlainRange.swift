/// A plaintext byte range and the blocks it touches: the offset math that reads, writes,
/// truncation, hole punching and fallocate share (gocryptfs' intra-block ranges, as values).
public struct PlainRange: Sendable, Equatable {
    /// First byte.
    public let offset: Int
    /// One past the last byte (greater than `offset`).
    public let end: Int

    /// The range [offset, end); `end` must be past `offset`.
    public init(offset: Int, end: Int) {
        precondition(offset >= 0 && end > offset, "an empty or negative plaintext range")
        self.offset = offset
        self.end = end
    }

    /// Bytes in the range.
    public var count: Int { end - offset }

    /// The blocks the range touches.
    public var blocks: ClosedRange<Int> {
        (offset / BlockLayout.plainBlockSize)...((end - 1) / BlockLayout.plainBlockSize)
    }

    /// The part of block `block` the range covers (empty when it covers none of it).
    public func part(ofBlock block: Int) -> BlockPart {
        let start = block * BlockLayout.plainBlockSize
        let lo = max(offset, start) - start
        let hi = min(end, start + BlockLayout.plainBlockSize) - start
        return BlockPart(block: block, lo: lo, hi: max(lo, hi), atInRange: start + lo - offset)
    }
}

/// The bytes of one block that a plaintext range covers.
public struct BlockPart: Sendable, Equatable {
    /// The block.
    public let block: Int
    /// First byte within the block.
    public let lo: Int
    /// One past the last byte within the block.
    public let hi: Int
    /// Where the first byte sits counted from the range's offset (in the caller's buffer).
    public let atInRange: Int

    /// Bytes covered.
    public var count: Int { hi - lo }

    /// Whether the part is all of a block holding `length` bytes.
    public func coversAll(ofLength length: Int) -> Bool { lo == 0 && hi >= length }
}

extension BlockLayout {
    /// Index of the last block of a file of `size` plaintext bytes (-1 when empty).
    @inline(__always)
    public static func lastBlock(ofSize size: Int) -> Int { size > 0 ? (size - 1) / plainBlockSize : -1 }

    /// Plaintext bytes block `block` holds in a file of `size` bytes (0 past the end).
    @inline(__always)
    public static func length(ofBlock block: Int, inFileOf size: Int) -> Int {
        max(0, min(plainBlockSize, size - block * plainBlockSize))
    }

    /// The backing bytes that hold `blocks` sealed, in a file of `size` plaintext bytes
    /// (the last of them may be partial).
    public func cipherRange(of blocks: ClosedRange<Int>, inFileOf size: Int) -> Range<Int> {
        let last = blocks.upperBound
        return cipherOffset(ofBlock: blocks.lowerBound)..<cipherOffset(ofBlock: last)
            + Self.length(ofBlock: last, inFileOf: size) + overhead
    }

    /// The backing bytes of `blocks` as whole blocks.
    public func cipherRange(ofWhole blocks: ClosedRange<Int>) -> Range<Int> {
        cipherOffset(ofBlock: blocks.lowerBound)..<cipherOffset(ofBlock: blocks.upperBound + 1)
    }
}
