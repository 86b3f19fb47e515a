import Foundation
import Glibc
import KeybagCore
import XCTest

/// Content ciphers as a user meets them: what `init` picks, and an existing store moved to
/// XAES-256-GCM with `keybagfs cipher`, its old files still reading, its new files on AES.
final class CipherStoreTests: XCTestCase {
    /// The cipher named in the header of a file in the mount.
    func cipherOf(_ m: MountFixture, _ rel: String) throws -> ContentCipher {
        let data = [UInt8](try Data(contentsOf: URL(fileURLWithPath: m.backing(rel))).prefix(FileHeader.size))
        return try FileHeader.parse(data).cipher
    }

    /// `keybagfs` with arguments.
    func keybagfs(_ args: [String]) -> ToolResult { MountFixture.run(MountFixture.binDir + "/keybagfs", args) }

    func testNewStoresUseXAESWhereTheCPUHasAES() throws {
        let m = try MountFixture()
        defer { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("f"), bytes("hello")), 0)
        XCTAssertEqual(try cipherOf(m, "f"), HardwareAES.isAvailable ? .xaes256gcm : .xchacha20poly1305)
        XCTAssertEqual(
            keybagfs(["cipher", m.store]).stdout, (HardwareAES.isAvailable ? "xaes256gcm" : "xchacha20poly1305") + "\n")
        XCTAssertEqual(m.status()["aesMemoryLocked"] as? Bool, true, "OpenSSL's memory is keybagfs' and locked")
    }

    func testAnXChaChaStoreMovesToXAESWithoutCopyingItsFiles() throws {
        let m = try MountFixture(cipher: "xchacha20poly1305")
        defer { m.close() }
        m.unlock()
        var rng = SeededBytes(seed: 77)
        let old = rng.bytes(300_000), kept = rng.bytes(5000), saved = rng.bytes(9000)
        XCTAssertEqual(mkdir(m.path("a"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("a"), "complete"), 0)
        XCTAssertEqual(writeFile(m.path("old"), old), 0)
        XCTAssertEqual(writeFile(m.path("a/kept"), kept), 0)
        XCTAssertEqual(writeFile(m.path("a/doc"), rng.bytes(100)), 0)
        XCTAssertEqual(try cipherOf(m, "old"), .xchacha20poly1305)
        let busy = keybagfs(["cipher", m.store, "xaes256gcm", "--device-key", m.deviceKey])
        XCTAssertEqual(busy.code, 1, "refused while mounted")
        XCTAssertTrue(busy.stderr.contains("is mounted"), busy.stderr)
        m.unmount()
        let r = keybagfs(["cipher", m.store, "xaes256gcm", "--device-key", m.deviceKey])
        XCTAssertEqual(r.code, 0, r.stderr)
        XCTAssertTrue(r.stdout.contains("new files get xaes256gcm (was xchacha20poly1305)"), r.stdout)
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("old")).get(), old, "an old file reads")
        XCTAssertEqual(try readFile(m.path("a/kept")).get(), kept)
        XCTAssertEqual(writeFile(m.path("new"), bytes("new file")), 0)
        XCTAssertEqual(try cipherOf(m, "new"), .xaes256gcm)
        // How editors save: a temporary, then a rename over the old name.
        XCTAssertEqual(writeFile(m.path("a/.doc.tmp"), saved), 0)
        XCTAssertEqual(rename(m.path("a/.doc.tmp"), m.path("a/doc")), 0)
        XCTAssertEqual(try cipherOf(m, "a/doc"), .xaes256gcm)
        // An old file written in place keeps its cipher and stays whole.
        let fd = sysOpen(m.path("old"), O_RDWR)
        XCTAssertGreaterThanOrEqual(fd, 0)
        XCTAssertEqual(try sysPwrite(fd, bytes("patched"), 4000).get(), 7)
        close(fd)
        var expect = old
        expect.replaceSubrange(4000..<4007, with: bytes("patched"))
        XCTAssertEqual(try cipherOf(m, "old"), .xchacha20poly1305)
        // Both kinds lock alike, and read after a restart.
        m.lock(grace: 0)
        XCTAssertEqual(sysOpen(m.path("a/kept"), O_RDONLY), -EACCES)
        XCTAssertEqual(sysOpen(m.path("a/doc"), O_RDONLY), -EACCES)
        try m.restart()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("old")).get(), expect)
        XCTAssertEqual(try readFile(m.path("a/doc")).get(), saved)
        XCTAssertEqual(try readFile(m.path("a/kept")).get(), kept)
        m.unmount()
        let fsck = m.fsck()
        XCTAssertEqual(fsck.code, 0, "fsck of a store with both ciphers: \(fsck.problems) \(fsck.out)")
    }

    func testAnAESGCMStoreKeepsItsCipherAndUnknownCiphersAreNamed() throws {
        let m = try MountFixture(cipher: "aes256gcm", mount: false)
        defer { m.close() }
        let r = keybagfs(["cipher", m.store, "xaes256gcm", "--device-key", m.deviceKey])
        XCTAssertEqual(r.code, 1)
        XCTAssertTrue(r.stderr.contains("another layout"), r.stderr)
        XCTAssertEqual(keybagfs(["cipher", m.store]).stdout, "aes256gcm\n")
        // What a keybagfs meets in a keybag from a newer one: a clear refusal, nothing changed.
        let path = m.store + "/keybag"
        let before = try String(contentsOfFile: path, encoding: .utf8)
        try before.replacingOccurrences(of: "\"aes256gcm\"", with: "\"aes512ocb\"").write(
            toFile: path, atomically: true, encoding: .utf8)
        let mounted = MountFixture.run(
            MountFixture.binDir + "/keybagfs",
            ["mount", m.store, m.mnt, "--socket", m.socket, "--device-key", m.deviceKey])
        XCTAssertNotEqual(mounted.code, 0)
        XCTAssertTrue(mounted.stderr.contains("unknown cipher aes512ocb"), mounted.stderr)
        XCTAssertFalse(m.isMounted)
    }

    /// The keybag's cipher name is authenticated with the device key: edited offline (to put
    /// new files on 96-bit nonces), the mount refuses; `keybagfs cipher` sets it again.
    /// A keybag written before the MAC gets one at the next start.
    func testAnOfflineEditOfTheCipherIsRefused() throws {
        let m = try MountFixture()
        defer { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("f"), bytes("kept")), 0)
        m.unmount()
        let path = m.store + "/keybag"
        let original = try String(contentsOfFile: path, encoding: .utf8)
        let name = ContentCipher.default.name
        XCTAssertTrue(original.contains("\"cipherMAC\""), original)
        try original.replacingOccurrences(of: "\"\(name)\"", with: "\"aes256gcm\"").write(
            toFile: path, atomically: true, encoding: .utf8)
        func mountOnce() -> ToolResult {
            MountFixture.run(
                MountFixture.binDir + "/keybagfs",
                ["mount", m.store, m.mnt, "--socket", m.socket, "--device-key", m.deviceKey])
        }
        let refused = mountOnce()
        XCTAssertNotEqual(refused.code, 0)
        XCTAssertTrue(refused.stderr.contains("edited offline"), refused.stderr)
        XCTAssertFalse(m.isMounted)
        let set = keybagfs(["cipher", m.store, name, "--device-key", m.deviceKey])
        XCTAssertEqual(set.code, 0, set.stderr)
        // Stripping the MAC and the fields keybags before it lacked no longer passes for an old
        // keybag: the settings MAC (format 4) covers the device fields, so it is an edit.
        // (Keybags really written before the MACs upgrade in place: KeybagTests.)
        let current = try String(contentsOfFile: path, encoding: .utf8)
        let newer = ["\"cipherMAC\"", "\"deviceID\"", "\"deviceName\""]
        let withoutMAC = current.split(separator: "\n").filter { l in !newer.contains { l.contains($0) } }.joined(
            separator: "\n")
        try withoutMAC.write(toFile: path, atomically: true, encoding: .utf8)
        let stripped = mountOnce()
        XCTAssertNotEqual(stripped.code, 0, "a stripped keybag mounted")
        XCTAssertTrue(stripped.stderr.contains("edited offline"), stripped.stderr)
        try current.write(toFile: path, atomically: true, encoding: .utf8)
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("f")).get(), bytes("kept"))
    }
}
