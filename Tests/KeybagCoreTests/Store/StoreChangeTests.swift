import XCTest

@testable import KeybagCore

/// What a change another writer made to a backing name means for the mount.
final class StoreChangeTests: XCTestCase {
    let short = "q1w2E3r4-_Zz"

    func testWhatAChangeUnderneathMakesTheMountDrop() {
        typealias R = StoreChange.Response
        func r(_ name: String, _ e: StoreChange.Event, dir: Bool = false) -> R {
            StoreChange(name: name, event: e, isDirectory: dir).response
        }
        // A file renamed over its name, a new file, a deleted one: the name is looked up again.
        XCTAssertEqual(r(short, .appeared), R(entry: short))
        XCTAssertEqual(r(short, .vanished), R(entry: short))
        XCTAssertEqual(r("kbl.abc", .appeared), R(entry: "kbl.abc"))
        // Written in place (rsync --inplace): looked up again as a new node; chmod: attributes.
        XCTAssertEqual(r(short, .written), R(rewritten: short))
        XCTAssertEqual(r(short, .attributesChanged), R(attributes: short))
        // Directories: watched when they appear, and inheritance is recomputed.
        XCTAssertEqual(r(short, .appeared, dir: true), R(entry: short, newDirectory: true, classesMayChange: true))
        XCTAssertEqual(r(short, .vanished, dir: true), R(entry: short, classesMayChange: true))
        // A side file names its entry anew; its removal follows the entry's.
        XCTAssertEqual(r("kbl.abc.name", .appeared), R(entry: "kbl.abc"))
        XCTAssertEqual(r("kbl.abc.name", .vanished), .nothing)
        // A directory's metadata replaced: read again, and every name it gave looked up again
        // (its IV may now be a copy's); removed: kept (the directory is going).
        XCTAssertEqual(r(".kbfs-dir", .appeared), R(directoryMeta: true, everyEntry: true, classesMayChange: true))
        XCTAssertEqual(r(".kbfs-dir", .vanished), .nothing)
        // Transfers in progress, the engine's own files, the store's temporaries: nothing.
        for n in [".syncthing.\(short).tmp", ".stfolder", ".kbfs-tmp-abc", "report.txt"] {
            for e in [StoreChange.Event.appeared, .vanished, .written, .attributesChanged] {
                XCTAssertTrue(r(n, e).isNothing, "\(n) \(e)")
            }
        }
    }
}
