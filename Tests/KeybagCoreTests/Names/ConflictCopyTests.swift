import XCTest

@testable import KeybagCore

/// Syncthing's conflict copies of encrypted names, and the readable names the mount shows.
final class ConflictCopyTests: XCTestCase {
    func testABackingConflictCopyParsesAndRoundTrips() throws {
        let c = try XCTUnwrap(ConflictCopy(backing: "q1w2E3_r-4.sync-conflict-20261125-101010-HOSTB27"))
        XCTAssertEqual(c, ConflictCopy(original: "q1w2E3_r-4", date: "20261125", time: "101010", device: "HOSTB27"))
        XCTAssertEqual(c.backing, "q1w2E3_r-4.sync-conflict-20261125-101010-HOSTB27")
        XCTAssertEqual(c.readableName(of: "report.txt"), "report (conflict 2026-11-25 101010 HOSTB27).txt")
        XCTAssertEqual(c.readableName(of: ".bashrc"), ".bashrc (conflict 2026-11-25 101010 HOSTB27)")
        XCTAssertEqual(c.readableName(of: "archive.tar.gz"), "archive.tar (conflict 2026-11-25 101010 HOSTB27).gz")
        for plain in ["report.txt", ".bashrc", "archive.tar.gz", "no extension", "a (conflict).b"] {
            let shown = c.readableName(of: plain)
            let back = try XCTUnwrap(ConflictCopy.parse(readable: shown), shown)
            XCTAssertEqual(back.plain, plain)
            XCTAssertEqual([back.date, back.time, back.device], ["20261125", "101010", "HOSTB27"])
        }
    }

    func testACopyOfAHashedLongNameIsKnownByTheOriginalsHash() throws {
        let c = try XCTUnwrap(ConflictCopy(backing: "kbl.sync-conflict-20261125-101010-HOSTB27.q1w2-E_r4"))
        XCTAssertEqual(c.original, "kbl.q1w2-E_r4")
        XCTAssertTrue(c.isLong)
        XCTAssertEqual(c.backing, "kbl.sync-conflict-20261125-101010-HOSTB27.q1w2-E_r4")
        XCTAssertEqual([c.date, c.time, c.device], ["20261125", "101010", "HOSTB27"])
        XCTAssertFalse(try XCTUnwrap(ConflictCopy(backing: "q1w2.sync-conflict-20261125-101010-HOSTB27")).isLong)
    }

    func testOtherEntriesAndNamesAreNotConflicts() {
        for backing in [
            "q1w2E3r4", ".kbfs-dir", ".kbfs-dir.sync-conflict-20261125-101010-HOSTB27", "kbl.abc.name",
            "kbl.sync-conflict-20261125-101010-HOSTB27", "kbl.sync-conflict-20261125-101010-HOSTB27.",
            "kbl.sync-conflict-20261125-101010-HOSTB27.a.b", "a.b.sync-conflict-20261125-101010-HOSTB27",
            "abc.sync-conflict-2026112-101010-HOSTB27", "abc.sync-conflict-20261125-101010-hostb27",
            "abc.sync-conflict-20261125-101010-HOSTB2", ".sync-conflict-20261125-101010-HOSTB27",
        ] {
            XCTAssertNil(ConflictCopy(backing: backing), backing)
        }
        for name in [
            "report.txt", "report (conflict).txt", "report (conflict 2026-11-25 HOSTB27).txt",
            "report (conflict 2026-11-25 1010 HOSTB27).txt", "report (conflict 2026-11-25 101010 hostb27).txt",
            " (conflict 2026-11-25 101010 HOSTB27)",
        ] {
            XCTAssertNil(ConflictCopy.parse(readable: name), name)
        }
    }
}
