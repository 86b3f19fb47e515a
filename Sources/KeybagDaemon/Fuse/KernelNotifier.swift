import CFuse
import Dispatch
import Glibc
import KeybagCore
import Synchronization

/// What the kernel agreed to at INIT that changes how files are served.
struct MountNegotiation: Sendable, Equatable {
    /// Direct-I/O handles may be mapped shared, so class A handles bypass the page cache.
    var directIOMappable: Bool
    /// Writes through cached handles land in the kernel's page cache first.
    var writeback: Bool
}

/// The daemon's messages to the kernel outside replies: drop an inode's page cache, ask
/// for its attributes again; and the queue for work a FUSE thread must not wait for (the
/// kernel may need that very thread for the write-back a page drop starts). Injected into
/// `Filesystem` (`Controller` reaches it through it); until a session is attached (and in
/// unit tests) the messages go nowhere.
final class KernelNotifier: Sendable {
    /// The FUSE session (bit pattern); 0 when none.
    private let session = Atomic<UInt>(0)
    /// Serial queue of page drops and other work kept off FUSE threads.
    private let queue = DispatchQueue(label: "keybagfs.kernel-notifications")
    /// Reads what INIT negotiated.
    private let negotiatedNow: @Sendable () -> MountNegotiation
    /// Sees every page drop asked for, session or not (unit tests).
    private let observer: (@Sendable (_ ids: [UInt64], _ pass: String) -> Void)?
    /// Where notes go.
    private let log: EventLog

    /// A notifier; `negotiated` reads what the mount's INIT agreed (the FUSE channel's, by
    /// default); `observer` sees each page drop asked for.
    init(
        negotiated: @escaping @Sendable () -> MountNegotiation = { FuseChannel.negotiated },
        observer: (@Sendable (_ ids: [UInt64], _ pass: String) -> Void)? = nil, log: EventLog = .standardError
    ) {
        negotiatedNow = negotiated
        self.observer = observer
        self.log = log
    }

    /// What INIT negotiated (all false before INIT).
    var negotiated: MountNegotiation { negotiatedNow() }

    /// Messages go to this session from now on.
    func attach(_ se: OpaquePointer) {
        session.store(UInt(bitPattern: Int(bitPattern: UnsafeRawPointer(se))), ordering: .releasing)
    }

    /// Messages go nowhere from now on; returns once queued work has run.
    func detach() {
        session.store(0, ordering: .releasing)
        queue.sync {}
    }

    /// The session, if attached.
    private var current: OpaquePointer? { OpaquePointer(bitPattern: session.load(ordering: .acquiring)) }

    /// Asks the kernel to write back and drop the cached pages of `ids`, now. Call it from a
    /// thread that is not a FUSE worker, holding no lock a request handler needs. Failures
    /// other than "the kernel no longer knows this inode" are logged under `pass`.
    func dropPageCache(_ ids: [UInt64], pass: String) {
        observer?(ids, pass)
        guard let se = current else { return }
        var failed = 0, firstError: Int32 = 0
        for id in ids {
            let rc = fuse_lowlevel_notify_inval_inode(se, id, 0, 0)
            if rc != 0 && rc != -ENOENT {
                failed += 1
                if firstError == 0 { firstError = -rc }
            }
        }
        if failed > 0 {
            log(
                "\(pass): page cache of \(failed) of \(ids.count) inodes not dropped: "
                    + "\(String(cString: strerror(firstError)))"
            )
        }
    }

    /// `dropPageCache` of one inode, soon, from the notifier's queue (callable from FUSE threads).
    func dropPagesSoon(_ id: UInt64, pass: String) { queue.async { self.dropPageCache([id], pass: pass) } }

    /// Makes the kernel ask again for the attributes of `ids` before it answers from them.
    /// No page is dropped (offset -1), so nothing is written back and any thread may call it.
    func refreshAttributes(_ ids: [UInt64]) {
        guard let se = current else { return }
        for id in ids { _ = fuse_lowlevel_notify_inval_inode(se, id, -1, 0) }
    }

    /// Makes the kernel forget the entry `name` of directory `parent` (a name it found, or
    /// found missing), soon, from the notifier's queue: the next use of the name is looked
    /// up again. For changes another writer made in the store (`StoreWatcher`).
    func forgetEntrySoon(parent: UInt64, name: String) {
        queue.async { [self] in
            guard let se = current else { return }
            let rc = name.withCString { fuse_lowlevel_notify_inval_entry(se, parent, $0, strlen($0)) }
            if rc != 0 && rc != -ENOENT {
                log("a changed entry was not dropped from the kernel: \(String(cString: strerror(-rc)))")
            }
        }
    }

    /// Runs `work` on the notifier's queue, not on the calling FUSE thread.
    func soon(_ work: @escaping @Sendable () -> Void) { queue.async(execute: work) }
}
