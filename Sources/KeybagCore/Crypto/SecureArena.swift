import CSodium

/// Slabs of guarded memory for small secrets. One `sodium_malloc` per secret would cost
/// a mapping, two guard pages and an mlock each, and 10,000 open files would exhaust the
/// kernel's map count; secrets share 256 KiB guarded chunks instead, in two slot sizes
/// (64 bytes for keys, 512 for an AES-GCM state), 64-byte aligned. Released slots are
/// zeroed before reuse. Chunks are kept for the life of the process.
final class SecureArena: Sendable {
    /// The process-wide arena.
    static let shared = SecureArena()
    /// Slot sizes, smallest first.
    static let slotSizes = [64, 512]
    /// Largest secret the arena holds.
    static var maxSize: Int { slotSizes.last! }
    static let chunkSize = 256 * 1024
    private let freeSlots = Locked<[[UInt]]>([[], []])

    /// The size class of a secret of `count` bytes.
    static func sizeClass(_ count: Int) -> Int { slotSizes.firstIndex { count <= $0 } ?? (slotSizes.count - 1) }

    /// A zeroed slot for `count` bytes (at most `maxSize`), or nil without guarded memory.
    func allocate(_ count: Int) -> UnsafeMutableRawPointer? {
        let c = Self.sizeClass(count)
        let size = Self.slotSizes[c]
        let addr: UInt? = freeSlots.withLock { free in
            if free[c].isEmpty {
                guard let chunk = sodium_malloc(Self.chunkSize) else { return nil }
                sodium_memzero(chunk, Self.chunkSize)
                let base = UInt(bitPattern: chunk)
                for i in stride(from: Self.chunkSize / size - 1, through: 0, by: -1) {
                    free[c].append(base + UInt(i * size))
                }
            }
            return free[c].popLast()
        }
        return addr.flatMap { UnsafeMutableRawPointer(bitPattern: $0) }
    }

    /// Zeroes a slot of a `count`-byte secret and makes it available again.
    func release(_ p: UnsafeMutableRawPointer, count: Int) {
        let c = Self.sizeClass(count)
        sodium_memzero(p, Self.slotSizes[c])
        freeSlots.withLock { $0[c].append(UInt(bitPattern: p)) }
    }
}
