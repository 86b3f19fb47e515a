import Synchronization

/// What the store watcher tells the FUSE handlers about another writer: whether one is
/// expected, and a counter of the name changes it brought (a lookup compares it before
/// and after, so its "absent" reply is cached only when no change came meanwhile).
final class ChangesUnderneath: Sendable {
    /// Bumped before the watcher tells the kernel to forget entries another writer changed.
    private let names = Atomic<UInt64>(0)
    /// Whether another writer is expected in the store (it is watched in full).
    private let anotherWriter = Atomic<Bool>(false)

    /// Whether another writer is expected in the store.
    var anotherWriterExpected: Bool { anotherWriter.load(ordering: .relaxed) }

    /// The name-change counter now.
    var namesSeen: UInt64 { names.load(ordering: .sequentiallyConsistent) }

    /// Another writer changed names (before the kernel is told to forget them).
    func namesChanged() { names.add(1, ordering: .sequentiallyConsistent) }

    /// From now on another writer is expected (the store is watched in full).
    func expectAnotherWriter() { anotherWriter.store(true, ordering: .relaxed) }

    /// How long the kernel may remember that a name is absent: the entry time where the
    /// daemon is the only writer, at most one second where another writer is expected (the
    /// watcher may not see every directory: a daemon that is not root cannot mark the
    /// directories made after it started, and a name brought into one would stay hidden).
    func negativeEntrySeconds(normal: Double) -> Double {
        anotherWriter.load(ordering: .relaxed) ? min(normal, 1) : normal
    }
}
