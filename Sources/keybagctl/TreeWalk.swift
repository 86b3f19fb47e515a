import ArgumentParser
import CSystem
import Foundation
import Glibc
import KeybagCLI
import KeybagCore

/// A walk over a tree that never follows symlinks and never leaves the file system it
/// starts on (so never the mount).
struct TreeWalk {
    /// One entry: its path, lstat, and for directories their default class's parent's.
    typealias Visit = (_ path: String, _ st: stat, _ depth: Int) -> Void

    /// Visits `root` and, if it is a directory and `recursive`, everything below it
    /// (directories before their contents). Unreadable directories are reported to `failed`.
    static func walk(_ root: String, recursive: Bool, visit: Visit, failed: (String, Int32) -> Void) {
        var st = stat()
        guard lstat(root, &st) == 0 else { return failed(root, errno) }
        let dev = st.st_dev
        visit(root, st, 0)
        guard recursive, st.st_mode & S_IFMT == S_IFDIR else { return }
        var stack: [(String, Int)] = [(root, 1)]
        while let (dir, depth) = stack.popLast() {
            guard let d = opendir(dir) else { failed(dir, errno); continue }
            var subdirs: [String] = []
            while let e = readdir(d) {
                let name = withUnsafeBytes(of: e.pointee.d_name) {
                    String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self)
                }
                if name == "." || name == ".." { continue }
                let p = dir == "/" ? "/" + name : dir + "/" + name
                var s = stat()
                guard lstat(p, &s) == 0 else { failed(p, errno); continue }
                guard s.st_dev == dev else { continue }
                visit(p, s, depth)
                if s.st_mode & S_IFMT == S_IFDIR { subdirs.append(p) }
            }
            closedir(d)
            for s in subdirs.reversed() { stack.append((s, depth + 1)) }
        }
    }

    /// The `user.protection` value of a path, or nil.
    static func protection(_ path: String) -> String? {
        var buf = [UInt8](repeating: 0, count: 128)
        let n = getxattr(path, "user.protection", &buf, buf.count)
        return n > 0 ? String(decoding: buf[0..<n], as: UTF8.self) : nil
    }
}

/// A progress line on stderr when it is a terminal: count, rate, and ETA when a total is known.
final class ProgressLine {
    private let label: String
    private let total: Int?
    private let start = Date()
    private var last = Date.distantPast
    private let enabled = isatty(2) == 1
    private(set) var count = 0

    init(_ label: String, total: Int? = nil) { self.label = label; self.total = total }

    /// Counts one item; redraws at most ten times a second.
    func tick() {
        count += 1
        guard enabled else { return }
        let now = Date()
        guard now.timeIntervalSince(last) >= 0.1 else { return }
        last = now
        let rate = Double(count) / max(now.timeIntervalSince(start), 0.001)
        var line = "\r\(label): \(count)"
        if let total, total > 0 {
            let width = 30, done = min(width, count * width / total)
            line +=
                "/\(total) [" + String(repeating: "#", count: done) + String(repeating: ".", count: width - done) + "]"
            line += String(format: " %.0f/s, ETA %.0f s", rate, Double(max(0, total - count)) / max(rate, 1))
        } else {
            line += String(format: " (%.0f/s)", rate)
        }
        FileHandle.standardError.write(Data((line + "\u{1b}[K").utf8))
    }

    /// Clears the line.
    func finish() { if enabled && count > 0 { FileHandle.standardError.write(Data("\r\u{1b}[K".utf8)) } }
}
