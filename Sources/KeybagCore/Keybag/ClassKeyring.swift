import Synchronization

/// What the lock state allows right now: which classes may open existing files and create
/// new ones, whether a lock is evicting, and the lock epoch, which changes whenever a lock
/// begins evicting. One consistent snapshot, read without taking a lock.
public struct KeyAccess: Sendable, Equatable {
    /// Bumped by every `beginEviction`; a class A key loaded in another epoch is stale.
    public let epoch: UInt64
    /// Between `beginEviction` and `finishEviction`: class A and B keys are still in memory
    /// (dirty pages are being written back) but nothing may open, read or create with them.
    public let evicting: Bool
    let openMask: UInt8
    let createMask: UInt8

    /// While `evicting`: the epoch the eviction ends, whose keys may still write back.
    public var epochBeingEvicted: UInt64 { epoch &- 1 }

    /// Packs the snapshot into one word (masks in the low byte, evicting in bit 8, epoch above).
    var word: UInt64 { epoch << 16 | (evicting ? 1 << 8 : 0) | UInt64(createMask) << 4 | UInt64(openMask) }

    init(epoch: UInt64, evicting: Bool, openMask: UInt8, createMask: UInt8) {
        self.epoch = epoch; self.evicting = evicting; self.openMask = openMask; self.createMask = createMask
    }

    init(word w: UInt64) {
        self.init(
            epoch: w >> 16, evicting: w & (1 << 8) != 0, openMask: UInt8(w & 0xF), createMask: UInt8((w >> 4) & 0xF))
    }

    /// The mask bit of a class.
    static func bit(_ c: ProtectionClass) -> UInt8 { 1 << (c.rawValue - 1) }

    /// Whether existing files of `c` may be opened (and read) now.
    public func canOpen(_ c: ProtectionClass) -> Bool { openMask & Self.bit(c) != 0 }
    /// Whether new files of `c` may be created now.
    public func canCreate(_ c: ProtectionClass) -> Bool { createMask & Self.bit(c) != 0 }
}

/// The class keys in memory, by class and key set. Class D lives from mount to exit; C from
/// the first unlock to exit; A and the class B private key from unlock to lock. The class B
/// public key stays after the first unlock so class B files can be created while locked. A
/// lock evicts in two steps (`beginEviction`, `finishEviction`) so dirty pages can still be
/// written back with keys that nothing may read with any more. New files are wrapped for the
/// current key set; older sets only unwrap files written before a device's removal.
public final class ClassKeyring: Sendable {
    private struct Keys {
        var a: [UInt8: SecureKey] = [:]
        var bSecret: [UInt8: SecureKey] = [:]
        var bPublic: [UInt8: [UInt8]] = [:]
        var c: [UInt8: SecureKey] = [:]
        var d: [UInt8: SecureKey] = [:]
        /// The key set of new files.
        var current: UInt8 = 0
        var epoch: UInt64 = 1
        var evicting = false
        /// Between `beginReturnToBeforeFirstUnlock` and `returnToBeforeFirstUnlock`: class B
        /// and C keys only write back dirty pages.
        var returning = false

        /// The snapshot these keys allow (the current set's keys decide).
        var access: KeyAccess {
            var open: UInt8 = 0, create: UInt8 = 0
            let s = current
            if d[s] != nil { open |= KeyAccess.bit(.none); create |= KeyAccess.bit(.none) }
            if c[s] != nil && !returning {
                open |= KeyAccess.bit(.completeUntilFirstUserAuthentication);
                create |= KeyAccess.bit(.completeUntilFirstUserAuthentication)
            }
            if bPublic[s] != nil && !returning { create |= KeyAccess.bit(.completeUnlessOpen) }
            if !evicting {
                if bSecret[s] != nil && bPublic[s] != nil { open |= KeyAccess.bit(.completeUnlessOpen) }
                if a[s] != nil { open |= KeyAccess.bit(.complete); create |= KeyAccess.bit(.complete) }
            }
            return KeyAccess(epoch: epoch, evicting: evicting, openMask: open, createMask: create)
        }

        /// Zeroes and drops every key of the given classes' maps.
        static func wipe(_ maps: inout [UInt8: SecureKey]) {
            for k in maps.values { k.wipe() }
            maps.removeAll()
        }
    }
    /// The class keys and what the lock state allows. Lock order: after a node's `io`,
    /// before `SecureKey`'s lock.
    private let keys: Locked<Keys>
    /// `keys.access` as one word, stored under `keys`' lock and read without it.
    private let published: Atomic<UInt64>
    /// Another device made a newer key set (a removal) that this device lacks: nothing new is
    /// wrapped (creates and class changes are refused), since the removed device would open it.
    public var refusesNewWraps: Bool { behind.load(ordering: .acquiring) }
    /// Set at start, or when a removal record arrives while mounted (`fallBehind`); cleared
    /// only when this device takes up the newer set (`takeUp`).
    private let behind: Atomic<Bool>

    /// A keyring holding only class D of key set 0 (state `beforeFirstUnlock`).
    public convenience init(classD: SecureKey) { self.init(classD: [0: classD], current: 0) }

    /// A keyring holding only the class D keys of each key set (state `beforeFirstUnlock`);
    /// new files use `current`, unless `behind` (see `refusesNewWraps`).
    public init(classD: [UInt8: SecureKey], current: UInt8, behind: Bool = false) {
        let k = Keys(d: classD, current: current)
        keys = Locked(k)
        published = Atomic(k.access.word)
        self.behind = Atomic(behind)
    }

