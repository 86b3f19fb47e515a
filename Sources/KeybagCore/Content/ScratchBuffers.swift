import CSodium
import Glibc

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
    public func withBlock<R>(
        _ count: Int, _ body: (UnsafeMutableRawBufferPointer, UnsafeMutableRawBufferPointer) throws -> R
    ) rethrows -> R {
        let split = (count + 63) & ~63
        let block = BlockLayout.plainBlockSize
        return try with(split + block) { b in
            let plain = UnsafeMutableRawBufferPointer(rebasing: b[split..<(split + block)])
            defer { sodium_memzero(plain.baseAddress!, block) }  // partial-block plaintext never outlives the request
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
        let addr =
            free.withLock { $0.popLast() }
            ?? UInt(bitPattern: UnsafeMutableRawPointer.allocate(byteCount: Self.pooledSize, alignment: 64))
        defer { free.withLock { $0.append(addr) } }
        return try body(UnsafeMutableRawBufferPointer(start: UnsafeMutableRawPointer(bitPattern: addr)!, count: count))
    }
}
