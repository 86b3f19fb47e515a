import CCrypto

/// OpenSSL's AES-256-GCM and XAES-256-GCM as keybagfs uses them (Sources/CCrypto): one block
/// per call, key schedules only in pooled contexts in locked, zeroed-on-free memory.
public enum HardwareAES {
    /// Installs keybagfs' allocator into OpenSSL before anything else uses it.
    private static let initialized: Bool = kbfs_crypto_init() == 1

    /// Whether the CPU has AES and carry-less multiply instructions and OpenSSL started.
    public static let isAvailable: Bool = kbfs_cpu_has_aes() == 1 && initialized

    /// Makes sure OpenSSL is set up; call early (the daemon calls it before mounting).
    @discardableResult
    public static func start() -> Bool { initialized }

    /// Whether OpenSSL's memory is keybagfs' (locked where allowed, zeroed when freed).
    public static var ownsMemory: Bool { kbfs_crypto_owns_memory() == 1 }

    /// OpenSSL allocations that could not be locked against swap.
    public static var unlockedAllocations: Int { kbfs_crypto_unlocked_allocations() }

    /// Frees every cached key schedule: idle contexts now, busy ones when their call ends.
    /// Called on every key eviction.
    public static func forgetKeySchedules() { kbfs_crypto_forget() }

    /// Contexts alive, idle or busy.
    public static var contexts: Int { kbfs_crypto_contexts() }
}
