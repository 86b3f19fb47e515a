import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// The TPM enrollment record (`/var/lib/keybagfs/ID.tpm2`) without a TPM: written whole with
/// mode 0600 and read back equal; absent is nil; what is not a record (bad JSON, a FIFO, a
/// symlink, an oversized file) is refused with a clear error that carries no blob; the PCR
/// mask ignores PCRs a TPM does not have. Sealing and unsealing are the mount tests' (swtpm).
final class TPMEnrollmentTests: TempDirTestCase {
    /// An enrollment as `device add --tpm2` leaves it (blobs are opaque base64 here).
    func sample() -> TPMEnrollment {
        var e = TPMEnrollment(tcti: "swtpm:host=127.0.0.1,port=2321")
        e.objects["passcode"] = .init(publicBlob: "AAEC", privateBlob: "c2VjcmV0LWJsb2I=", bound: 7)
        e.nvIndex = 0x0180_0042
        e.primaryName = "000b" + String(repeating: "ab", count: 32)
        e.pcrs = [7, 14]
        e.pendingRewrap = 3
        return e
    }

    func testARecordIsWrittenPrivateAndReadBackEqual() throws {
        let path = dir + "/state/device.tpm2"
        try sample().save(to: path)
        XCTAssertEqual(try TPMEnrollment.load(from: path), sample())
        var st = stat()
        XCTAssertEqual(stat(path, &st), 0)
        XCTAssertEqual(st.st_mode & 0o777, 0o600, "the record names sealed blobs: owner only")
        XCTAssertEqual(stat(dir + "/state", &st), 0)
        XCTAssertEqual(st.st_mode & 0o777, 0o700)
        let left = try FileManager.default.contentsOfDirectory(atPath: dir + "/state")
        XCTAssertEqual(left, ["device.tpm2"], "no temporary file is left beside it")
    }

    func testNoRecordIsNil() throws {
        XCTAssertNil(try TPMEnrollment.load(from: dir + "/absent.tpm2"))
    }

    func testWhatIsNotARecordIsRefusedWithoutItsBytes() throws {
        let path = dir + "/bad.tpm2"
        let secretish = "c2VjcmV0LWJsb2I="
        try Data("{\"format\": 1, \"objects\": \"\(secretish)\"".utf8).write(to: URL(fileURLWithPath: path))
        XCTAssertThrowsError(try TPMEnrollment.load(from: path)) { error in
            let text = "\(error)"
            XCTAssertTrue(text.contains(path), text)
            XCTAssertFalse(text.contains(secretish), "the error repeats none of the file: \(text)")
        }
    }

    func testAFIFOASymlinkAndAHugeFileAreRefusedWithoutBlocking() throws {
        let fifo = dir + "/fifo.tpm2"
        XCTAssertEqual(mkfifo(fifo, 0o600), 0)
        XCTAssertThrowsError(try TPMEnrollment.load(from: fifo), "a FIFO would block a reader: refused")
        let real = dir + "/real.tpm2"
        try sample().save(to: real)
        let link = dir + "/link.tpm2"
        XCTAssertEqual(symlink(real, link), 0)
        XCTAssertThrowsError(try TPMEnrollment.load(from: link), "the record is not followed through a symlink")
        let huge = dir + "/huge.tpm2"
        XCTAssertTrue(FileManager.default.createFile(atPath: huge, contents: nil))
        XCTAssertEqual(truncate(huge, 64 << 20), 0)
        XCTAssertThrowsError(try TPMEnrollment.load(from: huge), "bounded before anything is allocated")
    }

    func testThePCRMaskHasOnlyPCRsATPMHas() {
        var e = sample()
        e.pcrs = [0, 7, 23, 24, -1, 99]
        XCTAssertEqual(e.pcrMask, 1 | 1 << 7 | 1 << 23)
        e.pcrs = nil
        XCTAssertEqual(e.pcrMask, 0)
    }

    func testThePrimaryPinIsItsNameInHex() {
        var e = sample()
        XCTAssertEqual(e.pin, [0x00, 0x0b] + [UInt8](repeating: 0xab, count: 32))
        e.primaryName = nil
        XCTAssertNil(e.pin, "not pinned yet")
    }

    /// A pin that does not parse would leave the storage primary unchecked (as before the first
    /// pin): such a record is refused, not read as unpinned.
    func testARecordWhosePinDoesNotParseIsRefused() throws {
        let path = dir + "/state/device.tpm2"
        // Not hex; empty (the helper process reads an empty pin as "not pinned"); too short to
        // be a TPM object's name (a 2-byte algorithm and a digest).
        for name in ["not hex", "", "000b", "000b" + String(repeating: "ab", count: 8)] {
            var e = sample()
            e.primaryName = name
            try e.save(to: path)
            XCTAssertThrowsError(try TPMEnrollment.load(from: path), "pin \"\(name)\"") { error in
                XCTAssertTrue("\(error)".contains("primary"), "\(error)")
            }
        }
    }
}
