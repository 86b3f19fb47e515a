import KeybagCore
import XCTest

/// Parsing and matching of mount-time class policies.
final class ClassPolicyTests: XCTestCase {
    func testParsesFilesWithCommentsBothSeparatorsAndAppleNames() throws {
        let p = try ClassPolicy(
            text: """
                # app container layout
                Documents            complete
                ./Library/Caches/    none      # trailing slash and ./ are fine
                **/tmp=completeUnlessOpen
                My Files  NSFileProtectionComplete

                """)
        XCTAssertEqual(p.rules.map(\.pattern), ["Documents", "Library/Caches", "**/tmp", "My Files"])
        XCTAssertEqual(
            p.rules.map(\.protectionClass), [.complete, ProtectionClass.none, .completeUnlessOpen, .complete])
        XCTAssertEqual(p.depth, 2)
    }

    func testBadLinesAreNamedWithTheirNumber() {
        XCTAssertThrowsError(try ClassPolicy(text: "Documents complete\nCaches nope\n")) { e in
            XCTAssertEqual((e as? ClassPolicy.ParseError)?.line, 2)
            XCTAssertTrue("\(e)".contains("unknown class \"nope\""), "\(e)")
        }
        for bad in ["complete", "../x complete", "a/../b none", "a/**/b none", "** none", "/ none", "x/. none"] {
            XCTAssertThrowsError(try ClassPolicy(text: bad), bad)
        }
    }

    func testAnchoredRulesMatchOnlyFromTheRootAndAnyDepthRulesAnywhere() throws {
        var p = ClassPolicy()
        try p.add("Documents=complete")
        try p.add("Library/Cach*=none")
        try p.add("**/.cache=none")
        XCTAssertEqual(p.protectionClass(tail: ["Documents"], fromRoot: true), .complete)
        XCTAssertNil(p.protectionClass(tail: ["a", "Documents"], fromRoot: true), "anchored at the root")
        XCTAssertNil(p.protectionClass(tail: ["Documents"], fromRoot: false), "a tail that is not the whole path")
        XCTAssertNil(
            p.protectionClass(tail: ["Documents", "x"], fromRoot: true), "not inherited by pattern: x inherits by class"
        )
        XCTAssertEqual(p.protectionClass(tail: ["Library", "Caches"], fromRoot: true), ProtectionClass.none)
        XCTAssertNil(p.protectionClass(tail: ["Library", "Prefs"], fromRoot: true))
        XCTAssertEqual(p.protectionClass(tail: ["home", "u", ".cache"], fromRoot: true), ProtectionClass.none)
        XCTAssertEqual(p.protectionClass(tail: [".cache"], fromRoot: false), ProtectionClass.none)
    }

    func testTheLastMatchingRuleWins() throws {
        var p = ClassPolicy()
        try p.add("**/*=completeUnlessOpen")
        try p.add("Documents=complete")
        XCTAssertEqual(p.protectionClass(tail: ["Documents"], fromRoot: true), .complete)
        try p.add("**/Doc*=none")
        XCTAssertEqual(p.protectionClass(tail: ["Documents"], fromRoot: true), ProtectionClass.none)
        XCTAssertEqual(p.protectionClass(tail: ["x"], fromRoot: true), .completeUnlessOpen)
    }

    func testWindowsLineEndsControlCharactersAndEqualsInPatterns() throws {
        // helper-6: a CRLF file was one line ("\r\n" is one Character), so a leading comment hid every rule.
        let crlf = try ClassPolicy(text: "# layout\r\nDocuments complete\r\nLibrary/Caches none\r\n")
        XCTAssertEqual(crlf.rules.map(\.pattern), ["Documents", "Library/Caches"])
        let cr = try ClassPolicy(text: "Documents complete\rCaches none")
        XCTAssertEqual(cr.rules.count, 2)
        for bad in ["Docu\u{0}ments none", "a\u{1b}b none", "a\u{2028}b none"] {
            XCTAssertThrowsError(try ClassPolicy(text: bad), bad.debugDescription)
        }
        let eq = try ClassPolicy(text: "a=b complete")
        XCTAssertEqual(eq.rules.first?.pattern, "a=b")
        XCTAssertEqual(eq.rules.first?.protectionClass, .complete)
        XCTAssertThrowsError(try ClassPolicy(text: Array(repeating: "x", count: 65).joined(separator: "/") + " none"))
        XCTAssertTrue(eq.mayMatch(name: "a=b"))
        XCTAssertFalse(eq.mayMatch(name: "a"))
    }
}
