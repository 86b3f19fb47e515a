import XCTest

@testable import KeybagCore

/// What a backing name is: the one classifier every site of the store switches on.
final class BackingKindTests: XCTestCase {
    let short = "q1w2E3r4-_Zz"

    func testSyncEngineFilesAreRecognisedAndStoreNamesAreNot() {
        let temporaries = [
            ".syncthing.\(short).tmp", "~syncthing~\(short).tmp", "\(short).a1B2c3.partial",
            ".unison.\(short).x.unison.tmp",
            "\(short).!sync", ".~tmp~\(short)", ".\(short).Ab12Cd", ".kbl.abc.name.XYZ123",
        ]
        for n in temporaries {
            XCTAssertEqual(SyncEngineFile(backing: n)?.role, .temporary, n)
            guard case .syncEngine = BackingKind.of(n) else { return XCTFail("\(n): \(BackingKind.of(n))") }
        }
        for n in [".stfolder", ".stignore", ".stversions"] {
            XCTAssertEqual(SyncEngineFile(backing: n), SyncEngineFile(backing: n))
            XCTAssertEqual(SyncEngineFile(backing: n)?.role, .folderFile, n)
        }
        XCTAssertEqual(SyncEngineFile(backing: ".syncthing.\(short).tmp")?.engine, "Syncthing")
        XCTAssertTrue(SyncEngineFile(backing: ".syncthing.x.tmp")!.description.contains("left alone"))
        for n in [
            short, ".kbfs-dir", ".kbfs-tmp-abc", "kbl.abc", "kbl.abc.name",
            "\(short).sync-conflict-20261125-101010-HOSTB27",
            ".\(short).Ab12C", "report.txt",
        ] {
            XCTAssertNil(SyncEngineFile(backing: n), n)
        }
    }

    func testBackingKinds() {
        XCTAssertEqual(BackingKind.of(short), .name)
        XCTAssertEqual(BackingKind.of("\(short).sync-conflict-20261125-101010-HOSTB27"), .name)
        XCTAssertEqual(BackingKind.of("kbl.abc"), .longName)
        XCTAssertEqual(BackingKind.of("kbl.abc.name"), .sideFile(entry: "kbl.abc"))
        XCTAssertEqual(BackingKind.of(".kbfs-dir"), .directoryMeta)
        XCTAssertEqual(BackingKind.of(".kbfs-tmp-xyz"), .storeFile)
        XCTAssertEqual(BackingKind.of("report.txt"), .foreign)
        XCTAssertEqual(BackingKind.of(".stfolder"), .syncEngine(SyncEngineFile(backing: ".stfolder")!))
        // rclone's partial copy of a long name is the engine's, not an entry to look up.
        XCTAssertEqual(BackingKind.of("kbl.abc.partial"), .syncEngine(SyncEngineFile(backing: "kbl.abc.partial")!))
    }

    func testTemporaryNamesAreTheStoresOwnAndCarryNoName() {
        let a = BackingKind.temporaryName(), b = BackingKind.temporaryName()
        XCTAssertNotEqual(a, b)
        XCTAssertTrue(a.hasPrefix(".kbfs-tmp-"), a)
        XCTAssertEqual(BackingKind.of(a), .storeFile)
        XCTAssertFalse(BackingKind.of(a).carriesName)
        XCTAssertFalse(BackingKind.of(".kbfs-dir").carriesName)
        XCTAssertFalse(BackingKind.of("kbl.abc.name").carriesName)
        for n in [short, "kbl.abc", "report.txt", ".stfolder"] { XCTAssertTrue(BackingKind.of(n).carriesName, n) }
    }
}
