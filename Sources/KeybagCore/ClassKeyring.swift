import Synchronization

/// The class keys in memory, by class. Class D lives from mount to exit; C from the first
/// unlock to exit; A and the class B private key from unlock to lock. The class B public
/// key stays after the first unlock so class B files can be created while locked.
public final class ClassKeyring: Sendable {
    private struct Keys {
        var a: SecureKey?
        var bSecret: SecureKey?
        var bPublic: [UInt8]?
        var c: SecureKey?
        var d: SecureKey?
    }
    private let keys: Mutex<Keys>

    /// A keyring holding only class D (state `beforeFirstUnlock`).
    public init(classD: SecureKey) {
        keys = Mutex(Keys(d: classD))
    }

    /// Installs the keys of a successful unlock; keys already present are kept and the
    /// duplicates wiped.
    public func install(_ unlocked: UnlockedClassKeys) {
        keys.withLock { k in
            if k.a == nil { k.a = unlocked.classA } else { unlocked.classA.wipe() }
            if k.bSecret == nil { k.bSecret = unlocked.classBSecret } else { unlocked.classBSecret.wipe() }
            if k.c == nil { k.c = unlocked.classC } else { unlocked.classC.wipe() }
            k.bPublic = unlocked.classBPublic
        }
    }

    /// Lock: zeroes and drops the class A key and the class B private key.
    public func evictForLock() {
        keys.withLock { k in
            k.a?.wipe(); k.a = nil
            k.bSecret?.wipe(); k.bSecret = nil
        }
    }

    /// Daemon exit: zeroes everything.
    public func wipeAll() {
        keys.withLock { k in
            for key in [k.a, k.bSecret, k.c, k.d] { key?.wipe() }
            k = Keys()
        }
    }

    /// The key that can wrap a new file key for `cls` (public key suffices for class B); nil when evicted.
    public func wrappingKey(for cls: ProtectionClass) -> FileHeader.ClassKey? {
        keys.withLock { k in
            switch cls {
            case .complete: return k.a.map { .symmetric($0) }
            case .completeUnlessOpen: return k.bPublic.map { .classBPublic($0) }
            case .completeUntilFirstUserAuthentication: return k.c.map { .symmetric($0) }
            case .none: return k.d.map { .symmetric($0) }
            }
        }
    }

    /// The key that can unwrap an existing file key of `cls`; nil when evicted.
    public func unwrappingKey(for cls: ProtectionClass) -> FileHeader.ClassKey? {
        keys.withLock { k in
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

    /// Whether existing files of `cls` may be opened now.
    public func canOpen(_ cls: ProtectionClass) -> Bool { unwrappingKey(for: cls) != nil }

    /// Whether new files of `cls` may be created now.
    public func canCreate(_ cls: ProtectionClass) -> Bool { wrappingKey(for: cls) != nil }
}
