/// The whole life of one file's content key, owned by one backing inode (hard links share
/// it): loaded from the header while its class allows, counted by open handles, used to
/// write back dirty pages during a lock's eviction, wiped by the lock or by the last close.
/// The daemon keeps one under each inode's lock and asks it before every use of the key.
///
/// Rules, per class:
/// - `complete` (A): open, read and create only while A can open (unlocked, not evicting)
///   and only with a key loaded in the current lock epoch; writes are also accepted while
///   evicting with the key of the epoch that lock ends (write-back of dirty pages); the
///   eviction wipes the key even with handles open.
/// - `completeUnlessOpen` (B): open needs the class private key; a handle keeps the key
///   through a lock; the last close while B cannot open wipes it; so does an eviction when
///   no handle is open.
/// - `completeUntilFirstUserAuthentication` (C), `none` (D): not touched by a lock. A return
///   to `beforeFirstUnlock` (inactivity) first lets C and B keys only write back dirty
///   pages, then wipes them, open handles or not.
/// - A class change needs the current class openable now — not merely a key some handle
///   holds — and the target class's wrapping key.
public struct FileKeyLife: Sendable {
    /// What a key is wanted for.
    public enum Use: Sendable { case read, write }

    /// The parsed header, once read.
    public private(set) var header: FileHeader?
    /// Whether another writer rewrote the file in place (a sync engine): the kernel's view of
    /// it (size, pages) and this key may not match it any more, so every use fails (EIO); the
    /// daemon gives the next lookup a new node.
    public private(set) var superseded = false
    /// The file key, while loaded.
    private var key: FileContentKey?
    /// The lock epoch the key was loaded or adopted in.
    private var keyEpoch: UInt64 = 0
    /// Open handles on this inode.
    public private(set) var openCount = 0

    public init() {}

    /// The class, once the header is known.
    public var protectionClass: ProtectionClass? { header?.protectionClass }

    /// The header, read with `read` the first time.
    public mutating func header(_ read: () throws -> FileHeader) throws -> FileHeader {
        if let h = header { return h }
        let h = try read()
        header = h
        return h
    }

    /// The loaded key when it may serve `use` under `access` as it is (no loading, no
    /// change): what a reader holding the inode's lock shared may use.
    public func readyKey(for use: Use, _ access: KeyAccess) -> FileContentKey? {
        guard !superseded, let k = key, let cls = header?.protectionClass, !k.isWiped else { return nil }
        return Self.allows(cls, use: use, keyEpoch: keyEpoch, access) ? k : nil
    }

    /// Whether a loaded key of class `cls` from `keyEpoch` may serve `use` now.
    static func allows(_ cls: ProtectionClass, use: Use, keyEpoch: UInt64, _ access: KeyAccess) -> Bool {
        switch cls {
        case .none: return true
        // C outlives a lock, not a return to beforeFirstUnlock; B lives with its handles while
        // the public key does. Both still write back dirty pages while that return evicts.
        case .completeUntilFirstUserAuthentication: return access.canOpen(cls) || (use == .write && access.evicting)
        case .completeUnlessOpen: return access.canCreate(cls) || (use == .write && access.evicting)
        case .complete: break
        }
        if access.canOpen(.complete) { return keyEpoch == access.epoch }
        return use == .write && access.evicting && keyEpoch == access.epochBeingEvicted
    }

    /// The key for I/O through an open handle: the ready key, else loaded from the header
    /// when the class can open now; `keyUnavailable` otherwise (a stale key is wiped).
    public mutating func key(for use: Use, keyring: ClassKeyring, cipher: ContentCipher) throws -> FileContentKey {
        let access = keyring.access
        if let k = readyKey(for: use, access) { return k }
        guard !superseded else { throw KeybagError.corrupt("the file was rewritten underneath: open it again") }
        guard let h = header else { throw KeybagError.corrupt("file header not loaded") }
        dropKey()
        guard access.canOpen(h.protectionClass),
            let classKey = keyring.unwrappingKey(for: h.protectionClass, keySet: h.keySet)
        else {
            throw KeybagError.keyUnavailable
        }
        guard h.cipher.sharesLayout(with: cipher) else {
            throw KeybagError.corrupt(
                "the file's cipher \(h.cipher.name) has another block layout than the store's \(cipher.name)")
        }
        let raw = try h.unwrap(using: classKey)
        let k: FileContentKey
        do { k = try FileContentKey(key: raw, header: h) } catch { raw.wipe(); throw error }
        key = k
        keyEpoch = access.epoch
        return k
    }

