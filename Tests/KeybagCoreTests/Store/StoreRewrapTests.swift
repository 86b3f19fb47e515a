import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// `StoreRewrap` on a copy of the fuzzers' seed store (two key sets: a device was removed),
/// opened with its device key and passcode: files wrapped for the older set move to the newest
/// with the same file key and content, the old slot erased; a second run has nothing to do; a
/// header that does not open is counted and left byte for byte; a hard link is done once.
final class StoreRewrapTests: TempDirTestCase {
    var store = ""
    var data = ""
    var keys: StoreKeys?

    override func setUp() {
        super.setUp()
        store = dir + "/store"
        data = store + "/" + Keybag.dataDirName
        do {
            try FileManager.default.copyItem(atPath: StoreCheckTests.fuzz + "/seed-store", toPath: store)
            let deviceKey = try DeviceKeyFile.load(from: StoreCheckTests.fuzz + "/seed.key")
            let kb = try Keybag.load(storePath: store, deviceKey: deviceKey)
            keys = try kb.openAll(passcode: secret("fuzz seed passcode"), deviceKey: deviceKey)
        } catch {
            XCTFail("cannot open the seed store: \(error)")
        }
    }

    override func tearDown() {
        keys?.wipe()
        super.tearDown()
    }

    /// The store's keys (the seed store has an older set to move from).
    func storeKeys() throws -> StoreKeys {
        let k = try XCTUnwrap(keys)
        XCTAssertGreaterThanOrEqual(k.current, 1, "the seed store has a second key set (a device was removed)")
        return k
    }

    /// What wraps a file key of class `cls` in key set `n`, written out here from the format's
    /// rules (docs/FORMAT.md, "Key sets"), not taken from the code under test.
    func classKey(_ cls: ProtectionClass, set n: Int, _ k: StoreKeys) -> FileHeader.ClassKey {
        let s = k.sets[n]
        switch cls {
        case .complete: return .symmetric(s.classA)
        case .completeUnlessOpen: return .classBPrivate(s.classBSecret, s.classBPublic)
        case .completeUntilFirstUserAuthentication: return .symmetric(s.classC)
        case .none: return .symmetric(k.classD[n])
        }
    }

