import Foundation
import Glibc
import XCTest

/// The store after a crash or an offline edit, read through a real mount: what must be
/// an error (a cut or extended file, edited header bytes) and what must keep working
/// (a headerless empty file, an orphaned long-name side file).
final class StoreDamageTests: XCTestCase {
    /// Bytes of one full ciphertext block in this store (from the keybag's cipher).
    func cipherBlockSize(_ m: MountFixture) throws -> Int {
        let o = try XCTUnwrap(
            JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: m.store + "/keybag")))
                as? [String: Any])
        return (o["cipher"] as? String) == "aes256gcm" ? 4096 + 28 : 4096 + 40
    }

    /// The backing file's bytes.
    func backingBytes(_ path: String) throws -> [UInt8] { [UInt8](try Data(contentsOf: URL(fileURLWithPath: path))) }

    /// Replaces the backing file's bytes in place (same inode).
    func setBackingBytes(_ path: String, _ b: [UInt8]) {
        let fd = open(path, O_WRONLY | O_TRUNC)
        XCTAssertGreaterThanOrEqual(fd, 0)
        XCTAssertEqual(write(fd, b, b.count), b.count)
        close(fd)
    }

    func testACutOrExtendedFileIsAnError() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let data = (0..<21_480).map { UInt8(truncatingIfNeeded: $0 &* 31 &+ 7) }
        XCTAssertEqual(writeFile(m.path("f"), data), 0)
        let b = m.backing("f")
        m.unmount()
        let cb = try cipherBlockSize(m)
        let full = try backingBytes(b)
        let cases: [(String, [UInt8])] = [
            ("cut after 3 blocks (21,480 -> 12,288 bytes)", Array(full[0..<(320 + 3 * cb)])),
            ("cut after 1 block", Array(full[0..<(320 + cb)])),
            ("a zero block appended", full + [UInt8](repeating: 0, count: cb)),
            ("the last block appended again", full + Array(full[(320 + 5 * cb)...])),
            (
                "the last block zeroed",
                Array(full[0..<(320 + 5 * cb)]) + [UInt8](repeating: 0, count: full.count - 320 - 5 * cb)
            ),
        ]
        for (what, bytes) in cases {
            setBackingBytes(b, bytes)
            try m.mount()
            m.unlock()
            XCTAssertEqual(errnoOf(readFile(m.path("f"))), EIO, what)
            m.unmount()
        }
        setBackingBytes(b, full)
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("f")).get(), data, "the original bytes read back")
        // A file of whole blocks with a zero block appended.
        let whole = [UInt8](repeating: 0x42, count: 3 * 4096)
        XCTAssertEqual(writeFile(m.path("g"), whole), 0)
        let g = m.backing("g")
        m.unmount()
        setBackingBytes(g, try backingBytes(g) + [UInt8](repeating: 0, count: cb))
        try m.mount()
        m.unlock()
        XCTAssertEqual(errnoOf(readFile(m.path("g"))), EIO, "a zero block appended to a file of whole blocks")
    }

    func testEveryHeaderByteIsChecked() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("f"), bytes("header bytes")), 0)
        let b = m.backing("f")
        m.unmount()
        let original = try backingBytes(b)
        // The slot in use: 10 (flags), 11 (zero), 148..<160 (zero); the erased slot too.
        for pos in [10, 11, 148, 159, 160, 170, 319] {
            var bad = original
            bad[pos] ^= 0x02
            setBackingBytes(b, bad)
            try m.mount()
            m.unlock()
            XCTAssertEqual(errnoOf(readFile(m.path("f"))), EIO, "byte \(pos) changed")
            m.unmount()
        }
        setBackingBytes(b, original)
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("f")).get(), bytes("header bytes"))
    }

    func testAnEmptyBackingFileWithoutHeaderIsAnEmptyFileOfItsDirectorysClass() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("d"), "completeUnlessOpen"), 0)
        XCTAssertEqual(writeFile(m.path("d/f"), bytes("to be lost")), 0)
        let b = m.backing("d/f")
        m.unmount()
        XCTAssertEqual(truncate(b, 0), 0, "as a crash between naming and header left it")
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("d/f")).get(), [], "reads as empty, not EIO")
        XCTAssertEqual(try getXattr(m.path("d/f")).get(), "completeUnlessOpen")
        let fd = sysOpen(m.path("d/f"), O_RDWR | O_CREAT)
        XCTAssertGreaterThanOrEqual(fd, 0)
        XCTAssertEqual(try sysPwrite(fd, bytes("new"), 0).get(), 3)
        close(fd)
        try m.restart()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("d/f")).get(), bytes("new"))
    }

    func testAnOrphanedLongNameSideFileDoesNotBlockRmdir() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
        let long = String(repeating: "n", count: 220)
        XCTAssertEqual(writeFile(m.path("d/" + long), bytes("x")), 0)
        let b = m.backing("d/" + long)
        XCTAssertTrue(b.contains("/kbl."), b)
        m.unmount()
        XCTAssertEqual(unlink(b), 0, "the entry goes, its side file stays")
        XCTAssertTrue(FileManager.default.fileExists(atPath: b + ".name"))
        try m.mount()
        m.unlock()
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: m.path("d")), [])
        XCTAssertEqual(rmdir(m.path("d")), 0, "rmdir: \(String(cString: strerror(errno)))")
        XCTAssertFalse(FileManager.default.fileExists(atPath: m.path("d")))
    }
}