    /// A new handle: the class must open now; loads the key and counts the handle.
    public mutating func open(keyring: ClassKeyring, cipher: ContentCipher) throws -> FileContentKey {
        guard let h = header else { throw KeybagError.corrupt("file header not loaded") }
        guard keyring.access.canOpen(h.protectionClass) else { throw KeybagError.keyUnavailable }
        let k = try key(for: .read, keyring: keyring, cipher: cipher)
        openCount += 1
        return k
    }

    /// A file this daemon just created, with its first handle: its header and key, sealed
    /// with a class key taken in `epoch`. A class A create that a lock overtook (another
    /// epoch, or A can no longer create) is refused and its key wiped.
    public mutating func adoptCreated(
        header h: FileHeader, key k: FileContentKey, epoch: UInt64, keyring: ClassKeyring
    ) throws {
        let access = keyring.access
        let overtaken = h.protectionClass == .complete && access.epoch != epoch
        guard !overtaken, access.canCreate(h.protectionClass) else {
            k.wipe()
            throw KeybagError.keyUnavailable
        }
        dropKey()
        header = h
        key = k
        keyEpoch = access.epoch
        openCount += 1
    }

    /// A handle closed. The last close of a class B file wipes its key while class B cannot
    /// open; `pagesMustGo` then says the inode's cached plaintext must leave the kernel too.
    public mutating func release(keyring: ClassKeyring) -> (lastClose: Bool, pagesMustGo: Bool) {
        openCount = max(0, openCount - 1)
        if openCount == 0, header?.protectionClass == .completeUnlessOpen, !keyring.access.canOpen(.completeUnlessOpen)
        {
            dropKey()
            return (true, true)
        }
        return (openCount == 0, false)
    }

    /// Whether a lock must drop this inode's cached pages: class A, or class B with no
    /// handle open (handles of B keep reading through a lock).
    public var holdsProtectedPages: Bool {
        switch header?.protectionClass {
        case .complete?: return true
        case .completeUnlessOpen?: return openCount == 0
        default: return false
        }
    }

    /// Whether a return to `beforeFirstUnlock` must write back this inode's cached pages:
    /// every class but D needs a key that return removes.
    public var holdsKeyOtherThanNone: Bool {
        guard let cls = header?.protectionClass else { return false }
        return cls != .none
    }

    /// The lock's eviction, once the class keys are gone: wipes a class A key and the key
    /// of a class B file no handle holds. True when the inode's cached pages must go.
    public mutating func evict() -> Bool {
        guard holdsProtectedPages else { return false }
        dropKey()
        return true
    }

    /// Return to `beforeFirstUnlock`: wipes every key but a class D one. True when the
    /// inode's cached pages must go.
    public mutating func evictAllButNone() -> Bool {
        guard holdsKeyOtherThanNone else { return false }
        dropKey()
        return true
    }

    /// Changes the class by rewrapping the key: the current class must open now and the
    /// target must have a wrapping key. `persist` makes the new header durable (and erases
    /// the old slot) before it takes effect here.
    public mutating func changeClass(
        to cls: ProtectionClass, keyring: ClassKeyring, cipher: ContentCipher,
        persist: (FileHeader) throws -> Void
    ) throws {
        guard let h = header else { throw KeybagError.corrupt("file header not loaded") }
        guard h.protectionClass != cls else { return }
        guard keyring.access.canOpen(h.protectionClass) else { throw KeybagError.keyUnavailable }
        let k = try key(for: .read, keyring: keyring, cipher: cipher)
        guard let (wrapKey, epoch, keySet) = keyring.wrappingKey(for: cls) else { throw KeybagError.keyUnavailable }
        let next = try h.rewrapped(fileKey: k.key, to: cls, using: wrapKey, keySet: keySet)
        try persist(next)
        header = next
        keyEpoch = epoch
    }

    /// Another writer rewrote the file in place (a sync engine): the key is wiped and every
    /// later use fails. Open handles stay counted; the header's class still decides what a
    /// lock drops.
    public mutating func supersede() {
        dropKey()
        superseded = true
    }

    /// Daemon exit: wipes the key.
    public mutating func wipe() { dropKey() }

    /// Zeroes and forgets the key.
    private mutating func dropKey() {
        key?.wipe()
        key = nil
    }
}
