import Foundation
import XCTest

@testable import KeybagCore

/// When a store is taken to have another writer, which decides whether it is watched in full.
final class StoreSharingTests: TempDirTestCase {
    /// A store folder `sub` below the test's folder, with a data folder.
    private func store(_ sub: String) throws -> String {
        let path = dir + "/" + sub
        try FileManager.default.createDirectory(atPath: path + "/data", withIntermediateDirectories: true)
        return path
    }

    func testAStoreAloneHasNoOtherWriter() throws {
        XCTAssertNil(StoreSharing.evidence(storePath: try store("home/docs/store")))
    }

    func testASyncEngineMarkerInTheStoreOrAFolderAboveItIsEvidence() throws {
        let s = try store("home/Sync/vault/store")
        XCTAssertEqual(mkdir(dir + "/home/Sync/.stfolder", 0o755), 0)
        let why = try XCTUnwrap(StoreSharing.evidence(storePath: s))
        XCTAssertTrue(why.contains("Syncthing") && why.contains("/home/Sync"), why)
        // Through a symlink to it, and with a trailing slash, the same.
        XCTAssertEqual(symlink(s, dir + "/link"), 0)
        XCTAssertNotNil(StoreSharing.evidence(storePath: dir + "/link/"))

        let n = try store("nc/store")
        XCTAssertTrue(FileManager.default.createFile(atPath: dir + "/nc/._sync_0a1b2c3d.db", contents: Data()))
        XCTAssertEqual(StoreSharing.evidence(storePath: n).map { $0.contains("Nextcloud") }, true)
        let d = try store("Dropbox/store")
        XCTAssertTrue(FileManager.default.createFile(atPath: d + "/.dropbox", contents: Data()))
        XCTAssertEqual(StoreSharing.evidence(storePath: d).map { $0.contains("Dropbox") }, true)
        // Names that only look alike are not markers.
        for name in [".stfolder.bak", "sync_1.db", ".sync_notes.txt", "dropbox"] {
            XCTAssertNil(StoreSharing.engine(ofMarker: name), name)
        }
    }

    func testAnotherDevicesKeybagIsEvidenceAndARemovalRecordAloneIsNot() throws {
        let s = try store("store")
        XCTAssertEqual(mkdir(s + "/devices", 0o700), 0)
        XCTAssertTrue(FileManager.default.createFile(atPath: s + "/devices/00ff.removed", contents: Data()))
        XCTAssertNil(StoreSharing.evidence(storePath: s))
        XCTAssertTrue(FileManager.default.createFile(atPath: s + "/devices/00ff.keybag", contents: Data()))
        XCTAssertEqual(StoreSharing.evidence(storePath: s).map { $0.contains("several devices") }, true)
    }
}
