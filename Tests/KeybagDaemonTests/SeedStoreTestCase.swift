import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// A copy of the store the real daemon wrote for the fuzzers (Fuzz/seed-store, its device key;
/// passcode `fuzz seed passcode`) per test, opened as the daemon opens it: the keybag (bound to
/// the device key), class D, the names, and a `Filesystem` over it without a mount, whose log
/// the test reads (a base class: no tests).
class SeedStoreTestCase: XCTestCase {
    var dir = ""
    var store = ""
    var fds: [Int32] = []
    var keybag: Keybag!
    var deviceKey: SecureKey!
    var keyring: ClassKeyring!
    var fs: Filesystem!
    /// The lines the filesystem (and what uses its log) wrote.
    var logged: (@Sendable () -> [String])!

    /// The repository's Fuzz folder, found from this file's path.
    static let fuzz = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().appendingPathComponent("Fuzz").path

    override func setUpWithError() throws {
        dir = makeTemporaryFolder()
        setenv("STATE_DIRECTORY", dir + "/state", 1)
        store = dir + "/store"
        try FileManager.default.copyItem(atPath: Self.fuzz + "/seed-store", toPath: store)
        deviceKey = try DeviceKeyFile.load(from: Self.fuzz + "/seed.key")
        keybag = try Keybag.load(storePath: store, deviceKey: deviceKey)
        // Bound to the device key as the daemon's start binds it (else a failed attempt
        // cannot be saved, and a wrong passcode is refused as an internal error).
        XCTAssertEqual(try keybag.authenticate(deviceKey: deviceKey), .authentic)
        keyring = ClassKeyring(
            classD: try keybag.classDKeys(deviceKey: deviceKey), current: UInt8(keybag.currentKeySet))
        let volume = try keybag.unwrapDeviceKeySlot("volume", deviceKey: deviceKey)
        defer { volume.wipe() }
        for sub in [Keybag.dataDirName, Keybag.targetsDirName, Keybag.xattrsDirName] {
            fds.append(open(store + "/" + sub, O_RDONLY | O_DIRECTORY | O_CLOEXEC))
        }
        let (log, lines) = EventLog.recording()
        logged = lines
        fs = try Filesystem(
            dataFD: fds[0], targetsFD: fds[1], xattrsFD: fds[2], names: try NameCipher(volumeKey: volume),
            keyring: keyring, cipher: keybag.cipher, defaultClass: .completeUntilFirstUserAuthentication,
            kernel: KernelNotifier(negotiated: { MountNegotiation(directIOMappable: true, writeback: false) }),
            log: log)
    }

    override func tearDown() {
        for fd in fds where fd >= 0 { close(fd) }
        try? FileManager.default.removeItem(atPath: dir)
    }

    /// A passcode as the control socket hands it on.
    func passcode(_ s: String) -> SecureKey { SecureKey(count: s.utf8.count) { $0.copyBytes(from: Array(s.utf8)) } }

    /// Polls `condition` every 10 ms for up to 5 s.
    func waitUntil(_ condition: () -> Bool) -> Bool {
        for _ in 0..<500 where !condition() { usleep(10_000) }
        return condition()
    }
}
