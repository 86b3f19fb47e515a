import Foundation

/// A sync engine's conflict copy of a store entry, and the readable name the mount gives it.
///
/// When two devices change the same file before they sync, Syncthing keeps both: the losing
/// version is renamed from `NAME.EXT` to `NAME.sync-conflict-YYYYMMDD-HHMMSS-DEVICE.EXT`
/// (DEVICE: the first 7 characters of the id of the device whose change won). In the store NAME is an encrypted name,
/// base64url with no dot, so the copy is `ENCRYPTED.sync-conflict-YYYYMMDD-HHMMSS-DEVICE`.
/// It does not decrypt as a name; the mount shows it as `STEM (conflict YYYY-MM-DD HHMMSS
/// DEVICE).EXT` next to the file, and both read (the copy carries its own header). A hashed
/// long name `kbl.H` has a dot, so its copy is `kbl.sync-conflict-YYYYMMDD-HHMMSS-DEVICE.H`;
/// its plaintext is in the original's side file `kbl.H.name`, which the copy shares.
public struct ConflictCopy: Equatable, Sendable {
    /// The backing name the copy was made from (an encrypted short name, or `kbl.H`).
    public let original: String
    /// `YYYYMMDD` and `HHMMSS` of the conflict.
    public let date: String, time: String
    /// The short device id Syncthing names the copy after: the device whose change won (it
    /// made the version now under the file's name), not the one whose version the copy holds.
    public let device: String

    /// What Syncthing puts between the name and the copy's date.
    public static let marker = ".sync-conflict-"

    /// The conflict copy named by a backing entry; nil for any other entry.
    public init?(backing: String) {
        // Encrypted short names have no dot: one byte scan rules out every ordinary entry.
        guard backing.utf8.contains(UInt8(ascii: ".")),
            let r = backing.range(of: Self.marker, options: .backwards)
        else { return nil }
        if backing[..<r.lowerBound] == Self.longStem {
            self.init(longCopy: backing[r.upperBound...])
            return
        }
        let original = String(backing[..<r.lowerBound])
        let parts = backing[r.upperBound...].split(separator: "-", omittingEmptySubsequences: false)
        guard !original.isEmpty, original.utf8.allSatisfy(Self.isBase64URL), parts.count == 3,
            Self.isStamp(parts[0], 8), Self.isStamp(parts[1], 6), Self.isDevice(parts[2])
        else { return nil }
        self.init(original: original, date: String(parts[0]), time: String(parts[1]), device: String(parts[2]))
    }

    /// A copy of `original` made at `date`/`time` by `device`.
    public init(original: String, date: String, time: String, device: String) {
        self.original = original; self.date = date; self.time = time; self.device = device
    }

    /// `kbl.sync-conflict-` + `YYYYMMDD-HHMMSS-DEVICE.H`: a copy of the long name `kbl.H`.
    private init?(longCopy rest: Substring) {
        let parts = rest.split(separator: "-", maxSplits: 2, omittingEmptySubsequences: false)
        guard parts.count == 3, Self.isStamp(parts[0], 8), Self.isStamp(parts[1], 6),
            let dot = parts[2].firstIndex(of: ".")
        else { return nil }
        let device = parts[2][..<dot], hash = parts[2][parts[2].index(after: dot)...]
        guard Self.isDevice(device), !hash.isEmpty, hash.utf8.allSatisfy(Self.isBase64URL) else { return nil }
        self.init(
            original: NameCipher.longPrefix + hash, date: String(parts[0]), time: String(parts[1]),
            device: String(device))
    }

    /// What Syncthing keeps of a long name `kbl.H` before the marker (`.H` is its extension).
    static let longStem = String(NameCipher.longPrefix.dropLast())

    /// Whether this is a copy of a hashed long name (its plaintext is in the original's side file).
    public var isLong: Bool { original.hasPrefix(NameCipher.longPrefix) }

    /// The copy's backing name.
    public var backing: String {
        let stamp = date + "-" + time + "-" + device
        guard isLong else { return original + Self.marker + stamp }
        return Self.longStem + Self.marker + stamp + "." + original.dropFirst(NameCipher.longPrefix.count)
    }

    /// The name the mount shows for a copy of the file named `plain`.
    public func readableName(of plain: String) -> String {
        let (stem, ext) = Self.split(plain)
        let day = date.prefix(4) + "-" + date.dropFirst(4).prefix(2) + "-" + date.dropFirst(6)
        return stem + " (conflict " + day + " " + time + " " + device + ")" + ext
    }

    /// The plaintext name of the file and the copy's date, time and device, from a readable
    /// name; nil when `name` is not one (it may still be a file really named so).
    public static func parse(readable name: String) -> (plain: String, date: String, time: String, device: String)? {
        guard name.utf8.contains(UInt8(ascii: ")")) else { return nil }  // every lookup asks: most names end here
        let (stem, ext) = split(name)
        guard stem.hasSuffix(")"), let open = stem.range(of: " (conflict ", options: .backwards) else { return nil }
        let inner = stem[open.upperBound..<stem.index(before: stem.endIndex)].split(separator: " ")
        guard inner.count == 3, inner[0].count == 10 else { return nil }
        let day = inner[0].split(separator: "-", omittingEmptySubsequences: false)
        guard day.count == 3, isStamp(day[0], 4), isStamp(day[1], 2), isStamp(day[2], 2),
            isStamp(inner[1], 6), isDevice(inner[2])
        else { return nil }
        let plain = String(stem[..<open.lowerBound]) + ext
        guard !plain.isEmpty else { return nil }
        return (plain, String(day[0] + day[1] + day[2]), String(inner[1]), String(inner[2]))
    }

    /// A name's stem and extension (from its last dot, not a leading one): "a.b.txt" →
    /// ("a.b", ".txt"), ".bashrc" → (".bashrc", "").
    static func split(_ name: String) -> (String, String) {
        guard let dot = name.lastIndex(of: "."), dot != name.startIndex else { return (name, "") }
        return (String(name[..<dot]), String(name[dot...]))
    }

    /// Whether `s` is `count` decimal digits.
    static func isStamp(_ s: Substring, _ count: Int) -> Bool {
        s.count == count && s.utf8.allSatisfy { $0 >= 48 && $0 <= 57 }
    }

    /// Whether `s` is a short Syncthing device id: 7 of A-Z and 2-7 (base32).
    static func isDevice(_ s: Substring) -> Bool {
        s.count == 7 && s.utf8.allSatisfy { ($0 >= 65 && $0 <= 90) || ($0 >= 50 && $0 <= 55) }
    }

    /// Whether a byte is base64url (what encrypted names are made of).
    static func isBase64URL(_ b: UInt8) -> Bool {
        (b >= 65 && b <= 90) || (b >= 97 && b <= 122) || (b >= 48 && b <= 57) || b == 45 || b == 95
    }
}
