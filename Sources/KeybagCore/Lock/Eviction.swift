/// The files an eviction visits and the page cache it empties: the daemon's inode table
/// and FUSE session, or a unit test's own list.
public protocol EvictionTarget {
    /// Every regular file whose key life is known, by node id.
    func fileKeyLives() -> [(id: UInt64, life: RWLocked<FileKeyLife>)]
    /// Asks the kernel to write back (while `pass` is `.writeBack`, through the daemon,
    /// which still holds the keys) and then drop the cached pages of `ids`, for an eviction of `kind`.
    func dropPageCache(_ ids: [UInt64], pass: Eviction.Pass, of kind: Eviction.Kind)
}

/// The one owner of eviction: a lock, and a return to `beforeFirstUnlock` after a long
/// lock (inactivity), run as the same four phases; and the rule that refuses I/O through
/// handles opened before. What each file's key does in a phase is `FileKeyLife`'s rule;
/// which class keys go is `ClassKeyring`'s.
///
/// 1. `begin`: a new lock epoch; the evicted classes can no longer be opened, read or
///    created, while their keys stay in memory for writing back dirty pages;
/// 2. the page cache of every file whose pages need an evicted key is written back and
///    dropped (`mustWriteBack`);
/// 3. `finish` zeroes the class keys, then each file key goes under its inode's lock
///    (`evictKey`), then the crypto library's key schedules;
/// 4. the page cache of the evicted files is dropped again, for anything cached between.
public struct Eviction: Sendable {
    /// What is evicted.
    public enum Kind: String, Sendable { case lock, returnToBeforeFirstUnlock = "return to beforeFirstUnlock" }
    /// The two page-cache passes.
    public enum Pass: String, Sendable { case writeBack = "write-back", afterEviction = "after eviction" }

    public let kind: Kind

    public init(_ kind: Kind) { self.kind = kind }

    /// Runs the four phases against `target`.
    public func run(keyring: ClassKeyring, target: some EvictionTarget) {
        begin(keyring)
        let lives = target.fileKeyLives()
        target.dropPageCache(
            lives.compactMap { f in f.life.read { mustWriteBack($0) } ? f.id : nil },
            pass: .writeBack, of: kind)
        finish(keyring)
        let evicted = target.fileKeyLives().compactMap { f in f.life.write { evictKey(&$0) } ? f.id : nil }
        HardwareAES.forgetKeySchedules()
        target.dropPageCache(evicted, pass: .afterEviction, of: kind)
    }

    /// Phase 1: the new epoch in which the evicted classes only write back.
    func begin(_ keyring: ClassKeyring) {
        switch kind {
        case .lock: keyring.beginEviction()
        case .returnToBeforeFirstUnlock: keyring.beginReturnToBeforeFirstUnlock()
        }
    }

    /// Phase 2's choice: whether a file's cached pages need a key this eviction removes.
    func mustWriteBack(_ life: FileKeyLife) -> Bool {
        switch kind {
        case .lock: return life.holdsProtectedPages
        case .returnToBeforeFirstUnlock: return life.holdsKeyOtherThanNone
        }
    }

    /// Phase 3, first half: the class keys go.
    func finish(_ keyring: ClassKeyring) {
        switch kind {
        case .lock: keyring.finishEviction()
        case .returnToBeforeFirstUnlock: keyring.returnToBeforeFirstUnlock()
        }
    }

    /// Phase 3, second half, per file: true when its cached pages must go too.
    func evictKey(_ life: inout FileKeyLife) -> Bool {
        switch kind {
        case .lock: return life.evict()
        case .returnToBeforeFirstUnlock: return life.evictAllButNone()
        }
    }

    /// Whether I/O through the open handles of a file of `cls` is refused under `access`:
    /// class A while it cannot open (locked, or evicting), classes B and C once back in (or
    /// returning to) `beforeFirstUnlock`. Class B handles opened before a lock keep working;
    /// class D's never stop.
    public static func refusesHandles(of cls: ProtectionClass, _ access: KeyAccess) -> Bool {
        guard cls != .none, !access.canOpen(cls) else { return false }
        return cls == .complete || !access.canCreate(cls)
    }

    /// Whether `refusesHandles` can be true for any class under `access`: false while
    /// unlocked (class A opens), so the hot path pays one atomic load and no inode lock.
    public static func mayRefuseHandles(_ access: KeyAccess) -> Bool { !access.canOpen(.complete) }
}
