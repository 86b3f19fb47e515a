import CSodium

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
