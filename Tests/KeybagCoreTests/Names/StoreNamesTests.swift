import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// `StoreNames`: every kind of backing entry the daemon and `fsck` turn into a name, in a
/// real directory (long names need their side files).
final class StoreNamesTests: XCTestCase {
    var dir = ""
    var dirFD: Int32 = -1
    var names: NameCipher!
    let own = Sodium.randomArray(16), copyIV = Sodium.randomArray(16)

    override func setUpWithError() throws {
        var t = Array("/tmp/kbfs-names.XXXXXX".utf8CString)
        dir = String(cString: mkdtemp(&t)!)
        dirFD = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        names = try NameCipher(volumeKey: SecureKey(random: 32))
    }

    override func tearDown() {
        close(dirFD)
        try? FileManager.default.removeItem(atPath: dir)
    }

    /// Makes the backing entry of `plain` under `iv` as the daemon does (a long one with its
    /// side file) and returns its name.
    func entry(_ plain: String, iv: [UInt8]) throws -> String {
        let encrypted = try names.encrypt(Array(plain.utf8), dirIV: iv)
        let e = NameCipher.backingEntry(for: encrypted)
        XCTAssertEqual(writeFile(dir + "/" + e.name, []), 0)
        if let side = e.sideFile { XCTAssertEqual(writeFile(dir + "/" + side, Array(encrypted.utf8)), 0) }
        return e.name
    }

    func name(_ backing: String) -> Result<(name: String, index: Int)?, StoreNames.Problem> {
        StoreNames(cipher: names).plaintextName(dirFD: dirFD, backing: backing, ivs: [own, copyIV])
    }

    func writeFile(_ path: String, _ bytes: [UInt8]) -> Int32 {
        FileManager.default.createFile(atPath: path, contents: Data(bytes)) ? 0 : -1
    }

    func testShortAndLongNamesUnderTheirIV() throws {
        let long = String(repeating: "n", count: 220) + ".txt"
        for (plain, iv, index) in [
            ("report.txt", own, 0), ("made apart.txt", copyIV, 1), (long, own, 0), (long + "2", copyIV, 1),
        ] {
            let backing = try entry(plain, iv: iv)
            XCTAssertEqual(NameCipher.isLongName(backing), plain.count > 200)
            let got = try name(backing).get()
            XCTAssertEqual(got?.name, plain)
            XCTAssertEqual(got?.index, index, "the IV it decrypts under")
        }
    }

    func testStoreFilesAndSideFilesCarryNoName() throws {
        let long = try entry(String(repeating: "s", count: 230), iv: own)
        for backing in [".kbfs-dir", ".kbfs-tmp-abc", long + NameCipher.longSuffix] {
            XCTAssertFalse(StoreNames.carriesName(backing))
            XCTAssertNil(try name(backing).get(), backing)
        }
    }

    func testConflictCopiesShowTheirOriginalsName() throws {
        let short = try entry("report.txt", iv: own)
        let shortCopy = ConflictCopy(original: short, date: "20261125", time: "101010", device: "HOSTB27").backing
        XCTAssertEqual(try name(shortCopy).get()?.name, "report (conflict 2026-11-25 101010 HOSTB27).txt")
        // A copy of a long name `kbl.H` is `kbl.sync-conflict-…-DEVICE.H`; it shares the side file.
        let plain = String(repeating: "l", count: 200) + ".md"
        let long = try entry(plain, iv: own)
        let hash = long.dropFirst(NameCipher.longPrefix.count)
        let longCopy = "kbl.sync-conflict-20261125-101010-HOSTB27." + hash
        XCTAssertEqual(
            try name(longCopy).get()?.name,
            String(repeating: "l", count: 200) + " (conflict 2026-11-25 101010 HOSTB27).md")
        // A copy whose readable name would pass 255 bytes.
        let limit = try entry(String(repeating: "x", count: 240), iv: own)
        let tooLong = "kbl.sync-conflict-20261125-101010-HOSTB27." + limit.dropFirst(NameCipher.longPrefix.count)
        XCTAssertEqual(name(tooLong).failure, .readableNameTooLong)
    }

    func testProblemsAreNamed() throws {
        // Encrypted in another directory: decrypts under neither IV.
        let other = try names.encrypt(Array("elsewhere".utf8), dirIV: Sodium.randomArray(16))
        XCTAssertEqual(name(other).failure, .doesNotDecrypt)
        let copyOfOther = ConflictCopy(original: other, date: "20261125", time: "101010", device: "HOSTB27").backing
        XCTAssertEqual(name(copyOfOther).failure, .doesNotDecrypt, "a copy from another directory")
        // A long name without its side file, with an empty one, with another name's.
        let a = try entry(String(repeating: "a", count: 230), iv: own)
        let b = try entry(String(repeating: "b", count: 230), iv: own)
        XCTAssertEqual(unlink(dir + "/" + a + NameCipher.longSuffix), 0)
        XCTAssertEqual(name(a).failure, .sideFileMissing)
        XCTAssertEqual(writeFile(dir + "/" + a + NameCipher.longSuffix, []), 0)
        XCTAssertEqual(name(a).failure, .sideFileMismatch)
        let bSide = try Data(contentsOf: URL(fileURLWithPath: dir + "/" + b + NameCipher.longSuffix))
        XCTAssertEqual(writeFile(dir + "/" + a + NameCipher.longSuffix, Array(bSide)), 0)
        XCTAssertEqual(name(a).failure, .sideFileMismatch)
        // A side file that is a directory (planted) is not read.
        XCTAssertEqual(unlink(dir + "/" + a + NameCipher.longSuffix), 0)
        XCTAssertEqual(mkdir(dir + "/" + a + NameCipher.longSuffix, 0o755), 0)
        XCTAssertEqual(name(a).failure, .sideFileMissing)
    }

    func testLongTargetIDs() {
        XCTAssertEqual(StoreNames.longTargetID(NameCipher.longTargetPrefix + "abc"), "abc")
        XCTAssertNil(StoreNames.longTargetID("sealed-target-bytes"))
    }
}

extension Result {
    /// The error of a failure, nil for a success.
    var failure: Failure? { if case .failure(let e) = self { return e }; return nil }
}
