import KeybagCore
import Synchronization

/// The classes new files get: the mount's default, the directory policy, and a generation
/// bumped whenever a directory's class or the tree's shape changes (cached inherited
/// classes of an older generation are computed again).
final class ClassDefaults: Sendable {
    /// The class of a new file whose directories name none.
    let mountDefault: ProtectionClass
    /// Default classes given to directories created at matching paths.
    let policy: ClassPolicy
    private let generation = Atomic<UInt64>(1)

    init(mountDefault: ProtectionClass, policy: ClassPolicy) {
        self.mountDefault = mountDefault
        self.policy = policy
    }

    /// The generation now.
    var current: UInt64 { generation.load(ordering: .relaxed) }

    /// A directory's class or the tree's shape changed.
    func changed() { generation.add(1, ordering: .relaxed) }
}
