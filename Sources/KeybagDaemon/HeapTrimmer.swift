import CSystem
import Foundation
import Synchronization

/// Gives freed heap pages back to the kernel after bursts of forgotten inodes and closed
/// files. glibc keeps the pages of freed small objects when live ones sit between them, so
/// without this a daemon that once cached a large tree stays that large.
final class HeapTrimmer: Sendable {
    /// The daemon's trimmer.
    static let shared = HeapTrimmer()
    /// Objects freed since the last trim that make a trim worth it.
    static let threshold = 512
    /// How often the trimmer looks.
    static let interval: useconds_t = 1_000_000

    private let freed = Atomic<Int>(0)
    private let running = Atomic<Bool>(false)

    /// Counts freed objects (nodes, open files).
    func note(_ count: Int = 1) { freed.add(count, ordering: .relaxed) }

    /// Starts the background thread (once).
    func start() {
        guard running.compareExchange(expected: false, desired: true, ordering: .relaxed).exchanged else { return }
        NamedThread.start("kbfs-heap-trim") { [self] in
            while running.load(ordering: .relaxed) {
                usleep(Self.interval)
                if freed.load(ordering: .relaxed) >= Self.threshold {
                    freed.store(0, ordering: .relaxed)
                    _ = kbfs_malloc_trim()
                }
            }
        }
    }

    /// Stops the background thread at its next look.
    func stop() { running.store(false, ordering: .relaxed) }
}
