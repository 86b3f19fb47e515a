import Foundation
import Glibc

/// A sync engine's copy of a directory's `.kbfs-dir`: the same folder was made on two devices
/// before they synced, each with its own random name IV, and Syncthing kept the losing file as
/// `.sync-conflict-YYYYMMDD-HHMMSS-DEVICE.kbfs-dir` (it takes the whole name for an extension).
/// The names the losing device made in the folder are encrypted under the copy's IV.
public struct MetadataCopy: Sendable, Equatable {
    /// The copy's backing name.
    public let backing: String
    /// `YYYYMMDD`, `HHMMSS` and the short id of the device whose version lost.
    public let date: String, time: String, device: String

    /// The metadata copy named by a backing entry; nil for any other entry.
    public init?(backing: String) {
        let prefix = ConflictCopy.marker, suffix = DirectoryMeta.fileName
        guard backing.hasPrefix(prefix), backing.hasSuffix(suffix),
            backing.utf8.count == prefix.utf8.count + 8 + 1 + 6 + 1 + 7 + suffix.utf8.count
        else { return nil }
        let parts = backing.dropFirst(prefix.count).dropLast(suffix.count)
            .split(separator: "-", omittingEmptySubsequences: false)
        guard parts.count == 3, ConflictCopy.isStamp(parts[0], 8), ConflictCopy.isStamp(parts[1], 6),
            ConflictCopy.isDevice(parts[2])
        else { return nil }
        self.backing = backing
        (date, time, device) = (String(parts[0]), String(parts[1]), String(parts[2]))
    }

    /// The name the mount shows for an entry named `plain` under this copy's IV when the
    /// directory already shows an entry named `plain`: `STEM (conflict YYYY-MM-DD HHMMSS DEVICE).EXT`.
    public func readableName(of plain: String) -> String {
        ConflictCopy(original: "", date: date, time: time, device: device).readableName(of: plain)
    }

    /// Whether a readable name's date, time and device are this copy's.
    public func matches(date: String, time: String, device: String) -> Bool {
        self.date == date && self.time == time && self.device == device
    }
}

/// The name IVs of one directory, in the order names are tried: its own (from `.kbfs-dir`),
/// then those of its metadata copies (`MetadataCopy`, by backing name). A name is created under
/// the own IV only; an entry that decrypts under a copy's IV shows under its plaintext name, or
/// under the copy's readable conflict name where an entry before it already shows that name.
/// So directory metadata in conflict hides no names.
public struct DirectoryIVs: Sendable, Equatable {
    /// One metadata copy and the IV it holds.
    public struct Other: Sendable, Equatable {
        public let copy: MetadataCopy
        public let iv: [UInt8]
        public init(copy: MetadataCopy, iv: [UInt8]) { self.copy = copy; self.iv = iv }
    }

    /// The directory's own IV: new names are encrypted under it.
    public let own: [UInt8]
    /// The copies' IVs that differ from `own` (a copy with the same IV changes nothing).
    public let others: [Other]

    /// Most metadata copies honoured per directory, first by name: every copy costs each
    /// listed name a decryption and each lookup of a missing name an encryption and a stat,
    /// and anyone who can write the store can plant copies (their IVs are not authenticated).
    /// Two devices making one folder apart make one copy; 16 covers 17 devices doing so.
    public static let maxCopies = 16

    /// The IVs of a directory whose own IV is `own` and whose metadata copies hold `copies`
    /// (at most `maxCopies` of them, first by name).
    public init(own: [UInt8], copies: [Other]) {
        self.own = own
        var seen: Set<[UInt8]> = [own]
        var kept: [Other] = []
        for c in copies.sorted(by: { $0.copy.backing < $1.copy.backing }) where kept.count < Self.maxCopies {
            if seen.insert(c.iv).inserted { kept.append(c) }
        }
        others = kept
    }

    /// The names among `names` that are metadata copies, first by name, at most `maxCopies`
    /// (the rest are ignored), and whether some were left out.
    public static func copyNames(among names: [String]) -> (names: [String], leftOut: Bool) {
        let all = names.filter { MetadataCopy(backing: $0) != nil }.sorted()
        return (Array(all.prefix(maxCopies)), all.count > maxCopies)
    }

    /// Reads the metadata copies among the entries `names` of `dirFD` (`copyNames`): each one's
    /// IV, the names of those that do not read as directory metadata (not a regular file, or
    /// not parsing), and whether some were left out.
    public static func readCopies(
        dirFD: Int32, among names: [String], cipher: NameCipher
    ) -> (copies: [Other], unreadable: [String], leftOut: Bool) {
        let (picked, leftOut) = copyNames(among: names)
        var copies: [Other] = [], unreadable: [String] = []
        for name in picked {
            guard let copy = MetadataCopy(backing: name) else { continue }
            let fd = StoreFileOpen.regular(dirFD, name)
            var buf = [UInt8](repeating: 0, count: 512)
            let n = fd >= 0 ? read(fd, &buf, buf.count) : -1
            if fd >= 0 { close(fd) }
            if n > 0, let m = try? DirectoryMeta.decode(Array(buf[0..<n]), cipher) {
                copies.append(Other(copy: copy, iv: m.iv))
            } else {
                unreadable.append(name)
            }
        }
        return (copies, unreadable, leftOut)
    }

    /// Every IV in order: the own one first (index 0), then each other's (index k + 1).
    public var all: [[UInt8]] { [own] + others.map(\.iv) }

    /// The copy a readable conflict name's date, time and device name, with its index in `all`.
    public func other(date: String, time: String, device: String) -> (index: Int, other: Other)? {
        guard let k = others.firstIndex(where: { $0.copy.matches(date: date, time: time, device: device) }) else {
            return nil
        }
        return (k + 1, others[k])
    }

    /// The name the mount shows for an entry whose plaintext is `plain` and which decrypted
    /// under IV `index` of `all`, given the names `taken` by entries shown before it (own-IV
    /// entries first, then each copy's in order).
    public func shownName(plain: String, index: Int, taken: Set<String>) -> String {
        guard index > 0, taken.contains(plain) else { return plain }
        return others[index - 1].copy.readableName(of: plain)
    }
}
