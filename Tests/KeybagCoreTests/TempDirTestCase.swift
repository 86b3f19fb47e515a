import Foundation
import Glibc
import XCTest

/// A test case with a fresh temporary folder per test, removed afterwards.
class TempDirTestCase: XCTestCase {
    var dir = ""

    override func setUp() {
        var t = Array("/tmp/kbfs-unit.XXXXXX".utf8CString)
        dir = String(cString: mkdtemp(&t)!)
    }

    override func tearDown() { try? FileManager.default.removeItem(atPath: dir) }
}
