import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// Writes below a file's known hole-free start reserve nothing; everything else still
/// reserves before a byte lands (so a full store refuses the write whole).
final class AllocatedStartTests: TempDirTestCase {
    func testOnlyOverwritesBelowTheKnownStartSkipTheReservation() throws {
        let cipher = ContentCipher.xaes256gcm
        let fd = open(dir + "/f", O_RDWR | O_CREAT | O_TRUNC, 0o600)
        defer { close(fd) }
        let raw = SecureKey(random: 32)
        let h = try FileHeader.create(
            fileKey: raw, class: .none, cipher: cipher, using: .symmetric(SecureKey(random: 32)))
        try HeaderSlots.writeNew(fd: fd, h)
        let key = try FileContentKey(key: raw, header: h)
        let c = EncryptedContent(layout: BlockLayout(cipher: cipher))
        let block = [UInt8](repeating: 7, count: 4096)
        func write(_ b: Int, _ allocated: inout Int) throws -> Bool {
            try block.withUnsafeBytes {
                try c.write(fd: fd, key: key, offset: b * 4096, data: $0, allocated: &allocated)
            }
        }
        var allocated = FileHeader.size
        for b in 0..<10 { XCTAssertTrue(try write(b, &allocated), "an append reserves (block \(b))") }
        XCTAssertEqual(allocated, c.layout.backingSize(plainSize: 10 * 4096), "appends in order move the start on")
        XCTAssertFalse(try write(3, &allocated), "an overwrite below the start reserves nothing")
        XCTAssertTrue(try write(20, &allocated), "a write past a hole reserves")
        XCTAssertEqual(allocated, c.layout.backingSize(plainSize: 10 * 4096), "and the hole stops the start")
        XCTAssertTrue(try write(15, &allocated), "a write into the hole reserves")
        // Another writer cuts the file to 5 blocks underneath: what was known past the cut is not.
        XCTAssertEqual(ftruncate(fd, off_t(c.layout.backingSize(plainSize: 5 * 4096))), 0)
        var stale = c.layout.backingSize(plainSize: 21 * 4096)
        XCTAssertTrue(try write(7, &stale), "a write past the cut reserves, whatever was known")
        XCTAssertLessThanOrEqual(stale, c.layout.backingSize(plainSize: 8 * 4096))
        var none = 0
        XCTAssertTrue(try write(2, &none), "with nothing known every write reserves")
        var out = [UInt8](repeating: 0, count: 4096)
        let n = try out.withUnsafeMutableBytes { try c.read(fd: fd, key: key, offset: 7 * 4096, into: $0) }
        XCTAssertEqual(Array(out[0..<n]), block, "what was written reads back")
    }
}
