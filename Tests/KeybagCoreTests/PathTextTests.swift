import KeybagCore
import XCTest

/// `PathText.parent` answers as `NSString.deletingLastPathComponent` does, also where that traps.
final class PathTextTests: XCTestCase {
    func testParentOfEveryShape() {
        let cases: [(String, String)] = [
            ("s", ""), ("ab", ""), (".", ""), ("a/", ""), ("", ""), ("/", "/"), ("/x", "/"), ("a/b", "a"),
            ("a/b/", "a"), ("/a/b/c", "/a/b"), ("a//b", "a"), ("//x", "/"), ("/a/b//", "/a"),
        ]
        for (path, want) in cases { XCTAssertEqual(PathText.parent(path), want, path) }
    }
}