    /// Another device's removal started a key set newer than `currentKeySet`: from now on
    /// nothing new is wrapped (`refusesNewWraps`) until the daemon restarts after `recover`.
    public func fallBehind() { behind.store(true, ordering: .releasing) }

    /// This device took up newer key sets (their A, B and C installed with `install`): adds
    /// their class D keys, makes `current` the set of new files and wraps again (it holds
    /// the newest set now). Duplicates are wiped.
    public func takeUp(classD: [UInt8: SecureKey], current: UInt8) {
        update { k in
            for (s, d) in classD {
                if k.d[s] == nil { k.d[s] = d } else { d.wipe() }
            }
            k.current = max(k.current, current)
        }
        behind.store(false, ordering: .releasing)
    }

    /// What the keys allow right now.
    public var access: KeyAccess { KeyAccess(word: published.load(ordering: .acquiring)) }

    /// The key set new files are wrapped for.
    public var currentKeySet: UInt8 { keys.withLock { $0.current } }

    /// Runs `body` on the keys and publishes the access it leaves.
    private func update<R>(_ body: (inout Keys) -> R) -> R {
        keys.withLock { k in
            let r = body(&k)
            published.store(k.access.word, ordering: .releasing)
            return r
        }
    }

    /// Installs the keys of a successful unlock (one entry per key set); keys already present
    /// are kept and the duplicates wiped.
    public func install(_ unlocked: [UnlockedClassKeys]) {
        update { k in
            for u in unlocked {
                let s = u.keySet
                if k.a[s] == nil { k.a[s] = u.classA } else { u.classA.wipe() }
                if k.bSecret[s] == nil { k.bSecret[s] = u.classBSecret } else { u.classBSecret.wipe() }
                if k.c[s] == nil { k.c[s] = u.classC } else { u.classC.wipe() }
                k.bPublic[s] = u.classBPublic
            }
        }
    }

    /// Installs the keys of one key set (see `install(_:)` for several).
    public func install(_ unlocked: UnlockedClassKeys) { install([unlocked]) }

    /// Lock, step 1: a new epoch; class A and B can no longer be opened, read or (A) created,
    /// while their keys stay in memory for writing back dirty pages.
    public func beginEviction() {
        update { k in
            k.epoch &+= 1
            k.evicting = true
        }
    }

    /// Lock, step 2: zeroes and drops the class A keys and the class B private keys.
    public func finishEviction() {
        update { k in
            Keys.wipe(&k.a)
            Keys.wipe(&k.bSecret)
            k.evicting = false
        }
    }

    /// Return to `beforeFirstUnlock` (inactivity), step 1: a new epoch; class B and C can no
    /// longer be opened, read or created, while their keys stay in memory for writing back
    /// dirty pages (as `beginEviction` does for a lock).
    public func beginReturnToBeforeFirstUnlock() {
        update { k in
            k.epoch &+= 1
            k.evicting = true
            k.returning = true
        }
    }

    /// Return to `beforeFirstUnlock`, step 2 (after step 1, which began the new epoch):
    /// zeroes the class C keys and drops the class B public keys too; only class D stays.
    /// Open class B and C handles stop working (`FileKeyLife.allows`).
    public func returnToBeforeFirstUnlock() {
        update { k in
            Keys.wipe(&k.a)
            Keys.wipe(&k.bSecret)
            Keys.wipe(&k.c)
            k.bPublic.removeAll()
            k.evicting = false
            k.returning = false
        }
    }

    /// Daemon exit: zeroes everything.
    public func wipeAll() {
        update { k in
            for var m in [k.a, k.bSecret, k.c, k.d] { Keys.wipe(&m) }
            let epoch = k.epoch &+ 1
            k = Keys()
            k.epoch = epoch
        }
    }

    /// The key that can wrap a new file key for `cls` in the current key set (the public key
    /// suffices for class B), with the epoch it was taken in and the set; nil when the class
    /// cannot create now.
    public func wrappingKey(for cls: ProtectionClass) -> (key: FileHeader.ClassKey, epoch: UInt64, keySet: UInt8)? {
        keys.withLock { k in
            guard k.access.canCreate(cls), !refusesNewWraps else { return nil }
            let s = k.current
            let key: FileHeader.ClassKey?
            switch cls {
            case .complete: key = k.a[s].map { .symmetric($0) }
            case .completeUnlessOpen: key = k.bPublic[s].map { .classBPublic($0) }
            case .completeUntilFirstUserAuthentication: key = k.c[s].map { .symmetric($0) }
            case .none: key = k.d[s].map { .symmetric($0) }
            }
            return key.map { ($0, k.epoch, s) }
        }
    }

    /// The key that can unwrap an existing file key of `cls` in `keySet`; nil when the class
    /// cannot open now or this device does not hold that set (written after its removal).
    public func unwrappingKey(for cls: ProtectionClass, keySet s: UInt8 = 0) -> FileHeader.ClassKey? {
        keys.withLock { k in
            guard k.access.canOpen(cls) else { return nil }
            switch cls {
            case .complete: return k.a[s].map { .symmetric($0) }
            case .completeUnlessOpen:
                guard let sk = k.bSecret[s], let p = k.bPublic[s] else { return nil }
                return .classBPrivate(sk, p)
            case .completeUntilFirstUserAuthentication: return k.c[s].map { .symmetric($0) }
            case .none: return k.d[s].map { .symmetric($0) }
            }
        }
    }
}
