import XCTest

@testable import KeybagCore

/// A folder made on two devices apart: the metadata copies a sync engine keeps and the names
/// the mount shows for the entries under their IVs.
final class DirectoryIVsTests: XCTestCase {
    let own = [UInt8](repeating: 1, count: 16), first = [UInt8](repeating: 2, count: 16)
    let second = [UInt8](repeating: 3, count: 16)

    func testSyncthingsCopyOfTheMetadataIsRecognisedAndLookalikesAreNot() throws {
        let copy = try XCTUnwrap(MetadataCopy(backing: ".sync-conflict-20261125-101010-HOSTB27.kbfs-dir"))
        XCTAssertEqual([copy.date, copy.time, copy.device], ["20261125", "101010", "HOSTB27"])
        for name in [
            ".kbfs-dir", ".sync-conflict-20261125-101010-HOSTB27.kbfs-dirx",
            ".sync-conflict-2026112-101010-HOSTB27.kbfs-dir",
            ".sync-conflict-20261125-101010-hostb27.kbfs-dir", "x.sync-conflict-20261125-101010-HOSTB27.kbfs-dir",
            ".sync-conflict-20261125-101010-HOSTB27-1.kbfs-dir",
        ] {
            XCTAssertNil(MetadataCopy(backing: name), name)
        }
        XCTAssertEqual(copy.readableName(of: "report.txt"), "report (conflict 2026-11-25 101010 HOSTB27).txt")
        XCTAssertEqual(SyncEngineFile(backing: copy.backing)?.role, .metadataConflict)
    }

    func testCopiesAreTriedInOrderAndOnesWithTheOwnOrARepeatedIVAreDropped() throws {
        let a = try XCTUnwrap(MetadataCopy(backing: ".sync-conflict-20261125-101010-AAAAAAA.kbfs-dir"))
        let b = try XCTUnwrap(MetadataCopy(backing: ".sync-conflict-20261126-090000-BBBBBBB.kbfs-dir"))
        let c = try XCTUnwrap(MetadataCopy(backing: ".sync-conflict-20261127-090000-CCCCCCC.kbfs-dir"))
        let ivs = DirectoryIVs(
            own: own,
            copies: [
                .init(copy: b, iv: second), .init(copy: c, iv: own), .init(copy: a, iv: first),
                .init(copy: c, iv: first),
            ])
        XCTAssertEqual(ivs.all, [own, first, second])
        XCTAssertEqual(ivs.other(date: "20261126", time: "090000", device: "BBBBBBB")?.index, 2)
        XCTAssertNil(ivs.other(date: "20261127", time: "090000", device: "CCCCCCC"), "same IV as the own: no names")
    }

    func testAtMostSixteenCopiesCountFirstByName() throws {
        let names = (0..<40).map { String(format: ".sync-conflict-20261125-1010%02d-AAAAAAA.kbfs-dir", $0) }
        let copies = names.reversed().enumerated().map { i, n in
            DirectoryIVs.Other(copy: MetadataCopy(backing: n)!, iv: [UInt8](repeating: UInt8(i + 10), count: 16))
        }
        let ivs = DirectoryIVs(own: own, copies: copies)
        XCTAssertEqual(ivs.others.count, DirectoryIVs.maxCopies)
        XCTAssertEqual(ivs.others.map(\.copy.backing), Array(names.prefix(16)))
        let picked = DirectoryIVs.copyNames(among: names.shuffled() + ["kept.txt", ".kbfs-dir"])
        XCTAssertEqual(picked.names, Array(names.prefix(16)))
        XCTAssertTrue(picked.leftOut)
    }

    func testAnEntryUnderACopysIVShowsItsNameUnlessTakenThenTheCopysConflictName() throws {
        let a = try XCTUnwrap(MetadataCopy(backing: ".sync-conflict-20261125-101010-AAAAAAA.kbfs-dir"))
        let ivs = DirectoryIVs(own: own, copies: [.init(copy: a, iv: first)])
        XCTAssertEqual(ivs.shownName(plain: "b.txt", index: 1, taken: ["a.txt"]), "b.txt")
        XCTAssertEqual(
            ivs.shownName(plain: "a.txt", index: 1, taken: ["a.txt"]), "a (conflict 2026-11-25 101010 AAAAAAA).txt")
        XCTAssertEqual(ivs.shownName(plain: "a.txt", index: 0, taken: ["a.txt"]), "a.txt", "own names never change")
    }

    func testACopyArrivingOrGoingMakesTheMountReadTheFolderAgain() {
        for event in [StoreChange.Event.appeared, .vanished, .written] {
            let r = StoreChange(
                name: ".sync-conflict-20261125-101010-AAAAAAA.kbfs-dir", event: event, isDirectory: false
            )
            .response
            XCTAssertTrue(r.directoryMeta && r.everyEntry, "\(event)")
        }
    }
}
