import XCTest

@testable import KeybagCore

/// The rules of a file key's life across unlock, the two steps of a lock, handles, class
/// changes and creates that race a lock — without FUSE.
final class FileKeyLifeTests: KeyLifeTestCase {
    func testClassAKeyServesWritesOnlyWhileEvictingAndIsWipedByTheLock() throws {
        let ring = try unlockedKeyring()
        var a = try file(.complete, ring)
        let k = try a.open(keyring: ring, cipher: cipher)
        XCTAssertNotNil(a.readyKey(for: .read, ring.access))
        ring.beginEviction()
        XCTAssertNil(a.readyKey(for: .read, ring.access), "no plaintext served once a lock evicts")
        XCTAssertTrue(a.readyKey(for: .write, ring.access) === k, "dirty pages are still sealed")
        assertUnavailable(try a.key(for: .read, keyring: ring, cipher: cipher), "read while evicting")
        XCTAssertTrue(a.holdsProtectedPages)
        ring.finishEviction()
        XCTAssertTrue(a.evict(), "class A pages go even with a handle open")
        XCTAssertTrue(k.isWiped)
        assertUnavailable(try a.key(for: .write, keyring: ring, cipher: cipher), "write when locked")
        assertUnavailable(try a.key(for: .read, keyring: ring, cipher: cipher), "read when locked")
        ring.install(try freshUnlock())
        XCTAssertFalse(
            try a.key(for: .read, keyring: ring, cipher: cipher).isWiped, "reloaded from the header after unlock")
    }

    func testAFileRewrittenUnderneathIsSupersededItsKeyWipedAndEveryUseRefused() throws {
        let ring = try unlockedKeyring()
        var c = try file(.completeUntilFirstUserAuthentication, ring)
        let k = try c.open(keyring: ring, cipher: cipher)
        c.supersede()
        XCTAssertTrue(k.isWiped)
        XCTAssertTrue(c.superseded)
        XCTAssertNil(c.readyKey(for: .read, ring.access))
        for use in [FileKeyLife.Use.read, .write] {
            XCTAssertThrowsError(try c.key(for: use, keyring: ring, cipher: cipher)) { e in
                guard case KeybagError.corrupt = e else { return XCTFail("\(e)") }  // EIO, not EACCES
            }
        }
        XCTAssertEqual(c.openCount, 1, "its handles stay counted")
        XCTAssertEqual(c.protectionClass, .completeUntilFirstUserAuthentication, "the class still decides a lock")
        XCTAssertEqual(c.release(keyring: ring).lastClose, true)
    }

    func testAClassAKeyThatMissedAnEvictionIsStaleAfterward() throws {
        let ring = try unlockedKeyring()
        var a = try file(.complete, ring)
        let old = try a.open(keyring: ring, cipher: cipher)
        ring.evictForLock()  // this inode was not visited (the race of a create)
        XCTAssertNil(a.readyKey(for: .write, ring.access))
        ring.install(try freshUnlock())
        XCTAssertNil(a.readyKey(for: .read, ring.access), "a key from an earlier epoch is never used")
        let fresh = try a.key(for: .read, keyring: ring, cipher: cipher)
        XCTAssertTrue(old.isWiped, "the stale key is wiped when replaced")
        XCTAssertFalse(fresh === old)
    }

    func testCreateOvertakenByALockIsRefused() throws {
        let ring = try unlockedKeyring()
        let (wrap, epoch, _) = try XCTUnwrap(ring.wrappingKey(for: .complete))
        let raw = SecureKey(random: 32)
        let h = try FileHeader.create(fileKey: raw, class: .complete, cipher: cipher, using: wrap)
        let key = try FileContentKey(key: raw, header: h)
        ring.evictForLock()
        ring.install(try freshUnlock())  // even unlocked again: the create spanned a lock
        var a = FileKeyLife()
        assertUnavailable(try a.adoptCreated(header: h, key: key, epoch: epoch, keyring: ring), "create across a lock")
        XCTAssertTrue(key.isWiped)
        XCTAssertEqual(a.openCount, 0)
        // In the same epoch it is adopted with its first handle.
        let (w2, e2, _) = try XCTUnwrap(ring.wrappingKey(for: .complete))
        let raw2 = SecureKey(random: 32)
        let h2 = try FileHeader.create(fileKey: raw2, class: .complete, cipher: cipher, using: w2)
        try a.adoptCreated(header: h2, key: try FileContentKey(key: raw2, header: h2), epoch: e2, keyring: ring)
        XCTAssertEqual(a.openCount, 1)
        // Class B is created while locked with the public key alone, across epochs too.
        ring.evictForLock()
        let (wb, eb, _) = try XCTUnwrap(ring.wrappingKey(for: .completeUnlessOpen))
        XCTAssertNil(ring.wrappingKey(for: .complete))
        let rawB = SecureKey(random: 32)
        let hb = try FileHeader.create(fileKey: rawB, class: .completeUnlessOpen, cipher: cipher, using: wb)
        var b = FileKeyLife()
        try b.adoptCreated(header: hb, key: try FileContentKey(key: rawB, header: hb), epoch: eb, keyring: ring)
    }

