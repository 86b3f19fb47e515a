import CFuse
import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `XattrStorage` on a folder of its own: sets sealed and counted, a torn set read as empty
/// and named in the log it was given, a writer's FIFO refused without blocking.
final class XattrStorageTests: TemporaryFolderTestCase {
    var names: NameCipher!

    override func setUpWithError() throws {
        try super.setUpWithError()
        names = try NameCipher(volumeKey: SecureKey(random: 32))
    }

    func testSetsAreSealedCountedAndRemovedWhenEmpty() throws {
        let (log, lines) = EventLog.recording()
        let x = XattrStorage(dirFD: dirFD, names: names, log: log)
        XCTAssertFalse(x.holdsAny)
        try x.update { try x.save("id1", XattrSet(values: ["user.note": Array("hello".utf8)]), existed: false) }
        XCTAssertTrue(x.holdsAny)
        XCTAssertEqual(try x.load("id1").values["user.note"], Array("hello".utf8))
        let stored = try XCTUnwrap(FileManager.default.contents(atPath: dir + "/id1"))
        XCTAssertNil(stored.range(of: Data("hello".utf8)), "a set is sealed at rest")
        try x.update { try x.save("id1", XattrSet(), existed: true) }
        XCTAssertFalse(x.holdsAny)
        XCTAssertFalse(x.exists("id1"))
        XCTAssertEqual(lines(), [])
    }

    func testATornSetReadsEmptyAndIsNamedInTheGivenLog() throws {
        let (log, lines) = EventLog.recording()
        let x = XattrStorage(dirFD: dirFD, names: names, log: log)
        try x.update { try x.save("id2", XattrSet(values: ["user.a": [1, 2, 3]]), existed: false) }
        XCTAssertEqual(truncate(dir + "/id2", 5), 0)
        XCTAssertEqual(try x.load("id2").values, [:])
        XCTAssertEqual(lines().count, 1)
        XCTAssertTrue(lines().first?.contains("id2") == true, "\(lines())")
    }

    func testAFIFOInPlaceOfASetIsAnErrorNotAWait() throws {
        let x = XattrStorage(dirFD: dirFD, names: names, log: EventLog { _ in })
        XCTAssertEqual(mkfifo(dir + "/id3", 0o644), 0)
        XCTAssertThrowsError(try x.load("id3"))
    }

    func testCreateAndReplaceFlagsAsSetxattrHasThem() throws {
        let x = XattrStorage(dirFD: dirFD, names: names, log: EventLog { _ in })
        try x.set("id4", name: "user.a", value: [1], flags: 0)
        XCTAssertThrowsError(try x.set("id4", name: "user.a", value: [2], flags: kbfs_XATTR_CREATE)) {
            XCTAssertEqual(($0 as? FSError)?.errno, EEXIST)
        }
        XCTAssertThrowsError(try x.set("id4", name: "user.b", value: [2], flags: kbfs_XATTR_REPLACE)) {
            XCTAssertEqual(($0 as? FSError)?.errno, ENODATA)
        }
        try x.set("id4", name: "user.a", value: [3], flags: kbfs_XATTR_REPLACE)
        try x.set("id4", name: "user.b", value: [], flags: kbfs_XATTR_CREATE)
        XCTAssertEqual(try x.value("id4", name: "user.a"), [3])
        XCTAssertEqual(try x.names("id4"), ["user.a", "user.b"])
        try x.remove("id4", name: "user.a")
        XCTAssertThrowsError(try x.remove("id4", name: "user.a")) { XCTAssertEqual(($0 as? FSError)?.errno, ENODATA) }
        XCTAssertThrowsError(try x.value("id4", name: "user.a")) { XCTAssertEqual(($0 as? FSError)?.errno, ENODATA) }
        try x.remove("id4", name: "user.b")
        XCTAssertFalse(x.exists("id4"), "the last name removed removes the set")
    }
}
