import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// A test case with a fresh temporary folder per test, removed afterwards.
class TempDirTestCase: XCTestCase {
    var dir = ""

    override func setUp() {
        var t = Array("/tmp/kbfs-unit.XXXXXX".utf8CString)
        dir = String(cString: mkdtemp(&t)!)
        setenv("STATE_DIRECTORY", dir + "/state", 1)  // key-set floors (KeySetFloor) stay in the test's folder
    }

    override func tearDown() { try? FileManager.default.removeItem(atPath: dir) }

    /// A secret holding the UTF-8 bytes of `s`.
    func secret(_ s: String) -> SecureKey {
        let b = Array(s.utf8)
        return SecureKey(count: b.count) { $0.copyBytes(from: b) }
    }

    /// Whether two secrets hold the same bytes.
    func same(_ a: SecureKey, _ b: SecureKey) throws -> Bool {
        try a.withBytes { x in try b.withBytes { y in Array(x) == Array(y) } }
    }
}
