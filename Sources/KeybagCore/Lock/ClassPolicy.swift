import Glibc

/// Default classes for directories by path, set at mount time (the counterpart of Apple's
/// `com.apple.developer.default-data-protection` entitlement, but per path): a directory
/// created where a rule matches gets that rule's class as its default. Paths are relative
/// to the mount root; `*`, `?` and `[...]` match within one name; a leading `**/` lets a
/// rule match at any depth. The last matching rule wins.
public struct ClassPolicy: Sendable, Equatable {
    /// One rule: a directory pattern and the default class it gets.
    public struct Rule: Sendable, Equatable {
        /// The pattern as written (normalised: no leading `./`, no trailing `/`).
        public let pattern: String
        /// The pattern's names, without the `**` prefix.
        public let components: [String]
        /// Whether the rule matches at any depth (`**/` prefix) or only from the root.
        public let anyDepth: Bool
        /// The default class a matching new directory gets.
        public let protectionClass: ProtectionClass
    }

    /// A line of a policy that cannot be used, with its place.
    public struct ParseError: Error, CustomStringConvertible, Equatable {
        public let line: Int
        public let reason: String
        public var description: String { line > 0 ? "line \(line): \(reason)" : reason }
    }

    public private(set) var rules: [Rule] = []

    /// No rules.
    public init() {}

    /// Whether there is no rule.
    public var isEmpty: Bool { rules.isEmpty }

    /// The most names any rule looks at: how far up from a new directory a match can depend.
    public var depth: Int { rules.map(\.components.count).max() ?? 0 }

    /// Parses a policy file: one `PATTERN CLASS` or `PATTERN=CLASS` per line; `#` starts a
    /// comment; blank lines are ignored.
    public init(text: String) throws {
        // Any line end: "\r\n" is one Character in Swift, so splitting on "\n" alone would
        // leave a CRLF file as one line.
        for (i, raw) in text.split(
            omittingEmptySubsequences: false, whereSeparator: { $0 == "\n" || $0 == "\r\n" || $0 == "\r" }
        ).enumerated() {
            var line = Substring(raw)
            if let hash = line.firstIndex(of: "#") { line = line[..<hash] }
            let trimmed = String(line).trimmingCharacters(in: .whitespacesAndNewlines)
            if trimmed.isEmpty { continue }
            do { try add(trimmed) } catch let e as ParseError { throw ParseError(line: i + 1, reason: e.reason) }
        }
    }

    /// Adds one rule written `PATTERN=CLASS` or `PATTERN CLASS` (the class is the last word).
    public mutating func add(_ text: String) throws {
        let s = text.trimmingCharacters(in: .whitespacesAndNewlines)
        if s.unicodeScalars.contains(where: {
            $0.value < 0x20 || $0.value == 0x7F || $0 == "\u{2028}" || $0 == "\u{2029}"
        }) {
            throw ParseError(line: 0, reason: "control characters are not allowed")
        }
        if s.utf8.count > 4096 { throw ParseError(line: 0, reason: "a rule is longer than 4096 bytes") }
        // `PATTERN CLASS` when the last word is a class (the pattern may then hold "="),
        // else `PATTERN=CLASS`.
        let space = s.lastIndex(where: { $0 == " " || $0 == "\t" })
        let cut =
            space.flatMap { ProtectionClass(name: String(s[s.index(after: $0)...])) != nil ? $0 : nil } ?? s.lastIndex(
                of: "=") ?? space
        guard let cut else { throw ParseError(line: 0, reason: "\"\(s)\" is not PATTERN=CLASS") }
        let pattern = String(s[..<cut]).trimmingCharacters(in: .whitespacesAndNewlines)
        let className = String(s[s.index(after: cut)...]).trimmingCharacters(in: .whitespacesAndNewlines)
        guard let cls = ProtectionClass(name: className) else {
            throw ParseError(
                line: 0,
                reason:
                    "unknown class \"\(className)\" (none, completeUntilFirstUserAuthentication, completeUnlessOpen, "
                    + "complete)"
            )
        }
        var names = pattern.split(separator: "/", omittingEmptySubsequences: true).map(String.init)
        if names.first == "." { names.removeFirst() }
        let anyDepth = names.first == "**"
        if anyDepth { names.removeFirst() }
        guard !names.isEmpty else { throw ParseError(line: 0, reason: "\"\(pattern)\" names no directory") }
        guard names.count <= 64 else { throw ParseError(line: 0, reason: "\"\(pattern)\" has more than 64 names") }
        for n in names {
            if n == "." || n == ".." {
                throw ParseError(line: 0, reason: "\"\(pattern)\": \".\" and \"..\" are not allowed")
            }
            if n.contains("**") {
                throw ParseError(line: 0, reason: "\"\(pattern)\": \"**\" is allowed only as the first name")
            }
            if n.utf8.count > 255 {
                throw ParseError(line: 0, reason: "\"\(pattern)\": a name is longer than 255 bytes")
            }
        }
        if pattern.hasPrefix("/") && anyDepth {
            throw ParseError(line: 0, reason: "\"\(pattern)\": \"/**\" is just \"**\"")
        }
        let normal = (anyDepth ? ["**"] : []) + names
        rules.append(
            Rule(pattern: normal.joined(separator: "/"), components: names, anyDepth: anyDepth, protectionClass: cls))
    }

    /// Whether some rule could match a directory named `name` (its last pattern name
    /// matches): when none can, the path above it need not be looked at.
    public func mayMatch(name: String) -> Bool {
        rules.contains { Self.matches($0.components[$0.components.count - 1], name) }
    }

    /// The class for a directory whose last names are `tail` (nearest last). `fromRoot`
    /// says `tail` is the whole path from the mount root; otherwise it holds at least
    /// `depth` names. Nil when no rule matches.
    public func protectionClass(tail: [String], fromRoot: Bool) -> ProtectionClass? {
        rule(tail: tail, fromRoot: fromRoot)?.protectionClass
    }

    /// The last rule matching (see `protectionClass(tail:fromRoot:)`).
    public func rule(tail: [String], fromRoot: Bool) -> Rule? {
        rules.last { r in
            if r.anyDepth {
                guard tail.count >= r.components.count else { return false }
            } else {
                guard fromRoot, tail.count == r.components.count else { return false }
            }
            return zip(r.components, tail.suffix(r.components.count)).allSatisfy { Self.matches($0, $1) }
        }
    }

    /// Whether `name` matches the shell pattern `pattern` (one name, dot files included).
    static func matches(_ pattern: String, _ name: String) -> Bool {
        fnmatch(pattern, name, 0) == 0
    }
}
