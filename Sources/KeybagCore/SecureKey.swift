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

    public var description: String {
        switch self {
        case .keyUnavailable: return "protected data is not available (key evicted)"
        case .corrupt(let what): return "corrupt or tampered data: \(what)"
        case .badPasscode: return "wrong passcode"
        case .badDeviceKey: return "the device key does not open this store"
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

/// A secret held in libsodium guarded memory (`sodium_malloc`): not swapped, not dumped,
/// zeroed on `wipe()` and freed on deinit. Access goes through `withBytes`, which holds
/// a lock, so a wipe never tears an in-flight use and a use after a wipe throws.
public final class SecureKey: Sendable {
    /// The guarded allocation as an address bit pattern; 0 once wiped.
    private let storage: Mutex<UInt>
    /// Length in bytes.
    public let count: Int

    /// Allocates `count` zero bytes of guarded memory.
    public init(zeroed count: Int) {
        Sodium.ensureInitialized()
        guard let p = sodium_malloc(count) else { fatalError("sodium_malloc failed") }
        sodium_memzero(p, count)
        self.count = count
        self.storage = Mutex(UInt(bitPattern: p))
    }

    /// A new random key of `count` bytes.
    public convenience init(random count: Int) {
        self.init(zeroed: count)
        storage.withLock { addr in
            randombytes_buf(UnsafeMutableRawPointer(bitPattern: addr)!, count)
        }
    }

    /// A key filled by `fill`, which writes exactly `count` bytes into guarded memory.
    public convenience init(count: Int, fill: (UnsafeMutableRawBufferPointer) throws -> Void) rethrows {
        self.init(zeroed: count)
        try storage.withLock { addr in
            try fill(UnsafeMutableRawBufferPointer(start: UnsafeMutableRawPointer(bitPattern: addr)!, count: count))
        }
    }

    deinit {
        let addr = storage.withLock { $0 }
        if addr != 0 { sodium_free(UnsafeMutableRawPointer(bitPattern: addr)) }
    }

    /// Runs `body` with the key bytes; throws `keyUnavailable` once wiped.
    public func withBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) throws -> R {
        var result: R?
        var failure: Error?
        storage.withLock { addr in
            guard addr != 0 else { failure = KeybagError.keyUnavailable; return }
            let buf = UnsafeRawBufferPointer(start: UnsafeRawPointer(bitPattern: addr)!, count: count)
            do { result = try body(buf) } catch { failure = error }
        }
        if let failure { throw failure }
        return result!
    }

    /// Zeroes and frees the key now; later uses throw `keyUnavailable`.
    public func wipe() {
        storage.withLock { addr in
            guard addr != 0 else { return }
            let p = UnsafeMutableRawPointer(bitPattern: addr)!
            sodium_memzero(p, count)
            sodium_free(p)
            addr = 0
        }
    }

    /// True once `wipe()` ran.
    public var isWiped: Bool { storage.withLock { $0 == 0 } }
}
