import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// `StoreCheck` on a copy of the store the real daemon wrote for the fuzzers (Fuzz/seed-store,
/// opened with its device key, no passcode): clean as made; each kind of foreign entry named by
/// its kind; a repair removes what loses no data and the next check is clean.
final class StoreCheckTests: TempDirTestCase {
    /// The repository's Fuzz folder, found from this file's path.
    static let fuzz = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent().appendingPathComponent("Fuzz").path

    /// A copy of the seed store in the test's folder.
    func seedStore() throws -> String {
        let store = dir + "/store"
        try FileManager.default.copyItem(atPath: Self.fuzz + "/seed-store", toPath: store)
        return store
    }

    /// The kinds of problem a check (or a repair) of `store` names.
    func check(_ store: String, repair: Bool = false) throws -> [String] {
        let key = try DeviceKeyFile.load(from: Self.fuzz + "/seed.key")
        let c = try StoreCheck(
            storePath: store, deviceKey: key, passcode: nil,
            options: StoreCheck.Options(repair: repair, dropData: false))
        defer { c.wipe() }
        try c.run()
        XCTAssertGreaterThan(c.files, 0)
        return c.problems.map(\.kind)
    }

    func testTheSeedStoreIsClean() throws {
        XCTAssertEqual(try check(try seedStore()), [])
    }

    func testForeignEntriesAreNamedByKindAndRepairedWithoutLoss() throws {
        let store = try seedStore()
        let data = store + "/" + Keybag.dataDirName
        XCTAssertTrue(
            FileManager.default.createFile(atPath: data + "/" + BackingKind.temporaryName(), contents: Data()))
        XCTAssertTrue(FileManager.default.createFile(atPath: data + "/.syncthing.abc.tmp", contents: Data([1])))
        XCTAssertTrue(FileManager.default.createFile(atPath: data + "/kbl.orphan.name", contents: Data([2])))
        XCTAssertTrue(FileManager.default.createFile(atPath: store + "/xattrs/orphanset", contents: Data([3])))
        let kinds = try check(store)
        for kind in ["temporary", "sync-engine-file", "side-file-orphan", "xattr-orphan"] {
            XCTAssertTrue(kinds.contains(kind), "\(kind) in \(kinds)")
        }
        _ = try check(store, repair: true)
        XCTAssertEqual(try check(store), ["sync-engine-file"], "left alone: the engine may still be writing it")
        XCTAssertTrue(FileManager.default.fileExists(atPath: data + "/.syncthing.abc.tmp"))
    }

    func testARecordOfAnotherStoreInDevicesIsNamed() throws {
        let store = try seedStore()
        let record = store + "/" + StoreDevices.dirName + "/0123456789abcdef0123456789abcdef.identity"
        let other = try XCTUnwrap(
            try FileManager.default.contentsOfDirectory(atPath: store + "/" + StoreDevices.dirName).first {
                $0.hasSuffix(".identity")
            })
        var bytes = try XCTUnwrap(FileManager.default.contents(atPath: store + "/devices/" + other))
        bytes[bytes.count / 2] ^= 0x10  // a record no device of this store signed
        XCTAssertTrue(FileManager.default.createFile(atPath: record, contents: bytes))
        XCTAssertEqual(try check(store), ["device-record-refused"])
        XCTAssertTrue(FileManager.default.fileExists(atPath: record), "left for the user: fsck does not judge it away")
    }

    func testADamagedBlockIsNamedAndLeftWithoutDropData() throws {
        let store = try seedStore()
        let docs = store + "/" + Keybag.dataDirName
        let victim = try XCTUnwrap(
            FileManager.default.subpaths(atPath: docs)?.first { p in
                var st = stat()
                return lstat(docs + "/" + p, &st) == 0 && st.st_mode & S_IFMT == S_IFREG && st.st_size > 4096
                    && BackingKind.of((p as NSString).lastPathComponent).carriesName
            })
        let fd = open(docs + "/" + victim, O_RDWR)
        XCTAssertGreaterThanOrEqual(fd, 0)
        var b: UInt8 = 0
        XCTAssertEqual(pread(fd, &b, 1, 1000), 1)
        b ^= 0x10
        XCTAssertEqual(pwrite(fd, &b, 1, 1000), 1)
        close(fd)
        let kinds = try check(store, repair: true)
        XCTAssertFalse(kinds.isEmpty, "a flipped bit in \(victim) is named")
        XCTAssertFalse(try check(store).isEmpty, "a repair without dropData keeps the damaged block")
    }
}
