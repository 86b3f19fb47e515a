import CSodium
import Glibc
import Synchronization

/// Errors of the core, mapped to errno by the daemon and to messages by the tools.
public enum KeybagError: Error, Equatable, CustomStringConvertible {
    /// The key needed for this operation has been evicted (device locked / before first unlock).
    case keyUnavailable
    /// Authentication of stored data failed: tampered, truncated, moved or corrupt.
    case corrupt(String)
    /// The passcode did not unlock the keybag.
    case badPasscode
    /// The device key does not belong to this store.
    case badDeviceKey
    /// Input was not understood.
    case invalid(String)
    /// An operating-system call failed.
    case system(String, Int32)
    /// The recovery key does not open this store.
    case badRecoveryKey
    /// Too many wrong attempts in a row: try again after this many seconds.
    case throttled(retryAfter: Double)

    public var description: String {
        switch self {
        case .keyUnavailable: return "protected data is not available (key evicted)"
        case .corrupt(let what): return "corrupt or tampered data: \(what)"
        case .badPasscode: return "wrong passcode"
        case .badDeviceKey: return "the device key does not open this store"
        case .badRecoveryKey: return "wrong recovery key"
        case .throttled(let s): return "too many wrong attempts: try again in \(Int(s.rounded(.up))) s"
        case .invalid(let what): return what
        case .system(let what, let err): return "\(what): \(String(cString: strerror(err)))"
        }
    }
}

/// Initialises libsodium once per process; every entry point calls it.
public enum Sodium {
    private static let initialized: Bool = { sodium_init() >= 0 }()

    /// Makes sure `sodium_init` ran; traps only if libsodium itself cannot start.
    public static func ensureInitialized() {
        precondition(initialized, "libsodium failed to initialise")
    }

    /// Fills a buffer with random bytes from the kernel CSPRNG.
    public static func randomBytes(_ buffer: UnsafeMutableRawBufferPointer) {
        ensureInitialized()
        if let base = buffer.baseAddress { randombytes_buf(base, buffer.count) }
    }

    /// Returns `count` random bytes (for non-secret values such as nonces and ids).
    public static func randomArray(_ count: Int) -> [UInt8] {
        var out = [UInt8](repeating: 0, count: count)
        out.withUnsafeMutableBytes { randomBytes($0) }
        return out
    }
}

/// A reader-writer lock around a value: many readers at once, one writer.
/// `@unchecked Sendable`: `value` is only touched with the pthread lock held.
public final class RWLocked<Value>: @unchecked Sendable {
    private let lock: UnsafeMutablePointer<pthread_rwlock_t>
    private var value: Value

    /// Wraps a value.
    public init(_ value: Value) {
        self.value = value
        lock = .allocate(capacity: 1)
        pthread_rwlock_init(lock, nil)
    }

    deinit {
        pthread_rwlock_destroy(lock)
        lock.deallocate()
    }

    /// Runs `body` with shared access.
    public func read<R>(_ body: (Value) throws -> R) rethrows -> R {
        pthread_rwlock_rdlock(lock)
        defer { pthread_rwlock_unlock(lock) }
        return try body(value)
    }

    /// Runs `body` with exclusive access.
    public func write<R>(_ body: (inout Value) throws -> R) rethrows -> R {
        pthread_rwlock_wrlock(lock)
        defer { pthread_rwlock_unlock(lock) }
        return try body(&value)
    }
}

/// A mutual-exclusion lock around a value, on a pthread mutex. Used instead of
/// `Synchronization.Mutex`, whose futex calls ThreadSanitizer cannot see on Linux (every
/// access inside a `Mutex` was reported as a race, hiding real ones); same `withLock` shape.
/// `@unchecked Sendable`: `value` is only touched with the mutex held.
public final class Locked<Value>: @unchecked Sendable {
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>
    private var value: Value

    /// Wraps a value.
    public init(_ value: Value) {
        self.value = value
        mutex = .allocate(capacity: 1)
        pthread_mutex_init(mutex, nil)
    }

    deinit {
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
    }

    /// Runs `body` with the value, alone.
    public func withLock<R>(_ body: (inout Value) throws -> R) rethrows -> R {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body(&value)
    }

    /// Runs `body` with the value if no one else holds it; nil (without waiting) otherwise.
    public func withLockIfAvailable<R>(_ body: (inout Value) throws -> R) rethrows -> R? {
        guard pthread_mutex_trylock(mutex) == 0 else { return nil }
        defer { pthread_mutex_unlock(mutex) }
        return try body(&value)
    }
}

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

/// A secret held in libsodium guarded memory (`sodium_malloc`: not swapped, not dumped),
/// zeroed on `wipe()` and on deinit. Uses go through `withBytes`, which holds a shared
/// lock, so a wipe (exclusive) never tears an in-flight use and a use after it throws.
/// `@unchecked Sendable`: `address` is only read under the shared lock and only
/// changed under the exclusive one.
public final class SecureKey: @unchecked Sendable {
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
            guard let p = sodium_malloc(max(count, 1)) else { fatalError("sodium_malloc failed: out of guarded memory") }
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
