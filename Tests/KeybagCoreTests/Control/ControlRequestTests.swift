import KeybagCore
import XCTest

/// The control socket's request parser: JSON's string and number grammar, secrets into
/// guarded memory, and refusals (never traps) for everything else.
final class ControlRequestTests: XCTestCase {
    func parse(_ s: String) throws -> ControlRequest {
        try Array(s.utf8).withUnsafeBytes { try ControlRequest.parse($0) }
    }
    func parse(bytes: [UInt8]) throws -> ControlRequest { try bytes.withUnsafeBytes { try ControlRequest.parse($0) } }
    func secret(_ r: ControlRequest, _ k: String) throws -> [UInt8] {
        try XCTUnwrap(r.secrets[k]).withBytes { Array($0) }
    }

    func testValuesEscapesAndSecrets() throws {
        let r = try parse(
            #" { "op" : "lock", "grace": 2.5e0, "flag": true, "none": null, "neg": -0.25, "s": "a\"b\\c\/d\n\t\u00e9\ud83d\ude00" } "#
        )
        XCTAssertEqual(r.op, "lock")
        XCTAssertEqual(r.fields["grace"], .number(2.5))
        XCTAssertEqual(r.fields["flag"], .bool(true))
        XCTAssertEqual(r.fields["none"], .null)
        XCTAssertEqual(r.fields["neg"], .number(-0.25))
        XCTAssertEqual(r.fields["s"], .string("a\"b\\c/d\n\té😀"))
        let u = try parse(#"{"op":"unlock","passcode":"p\u00e9\"w\ud83d\ude00"}"#)
        XCTAssertNil(u.fields["passcode"], "a secret is never an ordinary value")
        XCTAssertEqual(try secret(u, "passcode"), Array("pé\"w😀".utf8))
        u.wipe()
        XCTAssertTrue(u.secrets["passcode"]!.isWiped)
        let p = try parse(#"{"op":"passwd","old":"a","new":"b"}"#)
        XCTAssertEqual(try secret(p, "old"), [0x61]); XCTAssertEqual(try secret(p, "new"), [0x62])
        XCTAssertEqual(try parse("{}").fields.count, 0)
    }

    func testEverythingElseIsRefusedNotTrapped() {
        let bad = [
            "", " ", "[1,2,3]", "\"op\"", "{", "{\"op\"}", "{\"op\":}", "{\"op\":\"a\",}", "{\"op\":\"a\"} x",
            "{\"op\":\"a\",\"op\":\"b\"}", "{\"grace\":[1]}", "{\"grace\":{\"a\":1}}", "{\"op\":tru}", "{\"n\":01}",
            "{\"n\":1.}", "{\"n\":-}", "{\"n\":1e}", "{\"n\":1e999}", "{\"s\":\"\\x\"}", "{\"s\":\"\\u12\"}",
            "{\"s\":\"\\ud800\"}",
            "{\"s\":\"\\udc00\"}", "{\"s\":\"\\ud800\\u0041\"}", "{\"s\":\"a\u{01}b\"}", "{\"s\":\"abc",
            "{\"passcode\":\"\"}",
            "{\"passcode\":\"abc", "{\"passcode\":\"\\ud800\"}", "{\"passcode\":\"a\\\"}",
        ]
        for s in bad { XCTAssertThrowsError(try parse(s), s) }
        for b in [
            [0x7B, 0x22, 0x73, 0x22, 0x3A, 0x22, 0xFF, 0x22, 0x7D],
            [0x7B, 0x22, 0x70, 0x61, 0x73, 0x73, 0x63, 0x6F, 0x64, 0x65, 0x22, 0x3A, 0x22, 0xC0, 0xAF, 0x22, 0x7D],
            [0x7B, 0x22, 0x73, 0x22, 0x3A, 0x22, 0xED, 0xA0, 0x80, 0x22, 0x7D],
        ] as [[UInt8]] {
            XCTAssertThrowsError(try parse(bytes: b), "\(b)")
        }
        // Random bytes and random cuts of a valid request never trap.
        var rng = SystemRandomNumberGenerator()
        let valid = Array(#"{"op":"unlock","passcode":"p\u00e9w","grace":1.5}"#.utf8)
        for _ in 0..<3000 {
            var b = valid
            for _ in 0..<Int.random(in: 1...4, using: &rng) {
                b[Int.random(in: 0..<b.count, using: &rng)] = UInt8.random(in: 0...255, using: &rng)
            }
            _ = try? parse(bytes: Array(b.prefix(Int.random(in: 0...b.count, using: &rng))))
        }
        XCTAssertNoThrow(try parse(bytes: Array(repeating: 0x20, count: 70_000) + Array("{}".utf8)))
    }
}
