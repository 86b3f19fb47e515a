import Foundation

/// Where control sockets live and how a mount point names one.
public enum ControlPaths {
    /// Folder of default sockets.
    public static let runDirectory = "/run/keybagfs"

    /// `systemd-escape --path`: strips and collapses slashes, `/` becomes `-`, bytes outside
    /// `[A-Za-z0-9:_.]` (and a leading `.`) become `\xNN`; the root is `-`.
    public static func systemdEscapePath(_ path: String) -> String {
        let parts = path.split(separator: "/", omittingEmptySubsequences: true)
        if parts.isEmpty { return "-" }
        let joined = parts.joined(separator: "/")
        var out = ""
        for (i, byte) in joined.utf8.enumerated() {
            switch byte {
            case UInt8(ascii: "/"): out += "-"
            case UInt8(ascii: "."):
                out += i == 0 ? "\\x2e" : "."
            case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"),
                UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: ":"), UInt8(ascii: "_"):
                out += String(UnicodeScalar(byte))
            default:
                out += String(format: "\\x%02x", byte)
            }
        }
        return out
    }

    /// The default socket of a mount point (made absolute).
    public static func defaultSocket(forMountpoint mountpoint: String) -> String {
        // isDirectory: true, so that Foundation does not stat the path (a stat of a FUSE
        // mount whose daemon hangs would hang the caller, e.g. pam-unlock at login).
        let abs = URL(fileURLWithPath: mountpoint, isDirectory: true).standardizedFileURL.path
        return runDirectory + "/" + systemdEscapePath(abs) + ".sock"
    }

    /// The innermost keybagfs mount point that holds `path` (symlinks resolved), or nil.
    public static func keybagfsMount(holding path: String) -> String? {
        let abs = URL(fileURLWithPath: path).standardizedFileURL.resolvingSymlinksInPath().path
        return keybagfsMounts().filter { abs == $0 || abs.hasPrefix($0 == "/" ? "/" : $0 + "/") }.max {
            $0.count < $1.count
        }
    }

    /// Mount points of keybagfs mounts, from /proc/self/mountinfo (octal escapes decoded).
    public static func keybagfsMounts(mountinfo: String? = nil) -> [String] {
        let text = mountinfo ?? (ProcFile.read("/proc/self/mountinfo") ?? "")
        var result: [String] = []
        for line in text.split(separator: "\n") {
            let halves = line.components(separatedBy: " - ")
            guard halves.count >= 2 else { continue }
            let left = halves[0].split(separator: " ")
            let right = halves[1].split(separator: " ")
            guard left.count >= 5, let fstype = right.first, fstype == "fuse.keybagfs" else { continue }
            result.append(unescapeMountinfo(String(left[4])))
        }
        return result
    }

    /// Decodes mountinfo's `\NNN` octal escapes.
    public static func unescapeMountinfo(_ s: String) -> String {
        var bytes: [UInt8] = []
        let u = Array(s.utf8)
        var i = 0
        while i < u.count {
            if u[i] == UInt8(ascii: "\\"), i + 4 <= u.count,
                let v = UInt8(String(decoding: u[(i + 1)..<(i + 4)], as: UTF8.self), radix: 8)
            {
                bytes.append(v); i += 4
            } else {
                bytes.append(u[i]); i += 1
            }
        }
        return String(decoding: bytes, as: UTF8.self)
    }
}

/// Just the `ok` field of a reply: a line whose `ok` is anything but true is a refusal.
private struct ReplyOutcome: Decodable { let ok: Bool? }

/// JSON-line helpers of the control protocol.
public enum ControlProtocol {
    /// Longest accepted request line.
    public static let maxLine = 64 * 1024

    /// A message as one JSON line (no newline): keys sorted, slashes not escaped.
    public static func encode<T: Encodable>(_ message: T) -> String {
        let e = JSONEncoder()
        e.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
        guard let d = try? e.encode(message), let s = String(data: d, encoding: .utf8) else {
            return #"{"error":"internal","message":"unencodable reply","ok":false}"#
        }
        return s
    }

    /// A line as a message of type `T`; nil when it is not one.
    public static func decode<T: Decodable>(_ type: T.Type, from line: String) -> T? {
        try? JSONDecoder().decode(type, from: Data(line.utf8))
    }

    /// A reply line as the reply `T` a request expects, or as the daemon's refusal; nil
    /// when it is neither.
    public static func reply<T: Decodable>(_ type: T.Type, from line: String) -> Result<T, ControlRefusal>? {
        guard let outcome = decode(ReplyOutcome.self, from: line) else { return nil }
        if outcome.ok != true { return decode(ControlRefusal.self, from: line).map { .failure($0) } }
        return decode(type, from: line).map { .success($0) }
    }

    /// ISO 8601 time with milliseconds, UTC.
    public static func timestamp(_ date: Date = Date()) -> String {
        let f = ISO8601DateFormatter()
        f.formatOptions = [.withInternetDateTime, .withFractionalSeconds]
        return f.string(from: date)
    }
}
