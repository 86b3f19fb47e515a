import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `AtomicStoreFile` in a folder of its own: the store's small files are created once,
/// replaced whole, and no temporary is left behind for the store checker to report.
final class AtomicStoreFileTests: TemporaryFolderTestCase {
    func contents(_ name: String) -> String? {
        FileManager.default.contents(atPath: dir + "/" + name).map { String(decoding: $0, as: UTF8.self) }
    }

    func names() -> [String] { (try? FileManager.default.contentsOfDirectory(atPath: dir).sorted()) ?? [] }

    func testCreateIfAbsentKeepsTheFirstWriterAndLeavesNoTemporary() throws {
        XCTAssertTrue(try AtomicStoreFile.createIfAbsent(dirFD: dirFD, "meta", Array("first".utf8)))
        XCTAssertFalse(try AtomicStoreFile.createIfAbsent(dirFD: dirFD, "meta", Array("second".utf8)))
        XCTAssertEqual(contents("meta"), "first", "a racing second creator does not overwrite")
        XCTAssertEqual(names(), ["meta"])
    }

    func testReplaceSwapsTheWholeFileAndLeavesNoTemporary() throws {
        try AtomicStoreFile.replace(dirFD: dirFD, "long-name", Array("old and longer".utf8))
        let before = try FileManager.default.attributesOfItem(atPath: dir + "/long-name")[.systemFileNumber] as? Int
        try AtomicStoreFile.replace(dirFD: dirFD, "long-name", Array("new".utf8), durable: false)
        XCTAssertEqual(contents("long-name"), "new", "no tail of the old bytes")
        let after = try FileManager.default.attributesOfItem(atPath: dir + "/long-name")[.systemFileNumber] as? Int
        XCTAssertNotEqual(before, after, "a new file renamed into place: a reader holds the old one or the new")
        XCTAssertEqual(names(), ["long-name"])
    }

    func testAFailedCreateOrReplaceLeavesNoTemporary() {
        XCTAssertEqual(mkdir(dir + "/taken", 0o755), 0)
        XCTAssertThrowsError(try AtomicStoreFile.replace(dirFD: dirFD, "taken", [1])) {
            XCTAssertEqual(($0 as? FSError)?.errno, EISDIR)
        }
        XCTAssertThrowsError(try AtomicStoreFile.createIfAbsent(dirFD: dirFD, "missing/x", [1])) {
            XCTAssertEqual(($0 as? FSError)?.errno, ENOENT)
        }
        XCTAssertEqual(names(), ["taken"])
    }

    func testATemporaryFolderIsRemovedWithWhatItHolds() throws {
        let tmp = BackingKind.temporaryName()
        XCTAssertEqual(mkdir(dir + "/" + tmp, 0o700), 0)
        let inner = open(dir + "/" + tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        try AtomicStoreFile.replace(dirFD: inner, ".kbfs-dir", [1, 2, 3])
        close(inner)
        AtomicStoreFile.removeTemporaryFolder(dirFD: dirFD, tmp)
        XCTAssertEqual(names(), [])
    }
}
