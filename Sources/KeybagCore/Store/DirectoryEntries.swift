import Glibc

/// The names in a directory opened as a descriptor (without `.` and `..`), read through a
/// duplicate so the descriptor stays the caller's; empty when it cannot be read.
public enum DirectoryEntries {
    /// The names in directory `fd`.
    public static func names(of fd: Int32) -> [String] {
        let d = dup(fd)
        guard d >= 0, let dir = fdopendir(d) else { return [] }
        defer { closedir(dir) }
        rewinddir(dir)
        var out: [String] = []
        while let e = readdir(dir) {
            let name = withUnsafePointer(to: &e.pointee.d_name) {
                $0.withMemoryRebound(to: CChar.self, capacity: 256) { String(cString: $0) }
            }
            if name != "." && name != ".." { out.append(name) }
        }
        return out
    }
}
