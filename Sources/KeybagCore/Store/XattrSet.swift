/// The user xattrs of one file or directory, as stored (sealed under the volume key) in
/// `STORE/xattrs/<id>`: u32 count, then per entry u16 name length, name, u32 value
/// length, value; all little endian, sorted by name.
public struct XattrSet: Sendable, Equatable {
    /// Values by full name (`user.…`).
    public var values: [String: [UInt8]] = [:]

    public init(values: [String: [UInt8]] = [:]) { self.values = values }

    /// Serialised form.
    public func encode() -> [UInt8] {
        var b: [UInt8] = []
        func u32(_ v: Int) { withUnsafeBytes(of: UInt32(v).littleEndian) { b += $0 } }
        func u16(_ v: Int) { withUnsafeBytes(of: UInt16(v).littleEndian) { b += $0 } }
        u32(values.count)
        for k in values.keys.sorted() {
            let name = Array(k.utf8), v = values[k]!
            u16(name.count); b += name
            u32(v.count); b += v
        }
        return b
    }

    /// The associated purpose of the set stored under `id` (bound into its seal).
    static func purpose(_ id: String) -> String { "keybagfs-xattr-v1|" + id }

    /// `encode()` sealed under the volume key for the set stored under `id`.
    public func sealed(id: String, names: NameCipher) throws -> [UInt8] {
        try names.seal(encode(), purpose: Self.purpose(id))
    }

    /// The set stored under `id` from its sealed bytes; `corrupt` when they do not authenticate
    /// (an empty or torn file a power cut left, or an edit) or do not parse.
    public static func opened(_ sealed: [UInt8], id: String, names: NameCipher) throws -> XattrSet {
        guard let plain = try? names.open(sealed, purpose: purpose(id)) else {
            throw KeybagError.corrupt("the xattr set \(id.prefix(16)) does not authenticate")
        }
        return try decode(plain)
    }

    /// Parses the serialised form with checked bounds; `corrupt` when malformed.
    public static func decode(_ b: [UInt8]) throws -> XattrSet {
        var i = 0
        func take(_ n: Int) throws -> ArraySlice<UInt8> {
            guard n >= 0, i <= b.count - n else { throw KeybagError.corrupt("xattr set truncated") }
            defer { i += n }
            return b[i..<(i + n)]
        }
        func u32() throws -> Int { try take(4).reversed().reduce(0) { $0 << 8 | Int($1) } }
        func u16() throws -> Int { try take(2).reversed().reduce(0) { $0 << 8 | Int($1) } }
        var out = XattrSet()
        let count = try u32()
        guard count <= 100_000 else { throw KeybagError.corrupt("xattr count") }
        for _ in 0..<count {
            let name = String(decoding: try take(try u16()), as: UTF8.self)
            out.values[name] = Array(try take(try u32()))
        }
        guard i == b.count else { throw KeybagError.corrupt("xattr set has trailing bytes") }
        return out
    }
}
