import Foundation
import Glibc
import XCTest

/// A new, empty folder under /tmp (removed by the test that made it).
func makeTemporaryFolder() -> String {
    var t = Array("/tmp/kbfs-unit.XXXXXX".utf8CString)
    return String(cString: mkdtemp(&t)!)
}

/// A folder of the test's own, open as `dirFD`, removed after each test (a base class: no
/// tests).
class TemporaryFolderTestCase: XCTestCase {
    var dir = ""
    var dirFD: Int32 = -1

    override func setUpWithError() throws {
        dir = makeTemporaryFolder()
        dirFD = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        XCTAssertGreaterThanOrEqual(dirFD, 0)
    }

    override func tearDown() {
        if dirFD >= 0 { close(dirFD) }
        try? FileManager.default.removeItem(atPath: dir)
    }
}
