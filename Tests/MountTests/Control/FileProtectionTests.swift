import CFuse
import FileProtection
import Foundation
import Glibc
import Synchronization
import XCTest

/// The FileProtection library against a real mount: protected writes, FileManager
/// protection, errors while locked, availability and events (with a daemon restart), and
/// the SecureNotes example through a lock/unlock cycle.
/// A list several tasks append to.
final class Recorder<T: Sendable>: Sendable {
    private let items = Mutex<[T]>([])
    func append(_ x: T) { items.withLock { $0.append(x) } }
    var all: [T] { items.withLock { $0 } }
    var count: Int { items.withLock { $0.count } }
}

final class FileProtectionTests: XCTestCase {
    func xattr(_ path: String) -> String? {
        var buf = [UInt8](repeating: 0, count: 128)
        let n = getxattr(path, "user.protection", &buf, buf.count)
        return n >= 0 ? String(decoding: buf[0..<n], as: UTF8.self) : nil
    }

    func testProtectedWritesAndFileManagerProtection() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let url = URL(fileURLWithPath: m.path("doc.txt"))
        try Data("first".utf8).write(to: url, protection: .complete)
        XCTAssertEqual(xattr(url.path), "complete")
        XCTAssertEqual(
            try FileManager.default.protection(ofItemAtPath: url.path).rawValue, FileProtectionType.complete.rawValue)
        // Replacing keeps the new class and leaves no temporary behind.
        try Data("second".utf8).writeProtected(to: url, options: [.atomic, .completeFileProtectionUnlessOpen])
        XCTAssertEqual(xattr(url.path), "completeUnlessOpen")
        XCTAssertEqual(try String(contentsOf: url, encoding: .utf8), "second")
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.mnt).sorted(), ["doc.txt"])
        XCTAssertThrowsError(try Data("x".utf8).write(to: url, protection: .none, options: .withoutOverwriting)) {
            XCTAssertEqual(($0 as? CocoaError)?.code, .fileWriteFileExists)
        }
        XCTAssertEqual(try String(contentsOf: url, encoding: .utf8), "second")
        // Without a protection option it is Foundation's write: the directory's default.
        try Data("plain".utf8).writeProtected(to: URL(fileURLWithPath: m.path("plain.txt")))
        XCTAssertEqual(xattr(m.path("plain.txt")), "completeUntilFirstUserAuthentication")
        // Directories: the default for new files, through setProtectedAttributes.
        try FileManager.default.createDirectory(atPath: m.path("Documents"), withIntermediateDirectories: false)
        try FileManager.default.setProtectedAttributes(
            [.protectionKey: FileProtectionType.complete, .posixPermissions: 0o700], ofItemAtPath: m.path("Documents"))
        let attrs = try FileManager.default.protectedAttributesOfItem(atPath: m.path("Documents"))
        XCTAssertEqual((attrs[.protectionKey] as? FileProtectionType)?.rawValue, FileProtectionType.complete.rawValue)
        XCTAssertEqual((attrs[.posixPermissions] as? NSNumber)?.intValue, 0o700)
        XCTAssertTrue(FileManager.default.createFile(atPath: m.path("Documents/new"), contents: Data("n".utf8)))
        XCTAssertEqual(xattr(m.path("Documents/new")), "complete")
        // Locked: a complete file's read error says so; a none file still reads.
        try Data("open".utf8).write(to: URL(fileURLWithPath: m.path("open.txt")), protection: .none)
        XCTAssertEqual(m.ctl(["lock", "--grace", "0"]).code, 0)
        XCTAssertThrowsError(try FileManager.default.protection(ofItemAtPath: m.path("nonexistent"))) {
            XCTAssertEqual(($0 as? CocoaError)?.code, .fileReadNoSuchFile)
        }
        // Foundation's own read maps EACCES to fileReadNoPermission.
        XCTAssertThrowsError(try String(contentsOfFile: m.path("Documents/new"), encoding: .utf8)) {
            XCTAssertEqual(($0 as? CocoaError)?.code, .fileReadNoPermission, "\($0)")
        }
        // The library's errors also say that the lock is the reason (it asks the daemon, found
        // by $KEYBAGFS_SOCKET here since the fixture's socket is not the default one).
        setenv("KEYBAGFS_SOCKET", m.socket, 1)
        defer { unsetenv("KEYBAGFS_SOCKET") }
        XCTAssertThrowsError(try FileManager.default.setProtection(.none, ofItemAtPath: m.path("Documents/new"))) { e in
            let c = e as? CocoaError
            XCTAssertEqual(c?.code, .fileWriteNoPermission, "\(e)")
            XCTAssertEqual(c?.isProtectedDataUnavailable, true, "\(e)")
            XCTAssertTrue(
                "\(c?.userInfo[NSLocalizedDescriptionKey] ?? "")".contains("protected data is not available"), "\(e)")
        }
        // A new `complete` file while locked: the lock is the reason, not permissions
        // (the target does not exist yet, so the class is the one the create asked for).
        XCTAssertThrowsError(
            try Data("new".utf8).writeProtected(
                to: URL(fileURLWithPath: m.path("locked-new.txt")), options: .completeFileProtection)
        ) { e in
            XCTAssertEqual((e as? CocoaError)?.isProtectedDataUnavailable, true, "\(e)")
        }
        XCTAssertEqual(try String(contentsOfFile: m.path("open.txt"), encoding: .utf8), "open")
        XCTAssertFalse(ProtectedData.isAvailable(for: URL(fileURLWithPath: m.mnt), socket: m.socket))
        m.unlock()
        XCTAssertTrue(ProtectedData.isAvailable(for: URL(fileURLWithPath: m.mnt), socket: m.socket))
        XCTAssertEqual(try String(contentsOfFile: m.path("Documents/new"), encoding: .utf8), "n")
        // Not a keybagfs mount.
        XCTAssertThrowsError(try FileManager.default.protection(ofItemAtPath: m.root + "/device.key")) {
            XCTAssertEqual(($0 as? CocoaError)?.code, .featureUnsupported, "\($0)")
        }
    }

    func testEventsFollowLockAndUnlockAndSurviveADaemonRestart() async throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let seen = Recorder<ProtectedDataEvent>()
        let stream = ProtectedData.events(for: URL(fileURLWithPath: m.mnt), socket: m.socket, assuming: true)
        let reader = Task { for await e in stream { seen.append(e) } }
        defer { reader.cancel() }
        func waitFor(_ count: Int) async {
            for _ in 0..<500 { guard seen.count < count else { break }; try? await Task.sleep(nanoseconds: 10_000_000) }
        }
        // Wait until the subscription is live (the daemon counts subscribers).
        for _ in 0..<500 {
            guard !m.ctl(["status", "--json"]).stdout.contains("\"subscribers\":1") else { break };
            try? await Task.sleep(nanoseconds: 10_000_000)
        }
        XCTAssertEqual(m.ctl(["lock", "--grace", "0"]).code, 0)
        await waitFor(2)
        m.unlock()
        await waitFor(3)
        XCTAssertEqual(seen.all, [.willBecomeUnavailable, .didBecomeUnavailable, .didBecomeAvailable])
        // The daemon restarts (state beforeFirstUnlock): the stream reconnects and reports it.
        try m.restart()
        await waitFor(4)
        XCTAssertEqual(seen.all.last, .didBecomeUnavailable, "a change missed while disconnected is reported")
        m.unlock()
        await waitFor(5)
        XCTAssertEqual(seen.all.last, .didBecomeAvailable)
        // Notifications with Apple's names.
        let center = NotificationCenter()
        let names = Recorder<String>()
        let token = center.addObserver(forName: nil, object: nil, queue: nil) { n in names.append(n.name.rawValue) }
        defer { center.removeObserver(token) }
        let poster = ProtectedData.postNotifications(for: URL(fileURLWithPath: m.mnt), socket: m.socket, center: center)
        defer { poster.cancel() }
        for _ in 0..<500 {
            guard !m.ctl(["status", "--json"]).stdout.contains("\"subscribers\":2") else { break };
            try? await Task.sleep(nanoseconds: 10_000_000)
        }
        XCTAssertEqual(m.ctl(["lock", "--grace", "0"]).code, 0)
        for _ in 0..<500 { guard names.count < 2 else { break }; try? await Task.sleep(nanoseconds: 10_000_000) }
        XCTAssertEqual(
            names.all, ["UIApplicationProtectedDataWillBecomeUnavailable", "KeybagfsProtectedDataDidBecomeUnavailable"])
    }

    /// The example app through one lock/unlock cycle, checked by its own output.
    func testSecureNotesExampleThroughALockCycle() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("notes"), 0o755), 0)
        let p = Process()
        p.executableURL = URL(fileURLWithPath: MountFixture.binDir + "/SecureNotes")
        p.arguments = [m.path("notes"), "--socket", m.socket]
        let out = Pipe(), inp = Pipe()
        p.standardOutput = out
        p.standardInput = inp
        try p.run()
        defer { if p.isRunning { p.terminate() }; p.waitUntilExit() }
        var lines: [String] = []
        var pending = Data()
        func expect(_ prefix: String) -> Bool {
            let deadline = Date().addingTimeInterval(10)
            while Date() < deadline {
                if lines.contains(where: { $0.hasPrefix(prefix) }) { return true }
                let d = out.fileHandleForReading.availableData
                if d.isEmpty { return false }
                pending += d
                while let nl = pending.firstIndex(of: 0x0A) {
                    lines.append(String(decoding: pending[pending.startIndex..<nl], as: UTF8.self))
                    pending = Data(pending[(nl + 1)...])
                }
            }
            return false
        }
        func send(_ s: String) { inp.fileHandleForWriting.write(Data((s + "\n").utf8)) }
        XCTAssertTrue(expect("opened notes (complete); merged 0"), "\(lines)")
        XCTAssertTrue(expect("ready"), "\(lines)")
        for _ in 0..<500 {
            guard !m.ctl(["status", "--json"]).stdout.contains("\"subscribers\":1") else { break }; usleep(10_000)
        }
        send("add before the lock")
        XCTAssertTrue(expect("added to notes"), "\(lines)")
        XCTAssertEqual(xattr(m.path("notes/notes.txt")), "complete")
        XCTAssertEqual(m.ctl(["lock", "--grace", "0"]).code, 0)
        XCTAssertTrue(expect("closed notes: protected data will become unavailable"), "\(lines)")
        XCTAssertTrue(expect("locked"), "\(lines)")
        send("add written while locked")
        XCTAssertTrue(expect("queued while locked: entry-"), "\(lines)")
        let queued = try FileManager.default.contentsOfDirectory(atPath: m.path("notes/inbox"))
        XCTAssertEqual(queued.count, 1)
        XCTAssertEqual(xattr(m.path("notes/inbox/" + queued[0])), "completeUnlessOpen")
        send("list")
        XCTAssertTrue(expect("notes unavailable (device locked)"), "\(lines)")
        m.unlock()
        XCTAssertTrue(expect("opened notes (complete); merged 1 queued entries"), "\(lines)")
        send("list")
        XCTAssertTrue(expect("notes: before the lock | written while locked"), "\(lines)")
        send("quit")
        p.waitUntilExit()
        XCTAssertEqual(p.terminationStatus, 0)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.path("notes/inbox")), [])
    }
}