    /// Writes `data/<name>`: a header of class `cls` wrapped for key set `set`, then `tail`.
    /// Returns the file key's bytes and the header.
    func makeFile(_ name: String, _ cls: ProtectionClass, set: Int, tail: [UInt8]) throws -> ([UInt8], FileHeader) {
        let k = try storeKeys()
        let fileKey = SecureKey(random: 32)
        defer { fileKey.wipe() }
        let wrap: FileHeader.ClassKey =
            cls == .completeUnlessOpen ? .classBPublic(k.sets[set].classBPublic) : classKey(cls, set: set, k)
        let h = try FileHeader.create(
            fileKey: fileKey, class: cls, cipher: .xchacha20poly1305, using: wrap, keySet: UInt8(set))
        let fd = open(data + "/" + name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
        XCTAssertGreaterThanOrEqual(fd, 0)
        defer { close(fd) }
        try HeaderSlots.writeNew(fd: fd, h)
        _ = tail.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(FileHeader.size)) }
        return (try fileKey.withBytes { Array($0) }, h)
    }

    /// The header of `data/<name>` and the index of a superseded slot.
    func header(_ name: String) throws -> (current: FileHeader, superseded: Int?) {
        let fd = open(data + "/" + name, O_RDONLY | O_CLOEXEC)
        XCTAssertGreaterThanOrEqual(fd, 0)
        defer { close(fd) }
        return try HeaderSlots.read(fd: fd)
    }

    /// The bytes of `data/<name>`.
    func bytes(_ name: String) throws -> [UInt8] {
        Array(try Data(contentsOf: URL(fileURLWithPath: data + "/" + name)))
    }

    /// One rewrap run over the store.
    func rewrap() throws -> StoreRewrap.Result {
        var r = StoreRewrap(storePath: store, keys: try storeKeys())
        return try r.run()
    }

    func testFilesOfAnOlderSetMoveToTheNewestWithTheirKeyAndContent() throws {
        let k = try storeKeys()
        let before = try rewrap()  // the seed store's own files: all on the newest set already
        XCTAssertEqual(before.rewrapped, 0)
        var made: [(String, ProtectionClass, [UInt8], FileHeader, [UInt8])] = []
        for (i, cls) in ProtectionClass.allCases.enumerated() {
            let tail = Sodium.randomArray(5000 + i)
            let (key, h) = try makeFile("old-\(i)", cls, set: 0, tail: tail)
            made.append(("old-\(i)", cls, key, h, tail))
        }
        let r = try rewrap()
        XCTAssertEqual(r.rewrapped, made.count)
        XCTAssertEqual(r.current, before.current)
        XCTAssertEqual(r.skipped, 0)
        for (name, cls, key, old, tail) in made {
            let (h, superseded) = try header(name)
            XCTAssertNil(superseded, "\(name): the old slot is erased")
            XCTAssertEqual(Int(h.keySet), k.current, name)
            XCTAssertEqual(h.protectionClass, cls, name)
            XCTAssertEqual(h.fileID, old.fileID, "\(name): the same file")
            XCTAssertNotEqual(h.slot, old.slot, "\(name): written to the other slot")
            let unwrapped = try h.unwrap(using: classKey(cls, set: k.current, k))
            XCTAssertEqual(try unwrapped.withBytes { Array($0) }, key, "\(name): the same file key")
            unwrapped.wipe()
            let b = try bytes(name)
            let oldSlot = b[(old.slot * FileHeader.slotSize)..<((old.slot + 1) * FileHeader.slotSize)]
            XCTAssertTrue(oldSlot.allSatisfy { $0 == 0 }, "\(name): no wrap for the old set is left")
            XCTAssertEqual(Array(b[FileHeader.size...]), tail, "\(name): no content rewritten")
        }
    }

    func testASecondRunHasNothingToDo() throws {
        _ = try makeFile("a", .completeUntilFirstUserAuthentication, set: 0, tail: [1, 2, 3])
        _ = try makeFile("b", .complete, set: 0, tail: [])
        let first = try rewrap()
        XCTAssertEqual(first.rewrapped, 2)
        let afterFirst = try bytes("a")
        let second = try rewrap()
        XCTAssertEqual(second.rewrapped, 0)
        XCTAssertEqual(second.current, first.current + first.rewrapped)
        XCTAssertEqual(try bytes("a"), afterFirst, "a finished file is not written again")
    }

    func testAHeaderThatDoesNotOpenIsCountedAndLeftAsItIs() throws {
        let garbage = Sodium.randomArray(1000)
        XCTAssertTrue(FileManager.default.createFile(atPath: data + "/garbage", contents: Data(garbage)))
        let (_, h) = try makeFile("forged", .completeUntilFirstUserAuthentication, set: 0, tail: [9])
        // A wrap that does not authenticate: one byte of the wrapped key flipped.
        let fd = open(data + "/forged", O_RDWR | O_CLOEXEC)
        defer { close(fd) }
        let at = off_t(h.slotOffset + FileHeader.slotSize - 20)
        var byte: UInt8 = 0
        XCTAssertEqual(pread(fd, &byte, 1, at), 1)
        byte ^= 0x40
        XCTAssertEqual(pwrite(fd, &byte, 1, at), 1)
        let forged = try bytes("forged")
        let r = try rewrap()
        XCTAssertEqual(r.skipped, 2)
        XCTAssertEqual(r.rewrapped, 0)
        XCTAssertEqual(try bytes("garbage"), garbage)
        XCTAssertEqual(try bytes("forged"), forged)
    }

    func testAHardLinkIsRewrappedOnce() throws {
        let before = try rewrap()
        _ = try makeFile("linked", .none, set: 0, tail: [7])
        XCTAssertEqual(link(data + "/linked", data + "/other-name"), 0)
        let r = try rewrap()
        XCTAssertEqual(r.rewrapped, 1)
        XCTAssertEqual(r.current, before.current, "a file with two names is counted once")
        XCTAssertNil(try header("other-name").superseded)
        XCTAssertEqual(try bytes("other-name"), try bytes("linked"))
    }
}
