import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `StoreWatcher` on a seed store (`SeedStoreTestCase`), no mount: another process's change in
/// the store turns a top-level watch into a full one, and the mount expects another writer
/// from then on; its own changes do not.
final class StoreWatcherTests: SeedStoreTestCase {
    /// Runs `/bin/touch` on `path` (another process: the watcher ignores its own).
    func touchFromAnotherProcess(_ path: String) throws {
        let p = Process()
        p.executableURL = URL(fileURLWithPath: "/bin/touch")
        p.arguments = [path]
        try p.run()
        p.waitUntilExit()
        XCTAssertEqual(p.terminationStatus, 0)
    }

    func testAnotherWritersChangeTurnsOnTheFullWatch() throws {
        let w = try XCTUnwrap(
            StoreWatcher.start(fs: fs, storePath: store, full: false) { (0, 0) }, "fanotify (the tests run as root)")
        defer { w.stop() }
        XCTAssertFalse(fs.underneath.anotherWriterExpected)
        // This process's own change is the mount's: nothing happens.
        XCTAssertTrue(FileManager.default.createFile(atPath: store + "/data/OwnChange0", contents: Data()))
        usleep(300_000)
        XCTAssertFalse(fs.underneath.anotherWriterExpected)
        try touchFromAnotherProcess(store + "/data/SomeoneElse0")
        XCTAssertTrue(waitUntil { self.fs.underneath.anotherWriterExpected })
        XCTAssertTrue(
            waitUntil { self.logged().contains { $0.hasPrefix("another process changed the store") } }, "\(logged())")
    }

    func testAStartedWatcherStopsPromptly() throws {
        let w = try XCTUnwrap(StoreWatcher.start(fs: fs, storePath: store, full: true) { (0, 0) })
        XCTAssertTrue(fs.underneath.anotherWriterExpected, "a full watch expects another writer from the start")
        let t0 = Date()
        w.stop()
        XCTAssertLessThan(Date().timeIntervalSince(t0), 1.5)
    }
}
