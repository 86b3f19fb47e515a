import Glibc

/// Named pauses at the daemon's and the tools' race windows, for tests only: `KEYBAGFS_TEST_FAILPOINTS`
/// lists `name=sleep:MILLISECONDS`, `name=stop` (the daemon stops itself with SIGSTOP,
/// so a test can SIGKILL it at exactly that instant) or `name=on` (a switch). Unset in production: every hit
/// is one dictionary lookup in an empty table.
public enum Failpoint: String, Sendable {
    /// In create, after the header is sealed and before the file key joins its inode.
    case createBeforeKeyJoinsInode = "create-before-key-joins-inode"
    /// In a class change, after the new header slot is durable and before the old one is erased.
    case classChangeBetweenSlots = "class-change-between-slots"
    /// On the control socket, after a subscribe request was handled and before its reply is sent.
    case subscribeBeforeReply = "subscribe-before-reply"
    /// In a lock's eviction, after the class keys are gone and before the state is `locked`.
    case evictionBeforeLocked = "eviction-before-locked"
    /// In a read, write or open whose file key is refused, before EACCES goes back (a
    /// pause here is what a daemon that waits for keys would do).
    case keyRefused = "key-refused"
    /// A switch: the INIT reply ignores the kernel's offer of FUSE_DIRECT_IO_ALLOW_MMAP, as
    /// on kernels before 6.6.
    case kernelWithoutDirectIOMmap = "kernel-without-direct-io-mmap"
    /// A switch: giving a new object to its creator fails (as root's chown does on an NFS
    /// store with root_squash).
    case chownRefused = "chown-refused"
    /// A switch: the store watcher takes every batch of changes another process made as lost
    /// (as a queue overflow), and drops everything instead of applying them.
    case watcherLosesEvents = "watcher-loses-events"
    /// A switch: the store watcher cannot mark the directories made after it started (as for
    /// a daemon that is not root, whose `open_by_handle_at` fails): changes in them go unseen.
    case watcherCannotMarkNewDirectories = "watcher-cannot-mark-new-directories"
    /// In `StoreRewrap` (tpm2 enroll, rewrap), after a batch's new header slots are durable and
    /// before its old slots are erased.
    case rewrapBetweenSlots = "rewrap-between-slots"
    /// In `tpm2 enroll`, after the keybag bound to the TPM is saved and before the TPM's lockout is taken.
    case enrollBeforeLockout = "enroll-before-lockout"

    /// A switch: the overwrite journal's background commit puts pending blocks in place but
    /// retires no record, so a test can tear a block on the store and see it replayed.
    case journalKeepsRecords = "journal-keeps-records"

    /// What a failpoint does when reached.
    enum Action: Sendable, Equatable { case sleep(UInt32), stop, on }

    /// The actions configured for this process.
    static let actions: [String: Action] = {
        guard let raw = getenv("KEYBAGFS_TEST_FAILPOINTS") else { return [:] }
        var table: [String: Action] = [:]
        for item in String(cString: raw).split(separator: ",") {
            let parts = item.split(separator: "=", maxSplits: 1).map(String.init)
            guard parts.count == 2 else { continue }
            if parts[1] == "stop" {
                table[parts[0]] = .stop
            } else if parts[1] == "on" {
                table[parts[0]] = .on
            } else if parts[1].hasPrefix("sleep:"), let ms = UInt32(parts[1].dropFirst(6)) {
                table[parts[0]] = .sleep(ms)
            }
        }
        return table
    }()

    /// Performs the configured action, if any.
    public func hit() {
        guard !Self.actions.isEmpty, let action = Self.actions[rawValue] else { return }
        switch action {
        case .sleep(let ms): usleep(ms * 1000)
        case .stop: raise(SIGSTOP)
        case .on: break
        }
    }

    /// Whether a switch is on.
    public var isOn: Bool { !Self.actions.isEmpty && Self.actions[rawValue] == .on }
}
