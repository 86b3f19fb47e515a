import CSodium
import Glibc
import Synchronization

/// A per-thread stream of random nonce bytes, so that sealing a block costs no
/// `getrandom` system call (254 ns, a tenth of sealing 4 KiB on this machine).
///
/// Construction (docs/FORMAT.md, "Nonces"): a fast-key-erasure generator. The thread's
/// 32-byte seed comes from the kernel (`randombytes_buf`); each refill expands it with
/// ChaCha20 (`randombytes_buf_deterministic`) into 32 bytes that replace the seed and
/// 1,024 bytes handed out as nonces, then the used bytes are wiped. Every 256 refills the
/// seed is drawn from the kernel again, and after a `fork` the child's stream reseeds
/// before its first nonce, so two processes never share a stream.
///
/// Nonces are public (stored next to every block); the generator only has to make them
/// as unlikely to repeat as kernel random bytes are, which a ChaCha20 stream keyed with
/// a fresh kernel seed does.
final class NonceStream {
    /// Bytes handed out per refill.
    private static let chunk = 1024
    /// Refills between two kernel seeds.
    private static let refillsPerSeed = 256
    /// Bumped in the child after every `fork`: a stream from an older generation reseeds.
    private static let forkGeneration = Atomic<UInt32>(0)
    /// The pthread key holding each thread's stream (released when the thread exits).
    private static let threadKey: pthread_key_t = {
        var key = pthread_key_t()
        precondition(
            pthread_key_create(&key) { p in
                if let p { Unmanaged<NonceStream>.fromOpaque(p).release() }
            } == 0, "pthread_key_create failed")
        pthread_atfork(nil, nil) { NonceStream.forkGeneration.add(1, ordering: .relaxed) }
        return key
    }()

    /// Seed (32 bytes) followed by the current chunk of output.
    private let state: UnsafeMutablePointer<UInt8>
    /// Bytes of the current chunk already handed out.
    private var used = chunk
    /// Refills since the last kernel seed.
    private var refills = refillsPerSeed
    /// The fork generation the seed was drawn in.
    private var generation = UInt32.max

    private init() {
        state = .allocate(capacity: 32 + Self.chunk)
        state.initialize(repeating: 0, count: 32 + Self.chunk)
    }

    deinit {
        sodium_memzero(state, 32 + Self.chunk)
        state.deallocate()
    }

    /// Writes `count` (at most 1,024) fresh random bytes to `out` from this thread's stream.
    static func fill(_ out: UnsafeMutablePointer<UInt8>, count: Int) {
        precondition(count <= chunk)
        Sodium.ensureInitialized()
        let stream: NonceStream
        if let p = pthread_getspecific(threadKey) {
            stream = Unmanaged<NonceStream>.fromOpaque(p).takeUnretainedValue()
        } else {
            stream = NonceStream()
            pthread_setspecific(threadKey, Unmanaged.passRetained(stream).toOpaque())
        }
        stream.take(out, count: count)
    }

    /// Hands out `count` bytes, refilling (and reseeding when due) first if needed.
    private func take(_ out: UnsafeMutablePointer<UInt8>, count: Int) {
        let gen = Self.forkGeneration.load(ordering: .relaxed)
        if gen != generation { generation = gen; refills = Self.refillsPerSeed; used = Self.chunk }
        if Self.chunk - used < count { refill() }
        let src = state + 32 + used
        out.update(from: src, count: count)
        sodium_memzero(src, count)
        used += count
    }

    /// Replaces the seed and the chunk: from the kernel every `refillsPerSeed` refills,
    /// otherwise by expanding the current seed (whose old value is overwritten).
    private func refill() {
        if refills >= Self.refillsPerSeed {
            randombytes_buf(state, 32)
            refills = 0
        }
        var seed = [UInt8](repeating: 0, count: 32)
        seed.withUnsafeMutableBytes { s in
            s.baseAddress!.copyMemory(from: state, byteCount: 32)
            randombytes_buf_deterministic(state, 32 + Self.chunk, s.baseAddress!.assumingMemoryBound(to: UInt8.self))
            sodium_memzero(s.baseAddress!, 32)
        }
        refills += 1
        used = 0
    }
}
