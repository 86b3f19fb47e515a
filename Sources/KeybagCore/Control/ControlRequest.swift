/// One request line of the control socket, parsed in place from the bytes it arrived in:
/// a flat JSON object whose values are strings, numbers, booleans or null. Fields that
/// carry passcodes are decoded straight into guarded memory and never exist as a Swift
/// string, array or Foundation object; every other value becomes an ordinary Swift value.
/// Nested values, duplicate fields, bad UTF-8 and trailing bytes are errors, never traps.
public struct ControlRequest: Sendable {
    /// A non-secret value.
    public enum Value: Equatable, Sendable {
        case string(String), number(Double), bool(Bool), null
    }

    /// Fields decoded into guarded memory.
    public static let secretFields: Set<String> = ["passcode", "old", "new"]

    /// The non-secret fields.
    public private(set) var fields: [String: Value] = [:]
    /// The secret fields, in guarded memory (the caller wipes them: `wipe()`).
    public private(set) var secrets: [String: SecureKey] = [:]

    /// The `op` field, when it is a string.
    public var op: String? { if case .string(let s)? = fields["op"] { return s }; return nil }

    /// Zeroes every secret field.
    public func wipe() { secrets.values.forEach { $0.wipe() } }

    /// Parses one line (without its newline); throws `KeybagError.invalid` with the reason.
    public static func parse(_ line: UnsafeRawBufferPointer) throws -> ControlRequest {
        var parser = Parser(bytes: line)
        var request = ControlRequest()
        do {
            try parser.object(into: &request)
        } catch {
            request.wipe()
            throw error
        }
        return request
    }

    /// A cursor over the line's bytes.
    struct Parser {
        let bytes: UnsafeRawBufferPointer
        var i = 0

        init(bytes: UnsafeRawBufferPointer) { self.bytes = bytes }

        /// The byte at the cursor, nil at the end.
        var current: UInt8? { i < bytes.count ? bytes[i] : nil }

        static func fail(_ why: String) -> KeybagError { .invalid(why) }

        /// Skips JSON whitespace.
        mutating func skipSpace() {
            while let c = current, c == 0x20 || c == 0x09 || c == 0x0A || c == 0x0D { i += 1 }
        }

        /// Consumes `c` or fails.
        mutating func expect(_ c: UInt8, _ what: String) throws {
            skipSpace()
            guard current == c else { throw Self.fail("expected \(what)") }
            i += 1
        }

        /// The whole object, which must be all the line holds.
        mutating func object(into request: inout ControlRequest) throws {
            try expect(UInt8(ascii: "{"), "a JSON object")
            skipSpace()
            if current == UInt8(ascii: "}") {
                i += 1
            } else {
                while true {
                    skipSpace()
                    guard current == UInt8(ascii: "\"") else { throw Self.fail("expected a field name") }
                    let key = try plainString()
                    guard request.fields[key] == nil, request.secrets[key] == nil else {
                        throw Self.fail("duplicate field \"\(key)\"")
                    }
                    try expect(UInt8(ascii: ":"), "':'")
                    skipSpace()
                    if ControlRequest.secretFields.contains(key) && current == UInt8(ascii: "\"") {
                        request.secrets[key] = try secretString()
                    } else {
                        request.fields[key] = try value()
                    }
                    skipSpace()
                    if current == UInt8(ascii: ",") { i += 1; continue }
                    if current == UInt8(ascii: "}") { i += 1; break }
                    throw Self.fail("expected ',' or '}'")
                }
            }
            skipSpace()
            guard i == bytes.count else { throw Self.fail("bytes after the JSON object") }
        }

        /// A string, number, boolean or null.
        mutating func value() throws -> Value {
            switch current {
            case UInt8(ascii: "\"")?: return .string(try plainString())
            case UInt8(ascii: "t")?: try literal("true"); return .bool(true)
            case UInt8(ascii: "f")?: try literal("false"); return .bool(false)
            case UInt8(ascii: "n")?: try literal("null"); return .null
            case UInt8(ascii: "{")?, UInt8(ascii: "[")?:
                throw Self.fail("values must be strings, numbers, booleans or null")
            default: return .number(try number())
            }
        }

        /// A keyword.
        mutating func literal(_ word: StaticString) throws {
            let n = word.utf8CodeUnitCount
            guard i + n <= bytes.count, (0..<n).allSatisfy({ bytes[i + $0] == word.utf8Start[$0] }) else {
                throw Self.fail("not JSON")
            }
            i += n
        }

        /// A number in JSON's grammar.
        mutating func number() throws -> Double {
            let start = i
            func digits() -> Int {
                var n = 0; while let c = current, c >= 0x30 && c <= 0x39 { i += 1; n += 1 }; return n
            }
            if current == UInt8(ascii: "-") { i += 1 }
            if current == UInt8(ascii: "0") { i += 1 } else { guard digits() > 0 else { throw Self.fail("not JSON") } }
            if current == UInt8(ascii: ".") { i += 1; guard digits() > 0 else { throw Self.fail("bad number") } }
            if current == UInt8(ascii: "e") || current == UInt8(ascii: "E") {
                i += 1
                if current == UInt8(ascii: "+") || current == UInt8(ascii: "-") { i += 1 }
                guard digits() > 0 else { throw Self.fail("bad number") }
            }
            guard i - start <= 64,
                let d = Double(String(decoding: UnsafeRawBufferPointer(rebasing: bytes[start..<i]), as: UTF8.self)),
                d.isFinite
            else {
                throw Self.fail("bad number")
            }
            return d
        }

        /// A string as a Swift string (names and non-secret values).
        mutating func plainString() throws -> String {
            var out: [UInt8] = []
            try string { out.append($0) }
            guard let s = String(validating: out, as: UTF8.self) else { throw Self.fail("string is not UTF-8") }
            return s
        }

