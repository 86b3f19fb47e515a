import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// What a store writer can put where a small store file belongs (issue 49): a FIFO, a huge
/// file, a symlink out of the store. Each read refuses it at once, naming the file.
final class StoreFileReadTests: TempDirTestCase {
    /// Runs `body` on a thread; returns its error text, or nil when it was still blocked after
    /// two seconds (the FIFO at `fifo` is then opened for writing, so the thread ends).
    func refusal(unblocking fifo: String, _ body: @escaping @Sendable () throws -> Void) -> String? {
        let done = DispatchSemaphore(value: 0)
        let result = Locked<String?>(nil)
        Thread {
            do { try body(); result.withLock { $0 = "no error" } } catch { result.withLock { $0 = "\(error)" } }
            done.signal()
        }.start()
        if done.wait(timeout: .now() + 2) == .success { return result.withLock { $0 } }
        let w = open(fifo, O_WRONLY | O_NONBLOCK)
        if w >= 0 { close(w) }
        _ = done.wait(timeout: .now() + 5)
        return nil
    }

    /// A FIFO named `keybag`: loading the store is refused, never blocked on (the daemon's
    /// start and every `keybagfs` command read it).
    func testFIFOKeybagIsRefusedWithoutBlocking() throws {
        let store = dir + "/store"
        try FileManager.default.createDirectory(atPath: store, withIntermediateDirectories: true)
        XCTAssertEqual(mkfifo(store + "/keybag", 0o600), 0)
        let why = refusal(unblocking: store + "/keybag") { _ = try Keybag.load(storePath: store) }
        XCTAssertNotNil(why, "loading a store whose keybag is a FIFO blocked")
        XCTAssertTrue(why?.contains("not a regular file") ?? false, why ?? "")
    }

    /// A FIFO as a pairing file or removal record: read as absent at once.
    func testFIFODeviceFilesAreNotBlockedOn() throws {
        let store = dir + "/store"
        try FileManager.default.createDirectory(atPath: store + "/devices", withIntermediateDirectories: true)
        let id = String(repeating: "ab", count: 16)
        let fifo = PairingMessages.path(store, id, "request")
        XCTAssertEqual(mkfifo(fifo, 0o600), 0)
        let why = refusal(unblocking: fifo) {
            if PairingMessages.read(PairingMessages.Request.self, store, id, "request") != nil {
                throw KeybagError.invalid("a FIFO read as a request")
            }
        }
        XCTAssertEqual(why, "no error", "reading a pairing file that is a FIFO blocked or decoded")
    }

    /// A keybag grown to 64 MiB (sparse) is refused by its size before it is read.
    func testHugeKeybagIsRefusedBySize() throws {
        let store = dir + "/store"
        try FileManager.default.createDirectory(atPath: store, withIntermediateDirectories: true)
        XCTAssertEqual(truncate(store + "/keybag", 0), -1)
        let fd = open(store + "/keybag", O_WRONLY | O_CREAT, 0o600)
        XCTAssertEqual(ftruncate(fd, 64 << 20), 0)
        close(fd)
        XCTAssertThrowsError(try Keybag.load(storePath: store)) { e in
            XCTAssertTrue("\(e)".contains("more than"), "\(e)")
        }
    }

    /// A keybag that is a symlink (to a file outside the store) is not followed.
    func testSymlinkKeybagIsNotFollowed() throws {
        let store = dir + "/store"
        try FileManager.default.createDirectory(atPath: store, withIntermediateDirectories: true)
        try Data("{}".utf8).write(to: URL(fileURLWithPath: dir + "/elsewhere"))
        XCTAssertEqual(symlink(dir + "/elsewhere", store + "/keybag"), 0)
        XCTAssertThrowsError(try Keybag.load(storePath: store)) { e in
            XCTAssertTrue("\(e)".contains("not a regular file"), "\(e)")
        }
    }
}