    func testClassBKeyLivesWithItsHandlesAndItsClassCannotBeChangedWhileLocked() throws {
        let ring = try unlockedKeyring()
        var b = try file(.completeUnlessOpen, ring)
        let k = try b.open(keyring: ring, cipher: cipher)
        ring.evictForLock()
        XCTAssertFalse(b.evict(), "a handle is open: pages and key stay")
        XCTAssertTrue(b.readyKey(for: .read, ring.access) === k)
        for target in [ProtectionClass.none, .completeUntilFirstUserAuthentication, .complete] {
            assertUnavailable(
                try b.changeClass(to: target, keyring: ring, cipher: cipher) { _ in XCTFail("persisted") },
                "B -> \(target) while locked")
        }
        XCTAssertEqual(b.protectionClass, .completeUnlessOpen)
        let closed = b.release(keyring: ring)
        XCTAssertTrue(closed.lastClose)
        XCTAssertTrue(closed.pagesMustGo, "the kernel's cached plaintext must go with the key")
        XCTAssertTrue(k.isWiped, "the last close while locked wipes the key")
        assertUnavailable(try b.open(keyring: ring, cipher: cipher), "reopen while locked")
        ring.install(try freshUnlock())
        _ = try b.open(keyring: ring, cipher: cipher)
        let unlockedClose = b.release(keyring: ring)
        XCTAssertTrue(unlockedClose.lastClose)
        XCTAssertFalse(unlockedClose.pagesMustGo, "unlocked, the key and the pages stay")
    }

    func testClassChangesNeedTheCurrentClassOpenableAndTheTargetCreatable() throws {
        let ring = try unlockedKeyring()
        var c = try file(.completeUntilFirstUserAuthentication, ring)
        var persisted: [FileHeader] = []
        try c.changeClass(to: .none, keyring: ring, cipher: cipher) { persisted.append($0) }
        XCTAssertEqual(c.protectionClass, ProtectionClass.none)
        ring.beginEviction()
        assertUnavailable(
            try c.changeClass(to: .complete, keyring: ring, cipher: cipher) { _ in }, "to A while evicting")
        ring.finishEviction()
        assertUnavailable(try c.changeClass(to: .complete, keyring: ring, cipher: cipher) { _ in }, "to A while locked")
        try c.changeClass(to: .completeUnlessOpen, keyring: ring, cipher: cipher) { persisted.append($0) }
        XCTAssertEqual(persisted.map(\.protectionClass), [ProtectionClass.none, .completeUnlessOpen])
        XCTAssertEqual(persisted.map(\.generation), [2, 3])
        // A failed persist changes nothing.
        ring.install(try freshUnlock())
        XCTAssertThrowsError(
            try c.changeClass(to: .complete, keyring: ring, cipher: cipher) { _ in
                throw KeybagError.system("pwrite", ENOSPC)
            })
        XCTAssertEqual(c.protectionClass, .completeUnlessOpen)
    }

    // The inactivity return in two steps, like a lock: first nothing of class B or C may be
    // opened, read or created while their keys still write back dirty pages; then the keys go.
    func testReturnToBeforeFirstUnlockWritesBackFirstAndRefusesReadsAtOnce() throws {
        let ring = try unlockedKeyring()
        var b = try file(.completeUnlessOpen, ring), c = try file(.completeUntilFirstUserAuthentication, ring)
        let kb = try b.open(keyring: ring, cipher: cipher), kc = try c.open(keyring: ring, cipher: cipher)
        ring.evictForLock()
        XCTAssertTrue(b.readyKey(for: .read, ring.access) === kb, "locked: the open class B handle keeps reading")
        ring.beginReturnToBeforeFirstUnlock()
        XCTAssertTrue(ring.access.evicting)
        for cls in [ProtectionClass.completeUnlessOpen, .completeUntilFirstUserAuthentication] {
            XCTAssertFalse(ring.access.canOpen(cls), "\(cls)"); XCTAssertFalse(ring.access.canCreate(cls), "\(cls)")
        }
        XCTAssertTrue(ring.access.canOpen(.none))
        XCTAssertNil(b.readyKey(for: .read, ring.access)); XCTAssertNil(c.readyKey(for: .read, ring.access))
        XCTAssertTrue(b.readyKey(for: .write, ring.access) === kb, "dirty class B pages are written back")
        XCTAssertTrue(c.readyKey(for: .write, ring.access) === kc, "dirty class C pages are written back")
        assertUnavailable(try c.key(for: .read, keyring: ring, cipher: cipher), "class C read while returning")
        ring.returnToBeforeFirstUnlock()
        XCTAssertFalse(ring.access.evicting)
        XCTAssertTrue(b.evictAllButNone()); XCTAssertTrue(c.evictAllButNone())
        XCTAssertTrue(kb.isWiped); XCTAssertTrue(kc.isWiped)
        assertUnavailable(try c.key(for: .write, keyring: ring, cipher: cipher), "class C write after the return")
    }

    func testKeyringPublishesWhatEachStepAllows() throws {
        let ring = ClassKeyring(classD: SecureKey(random: 32))
        XCTAssertEqual(ProtectionClass.allCases.filter { ring.access.canOpen($0) }, [.none])
        ring.install(try freshUnlock())
        let e0 = ring.access.epoch
        XCTAssertTrue(ProtectionClass.allCases.allSatisfy { ring.access.canOpen($0) && ring.access.canCreate($0) })
        ring.beginEviction()
        XCTAssertEqual(ring.access.epoch, e0 + 1)
        XCTAssertTrue(ring.access.evicting)
        XCTAssertFalse(ring.access.canOpen(.complete)); XCTAssertFalse(ring.access.canCreate(.complete))
        XCTAssertFalse(ring.access.canOpen(.completeUnlessOpen));
        XCTAssertTrue(ring.access.canCreate(.completeUnlessOpen))
        XCTAssertNil(ring.unwrappingKey(for: .complete))
        XCTAssertNil(ring.wrappingKey(for: .complete))
        ring.finishEviction()
        XCTAssertFalse(ring.access.evicting)
        XCTAssertTrue(ring.access.canOpen(.completeUntilFirstUserAuthentication))
        XCTAssertFalse(ring.access.canOpen(.complete))
    }
}