        /// A string decoded straight into guarded memory.
        mutating func secretString() throws -> SecureKey {
            // The decoded form is never longer than the quoted form.
            var end = i + 1
            while end < bytes.count && bytes[end] != UInt8(ascii: "\"") {
                end += bytes[end] == UInt8(ascii: "\\") ? 2 : 1
            }
            let scratch = SecureKey(zeroed: max(end - i, 1))
            defer { scratch.wipe() }
            var n = 0
            try scratch.withBytes { b in
                let p = UnsafeMutableRawPointer(mutating: b.baseAddress!)
                try string { byte in
                    guard n < b.count else { throw Self.fail("string overruns") }
                    p.storeBytes(of: byte, toByteOffset: n, as: UInt8.self)
                    n += 1
                }
                guard UTF8Check.isValid(UnsafeRawBufferPointer(start: b.baseAddress, count: n)) else {
                    throw Self.fail("string is not UTF-8")
                }
            }
            guard n > 0 else { throw Self.fail("empty secret") }
            return try scratch.withBytes { b in
                SecureKey(count: n) { $0.copyMemory(from: UnsafeRawBufferPointer(rebasing: b[0..<n])) }
            }
        }

        /// Decodes a quoted string, handing each UTF-8 byte to `emit`.
        mutating func string(_ emit: (UInt8) throws -> Void) throws {
            guard current == UInt8(ascii: "\"") else { throw Self.fail("expected a string") }
            i += 1
            while true {
                guard let c = current else { throw Self.fail("unterminated string") }
                i += 1
                switch c {
                case UInt8(ascii: "\""):
                    return
                case UInt8(ascii: "\\"):
                    guard let e = current else { throw Self.fail("unterminated string") }
                    i += 1
                    switch e {
                    case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): try emit(e)
                    case UInt8(ascii: "b"): try emit(0x08)
                    case UInt8(ascii: "f"): try emit(0x0C)
                    case UInt8(ascii: "n"): try emit(0x0A)
                    case UInt8(ascii: "r"): try emit(0x0D)
                    case UInt8(ascii: "t"): try emit(0x09)
                    case UInt8(ascii: "u"): try unicodeEscape(emit)
                    default: throw Self.fail("bad escape")
                    }
                case 0..<0x20:
                    throw Self.fail("control character in string")
                default:
                    try emit(c)
                }
            }
        }

        /// Four hex digits.
        mutating func hex4() throws -> UInt32 {
            guard i + 4 <= bytes.count else { throw Self.fail("bad \\u escape") }
            var v: UInt32 = 0
            for _ in 0..<4 {
                let c = bytes[i]
                i += 1
                let d: UInt8
                switch c {
                case 0x30...0x39: d = c - 0x30
                case 0x41...0x46: d = c - 0x41 + 10
                case 0x61...0x66: d = c - 0x61 + 10
                default: throw Self.fail("bad \\u escape")
                }
                v = v << 4 | UInt32(d)
            }
            return v
        }

        /// `\uXXXX` (after the `u`), with surrogate pairs, emitted as UTF-8.
        mutating func unicodeEscape(_ emit: (UInt8) throws -> Void) throws {
            var cp = try hex4()
            if (0xD800...0xDBFF).contains(cp) {
                guard i + 2 <= bytes.count, bytes[i] == UInt8(ascii: "\\"), bytes[i + 1] == UInt8(ascii: "u") else {
                    throw Self.fail("lone surrogate")
                }
                i += 2
                let low = try hex4()
                guard (0xDC00...0xDFFF).contains(low) else { throw Self.fail("lone surrogate") }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
            } else if (0xDC00...0xDFFF).contains(cp) {
                throw Self.fail("lone surrogate")
            }
            switch cp {
            case 0..<0x80: try emit(UInt8(cp))
            case 0x80..<0x800:
                try emit(UInt8(0xC0 | cp >> 6)); try emit(UInt8(0x80 | cp & 0x3F))
            case 0x800..<0x10000:
                try emit(UInt8(0xE0 | cp >> 12)); try emit(UInt8(0x80 | (cp >> 6) & 0x3F));
                try emit(UInt8(0x80 | cp & 0x3F))
            default:
                try emit(UInt8(0xF0 | cp >> 18)); try emit(UInt8(0x80 | (cp >> 12) & 0x3F))
                try emit(UInt8(0x80 | (cp >> 6) & 0x3F)); try emit(UInt8(0x80 | cp & 0x3F))
            }
        }
    }
}

/// UTF-8 validation over raw bytes, without copying them.
enum UTF8Check {
    /// Whether `b` is well-formed UTF-8 (no overlongs, surrogates or values past U+10FFFF).
    static func isValid(_ b: UnsafeRawBufferPointer) -> Bool {
        var i = 0
        while i < b.count {
            let c = b[i]
            if c < 0x80 { i += 1; continue }
            let n: Int, min: UInt32
            var cp: UInt32
            switch c {
            case 0xC2...0xDF: n = 1; min = 0x80; cp = UInt32(c & 0x1F)
            case 0xE0...0xEF: n = 2; min = 0x800; cp = UInt32(c & 0x0F)
            case 0xF0...0xF4: n = 3; min = 0x10000; cp = UInt32(c & 0x07)
            default: return false
            }
            guard i + n < b.count else { return false }
            for k in 1...n {
                let cc = b[i + k]
                guard cc & 0xC0 == 0x80 else { return false }
                cp = cp << 6 | UInt32(cc & 0x3F)
            }
            guard cp >= min, cp <= 0x10FFFF, !(0xD800...0xDFFF).contains(cp) else { return false }
            i += n + 1
        }
        return true
    }
}
