import XCTest

@testable import KeybagCore

/// A list of files standing for the daemon's inode table; at each page-cache pass it plays
/// the kernel writing dirty pages back through the daemon (a write-key fetch per file).
final class ListedFiles: EvictionTarget {
    let files: [(id: UInt64, life: RWLocked<FileKeyLife>)]
    let keyring: ClassKeyring
    /// Each pass: its ids, which of them could write back, which a new handle could open.
    var passes: [(pass: Eviction.Pass, ids: Set<UInt64>, wrote: Set<UInt64>, opened: Set<UInt64>)] = []

    init(_ lives: [UInt64: FileKeyLife], keyring: ClassKeyring) {
        files = lives.sorted { $0.key < $1.key }.map { ($0.key, RWLocked($0.value)) }
        self.keyring = keyring
    }

    func fileKeyLives() -> [(id: UInt64, life: RWLocked<FileKeyLife>)] { files }

    func dropPageCache(_ ids: [UInt64], pass: Eviction.Pass, of kind: Eviction.Kind) {
        let opened = Set(
            files.filter { ids.contains($0.id) }.compactMap { f -> UInt64? in
                f.life.write { life -> UInt64? in
                    guard (try? life.open(keyring: keyring, cipher: .default)) != nil else { return nil }
                    _ = life.release(keyring: keyring)
                    return f.id
                }
            })
        passes.append((pass, Set(ids), serving(.write, among: ids), opened))
    }

    /// The ids (of `among`, or all) whose key serves `use` now, loading it where allowed.
    func serving(_ use: FileKeyLife.Use, among ids: [UInt64]? = nil) -> Set<UInt64> {
        Set(
            files.filter { ids?.contains($0.id) ?? true }.compactMap { f in
                (try? f.life.write { try $0.key(for: use, keyring: keyring, cipher: .default) }) != nil ? f.id : nil
            })
    }
}

/// The eviction's phases and its handle rule, each checked without FUSE.
final class EvictionTests: KeyLifeTestCase {
    // Node ids of the files below.
    let a: UInt64 = 1, bOpen: UInt64 = 2, bClosed: UInt64 = 3, c: UInt64 = 4, d: UInt64 = 5

    /// One file of each class with its key loaded; the class B file `bOpen` has a handle,
    /// `bClosed` had one (closed while unlocked: its key stays), the class A file has one.
    func filesOfEveryClass(_ ring: ClassKeyring) throws -> ListedFiles {
        var lives: [UInt64: FileKeyLife] = [:]
        for (id, cls) in [
            (a, ProtectionClass.complete), (bOpen, .completeUnlessOpen), (bClosed, .completeUnlessOpen),
            (c, .completeUntilFirstUserAuthentication), (d, .none),
        ] {
            var life = try file(cls, ring)
            _ = try life.open(keyring: ring, cipher: cipher)
            if id == bClosed { XCTAssertEqual(life.release(keyring: ring).pagesMustGo, false) }
            lives[id] = life
        }
        return ListedFiles(lives, keyring: ring)
    }

    func testALockWritesBackClassAAndIdleClassBThenWipesTheirKeys() throws {
        let ring = try unlockedKeyring()
        let files = try filesOfEveryClass(ring)
        let epoch = ring.access.epoch
        Eviction(.lock).run(keyring: ring, target: files)
        XCTAssertEqual(files.passes.map(\.pass), [.writeBack, .afterEviction])
        let writeBack = files.passes[0], after = files.passes[1]
        XCTAssertEqual(writeBack.ids, [a, bClosed], "pages that need an evicted key")
        XCTAssertEqual(writeBack.wrote, [a, bClosed], "the keys still seal the kernel's write-back")
        XCTAssertEqual(writeBack.opened, [], "but no new handle opens")
        XCTAssertNil(files.files[0].life.read { $0.readyKey(for: .read, ring.access) }, "nor does class A serve reads")
        XCTAssertEqual(after.ids, [a, bClosed])
        XCTAssertEqual(after.wrote, [], "nothing written back once the keys are gone")
        XCTAssertEqual(files.serving(.read), [bOpen, c, d], "an open class B handle, C and D read on")
        XCTAssertEqual(ring.access.epoch, epoch + 1)
        XCTAssertFalse(ring.access.evicting)
        XCTAssertNil(ring.unwrappingKey(for: .complete))
    }

    func testAReturnToBeforeFirstUnlockWritesBackEveryClassButNoneThenWipesThem() throws {
        let ring = try unlockedKeyring()
        let files = try filesOfEveryClass(ring)
        Eviction(.lock).run(keyring: ring, target: files)
        Eviction(.returnToBeforeFirstUnlock).run(keyring: ring, target: files)
        let writeBack = files.passes[2], after = files.passes[3]
        XCTAssertEqual(writeBack.pass, .writeBack)
        XCTAssertEqual(writeBack.ids, [a, bOpen, bClosed, c])
        XCTAssertEqual(writeBack.wrote, [bOpen, c], "the keys still in memory seal the write-back")
        XCTAssertEqual(writeBack.opened, [])
        XCTAssertEqual(after.ids, [a, bOpen, bClosed, c])
        XCTAssertEqual(files.serving(.read), [d], "only class none is left")
        XCTAssertEqual(files.serving(.write), [d])
        XCTAssertNil(ring.wrappingKey(for: .completeUnlessOpen), "no class B file can be created either")
    }

    func testTheWriteBackEpochIsTheOneTheLockEnds() throws {
        let ring = try unlockedKeyring()
        var life = try file(.complete, ring)
        _ = try life.open(keyring: ring, cipher: cipher)
        let loadedIn = ring.access.epoch
        Eviction(.lock).begin(ring)
        XCTAssertEqual(ring.access.epochBeingEvicted, loadedIn)
        XCTAssertNotNil(life.readyKey(for: .write, ring.access))
        // A key of an earlier epoch (one that missed an eviction) never writes back.
        let stale = KeyAccess(epoch: ring.access.epoch + 1, evicting: true, openMask: 0, createMask: 0)
        XCTAssertNil(life.readyKey(for: .write, stale))
    }

    func testHandlesAreRefusedForClassAWhenLockedAndForBAndCOnlyAfterTheReturn() throws {
        let ring = try unlockedKeyring()
        func refused(_ step: String) -> Set<ProtectionClass> {
            let r = Set(ProtectionClass.allCases.filter { Eviction.refusesHandles(of: $0, ring.access) })
            // The hot path's fast check never says "nothing refused" while something is.
            XCTAssertTrue(r.isEmpty || Eviction.mayRefuseHandles(ring.access), step)
            return r
        }
        XCTAssertEqual(refused("unlocked"), [])
        XCTAssertFalse(Eviction.mayRefuseHandles(ring.access))
        Eviction(.lock).begin(ring)
        XCTAssertEqual(refused("evicting"), [.complete], "while the lock evicts")
        Eviction(.lock).finish(ring)
        XCTAssertEqual(refused("locked"), [.complete], "locked")
        Eviction(.returnToBeforeFirstUnlock).begin(ring)
        XCTAssertEqual(
            refused("returning"), [.completeUnlessOpen, .completeUntilFirstUserAuthentication, .complete],
            "while returning")
        Eviction(.returnToBeforeFirstUnlock).finish(ring)
        XCTAssertEqual(
            refused("before first unlock"), [.completeUnlessOpen, .completeUntilFirstUserAuthentication, .complete],
            "before first unlock")
        ring.install(try freshUnlock())
        XCTAssertEqual(refused("unlocked again"), [])
    }
}
