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

/// The class keys in memory, by class. Class D lives from mount to exit; C from the first
/// unlock to exit; A and the class B private key from unlock to lock. The class B public
/// key stays after the first unlock so class B files can be created while locked. A lock
/// evicts in two steps (`beginEviction`, `finishEviction`) so dirty pages can still be
/// written back with keys that nothing may read with any more.
public final class ClassKeyring: Sendable {
    private struct Keys {
        var a: SecureKey?
        var bSecret: SecureKey?
        var bPublic: [UInt8]?
        var c: SecureKey?
        var d: SecureKey?
        var epoch: UInt64 = 1
        var evicting = false
        /// Between `beginReturnToBeforeFirstUnlock` and `returnToBeforeFirstUnlock`: class B
        /// and C keys only write back dirty pages.
        var returning = false

        /// The snapshot these keys allow.
        var access: KeyAccess {
            var open: UInt8 = 0, create: UInt8 = 0
            if d != nil { open |= KeyAccess.bit(.none); create |= KeyAccess.bit(.none) }
            if c != nil && !returning {
                open |= KeyAccess.bit(.completeUntilFirstUserAuthentication);
                create |= KeyAccess.bit(.completeUntilFirstUserAuthentication)
            }
            if bPublic != nil && !returning { create |= KeyAccess.bit(.completeUnlessOpen) }
            if !evicting {
                if bSecret != nil && bPublic != nil { open |= KeyAccess.bit(.completeUnlessOpen) }
                if a != nil { open |= KeyAccess.bit(.complete); create |= KeyAccess.bit(.complete) }
            }
            return KeyAccess(epoch: epoch, evicting: evicting, openMask: open, createMask: create)
        }
    }
    private let keys: Locked<Keys>
    /// `keys.access` as one word, stored under `keys`' lock and read without it.
    private let published: Atomic<UInt64>

    /// A keyring holding only class D (state `beforeFirstUnlock`).
    public init(classD: SecureKey) {
        let k = Keys(d: classD)
        keys = Locked(k)
        published = Atomic(k.access.word)
    }

    /// What the keys allow right now.
    public var access: KeyAccess { KeyAccess(word: published.load(ordering: .acquiring)) }

    /// Runs `body` on the keys and publishes the access it leaves.
    private func update<R>(_ body: (inout Keys) -> R) -> R {
        keys.withLock { k in
            let r = body(&k)
            published.store(k.access.word, ordering: .releasing)
            return r
        }
    }

    /// Installs the keys of a successful unlock; keys already present are kept and the
    /// duplicates wiped.
    public func install(_ unlocked: UnlockedClassKeys) {
        update { k in
            if k.a == nil { k.a = unlocked.classA } else { unlocked.classA.wipe() }
            if k.bSecret == nil { k.bSecret = unlocked.classBSecret } else { unlocked.classBSecret.wipe() }
            if k.c == nil { k.c = unlocked.classC } else { unlocked.classC.wipe() }
            k.bPublic = unlocked.classBPublic
        }
    }

    /// Lock, step 1: a new epoch; class A and B can no longer be opened, read or (A) created,
    /// while their keys stay in memory for writing back dirty pages.
    public func beginEviction() {
        update { k in
            k.epoch &+= 1
            k.evicting = true
        }
    }

    /// Lock, step 2: zeroes and drops the class A key and the class B private key.
    public func finishEviction() {
        update { k in
            k.a?.wipe(); k.a = nil
            k.bSecret?.wipe(); k.bSecret = nil
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
    /// zeroes the class C key and the class B public key too; only class D stays. Open
    /// class B and C handles stop working (`FileKeyLife.allows`).
    public func returnToBeforeFirstUnlock() {
        update { k in
            for key in [k.a, k.bSecret, k.c] { key?.wipe() }
            k.a = nil; k.bSecret = nil; k.c = nil; k.bPublic = nil
            k.evicting = false
            k.returning = false
        }
    }

    /// Daemon exit: zeroes everything.
    public func wipeAll() {
        update { k in
            for key in [k.a, k.bSecret, k.c, k.d] { key?.wipe() }
            let epoch = k.epoch &+ 1
            k = Keys()
            k.epoch = epoch
        }
    }

    /// The key that can wrap a new file key for `cls` (public key suffices for class B), with
    /// the epoch it was taken in; nil when the class cannot create now.
    public func wrappingKey(for cls: ProtectionClass) -> (key: FileHeader.ClassKey, epoch: UInt64)? {
        keys.withLock { k in
            guard k.access.canCreate(cls) else { return nil }
            let key: FileHeader.ClassKey?
            switch cls {
            case .complete: key = k.a.map { .symmetric($0) }
            case .completeUnlessOpen: key = k.bPublic.map { .classBPublic($0) }
            case .completeUntilFirstUserAuthentication: key = k.c.map { .symmetric($0) }
            case .none: key = k.d.map { .symmetric($0) }
            }
            return key.map { ($0, k.epoch) }
        }
    }

    /// The key that can unwrap an existing file key of `cls`; nil when the class cannot open now.
    public func unwrappingKey(for cls: ProtectionClass) -> FileHeader.ClassKey? {
        keys.withLock { k in
            guard k.access.canOpen(cls) else { return nil }
            switch cls {
            case .complete: return k.a.map { .symmetric($0) }
            case .completeUnlessOpen:
                guard let s = k.bSecret, let p = k.bPublic else { return nil }
                return .classBPrivate(s, p)
            case .completeUntilFirstUserAuthentication: return k.c.map { .symmetric($0) }
            case .none: return k.d.map { .symmetric($0) }
            }
        }
    }
}
