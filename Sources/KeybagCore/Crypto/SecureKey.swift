import CSodium
import Glibc

/// A secret held in libsodium guarded memory (`sodium_malloc`: not swapped, not dumped),
/// zeroed on `wipe()` and on deinit. Uses go through `withBytes`, which holds a shared
/// lock, so a wipe (exclusive) never tears an in-flight use and a use after it throws.
/// `@unchecked Sendable`: `address` is only read under the shared lock and only
/// changed under the exclusive one.
public final class SecureKey: @unchecked Sendable {
    /// Shared for uses, exclusive for the wipe. Lock order: last of the daemon's locks but
    /// CCrypto's context pool, a leaf.
    private let lock: UnsafeMutablePointer<pthread_rwlock_t>
    /// The guarded bytes; 0 once wiped.
    private var address: UInt
    /// Whether the bytes come from the shared arena (else a dedicated `sodium_malloc`).
    private let pooled: Bool
    /// Length in bytes.
    public let count: Int

    /// Allocates `count` zero bytes of guarded memory.
    public init(zeroed count: Int) {
        Sodium.ensureInitialized()
        self.count = count
        lock = .allocate(capacity: 1)
        pthread_rwlock_init(lock, nil)
        if count <= SecureArena.maxSize, let p = SecureArena.shared.allocate(count) {
            pooled = true
            address = UInt(bitPattern: p)
        } else {
            guard let p = sodium_malloc(max(count, 1)) else {
                fatalError("sodium_malloc failed: out of guarded memory")
            }
            sodium_memzero(p, count)
            pooled = false
            address = UInt(bitPattern: p)
        }
    }

    /// A new random key of `count` bytes.
    public convenience init(random count: Int) {
        self.init(zeroed: count)
        randombytes_buf(UnsafeMutableRawPointer(bitPattern: address)!, count)
    }

    /// A key filled by `fill`, which writes exactly `count` bytes into guarded memory.
    public convenience init(count: Int, fill: (UnsafeMutableRawBufferPointer) throws -> Void) rethrows {
        self.init(zeroed: count)
        do {
            try fill(UnsafeMutableRawBufferPointer(start: UnsafeMutableRawPointer(bitPattern: address)!, count: count))
        } catch {
            wipe()
            throw error
        }
    }

    deinit {
        wipe()
        pthread_rwlock_destroy(lock)
        lock.deallocate()
    }

    /// Runs `body` with the key bytes; throws `keyUnavailable` once wiped.
    public func withBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) throws -> R {
        pthread_rwlock_rdlock(lock)
        defer { pthread_rwlock_unlock(lock) }
        guard address != 0 else { throw KeybagError.keyUnavailable }
        return try body(UnsafeRawBufferPointer(start: UnsafeRawPointer(bitPattern: address)!, count: count))
    }

    /// Zeroes and releases the key now; later uses throw `keyUnavailable`.
    public func wipe() {
        pthread_rwlock_wrlock(lock)
        defer { pthread_rwlock_unlock(lock) }
        guard address != 0 else { return }
        let p = UnsafeMutableRawPointer(bitPattern: address)!
        if pooled {
            SecureArena.shared.release(p, count: count)
        } else {
            sodium_memzero(p, count)
            sodium_free(p)
        }
        address = 0
    }

    /// True once `wipe()` ran.
    public var isWiped: Bool {
        pthread_rwlock_rdlock(lock)
        defer { pthread_rwlock_unlock(lock) }
        return address == 0
    }
}
