import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// Whole reads of /proc files. Foundation's `String(contentsOfFile:)` and `Data(contentsOf:)`
/// trust `st_size`, which is 0 for /proc files, and return only the first read (about one
/// page): on a machine with many mounts `/proc/self/mountinfo` lost its keybagfs lines.
public enum ProcFile {
    /// The whole content of `path`, read with `read(2)` until end of file; nil if it cannot
    /// be opened or a read fails.
    public static func read(_ path: String) -> String? {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let n = chunk.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
            if n < 0 {
                if errno == EINTR { continue }
                return nil
            }
            if n == 0 { break }
            bytes.append(contentsOf: chunk[0..<n])
        }
        return String(decoding: bytes, as: UTF8.self)
    }
}
