import Foundation
import Glibc

/// Finds the files a replay writes into: by the path a record names, else (renamed since) by
/// its inode number in the store's `data/` tree; only a file whose header carries the
/// record's file id counts (an inode number may have been another file's before).
struct JournalFileFinder {
    let storePath: String
    private var opened: [JournalFileKey: (fd: Int32, size: Int)] = [:]
    private var gone: Set<JournalFileKey> = []
    private var byInode: [UInt64: String]?
    /// Files no longer in the store (deleted, or replaced by another file).
    private(set) var missing = 0

    /// The store's `data/` folder, symlinks resolved, with a trailing slash: no file outside
    /// it is ever written (a record's path through a symlinked folder is refused).
    let dataPrefix: String

    init(storePath: String) {
        self.storePath = storePath
        dataPrefix =
            URL(fileURLWithPath: storePath + "/" + Keybag.dataDirName).resolvingSymlinksInPath().path + "/"
    }

    /// A read-write descriptor of the record's file and its backing size, nil when it is gone.
    /// Throws when a file cannot be looked at for another reason than being gone (its
    /// records must not be dropped then).
    mutating func open(_ id: JournalFileID) throws -> (Int32, Int)? {
        if let f = opened[id.key] { return (f.fd, f.size) }
        if gone.contains(id.key) { return nil }
        // By its path the file id alone must match (a copy of the store has other inode numbers).
        let hint = Self.isInsideData(id.path) ? try check(storePath + "/" + id.path, id, sameInode: false) : nil
        if let f = try hint ?? byInodeScan(id) {
            opened[id.key] = f
            return (f.fd, f.size)
        }
        gone.insert(id.key)
        missing += 1
        return nil
    }

    /// Syncs every file written into; returns how many.
    mutating func syncAll() throws -> Int {
        for f in opened.values where fdatasync(f.fd) != 0 { throw KeybagError.system("fdatasync", errno) }
        return opened.count
    }

    /// Closes what was opened.
    mutating func closeAll() {
        for f in opened.values { close(f.fd) }
        opened = [:]
    }

    /// Whether a record's path names a file below `data/` (no `..`, not absolute): a record
    /// written by someone else is never followed out of the store.
    static func isInsideData(_ path: String) -> Bool {
        let parts = path.split(separator: "/", omittingEmptySubsequences: false)
        return parts.first == Substring(Keybag.dataDirName) && parts.count > 1
            && !parts.contains { $0 == ".." || $0 == "." || $0.isEmpty }
    }

    /// The file at `path` when it is the record's (its file id, and its inode number when
    /// `sameInode`) and lies in `data/`; nil when it is not or is gone.
    func check(_ path: String, _ id: JournalFileID, sameInode: Bool) throws -> (fd: Int32, size: Int)? {
        let fd = Glibc.open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else {
            if [ENOENT, ENOTDIR, ELOOP].contains(errno) { return nil }
            throw KeybagError.system("open \(path) to replay the overwrite journal", errno)
        }
        var buf = [CChar](repeating: 0, count: Int(PATH_MAX) + 1)
        let n = readlink("/proc/self/fd/\(fd)", &buf, buf.count - 1)
        let real = n > 0 ? String(decoding: buf[0..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self) : ""
        guard real.hasPrefix(dataPrefix) else {
            close(fd)
            return nil
        }
        var st = stat()
        var header = [UInt8](repeating: 0, count: FileHeader.size)
        let got = header.withUnsafeMutableBytes { (try? EncryptedContent.preadFull(fd, $0, offset: 0)) ?? 0 }
        guard fstat(fd, &st) == 0, !sameInode || UInt64(st.st_ino) == id.ino, (st.st_mode & S_IFMT) == S_IFREG,
            got == FileHeader.size, (try? FileHeader.parse(header))?.fileID == id.fileID
        else {
            close(fd)
            return nil
        }
        return (fd, Int(st.st_size))
    }

    /// The file found by inode number in `data/` (the tree is walked once).
    private mutating func byInodeScan(_ id: JournalFileID) throws -> (fd: Int32, size: Int)? {
        if byInode == nil {
            var map: [UInt64: String] = [:]
            Self.walk(storePath + "/" + Keybag.dataDirName, into: &map, depth: 0)
            byInode = map
        }
        guard let path = byInode?[id.ino] else { return nil }
        return try check(path, id, sameInode: true)
    }

    /// Regular files under `dir` by inode number.
    static func walk(_ dir: String, into map: inout [UInt64: String], depth: Int) {
        guard depth < 256, let d = opendir(dir) else { return }
        defer { closedir(d) }
        while let e = readdir(d) {
            let name = withUnsafeBytes(of: e.pointee.d_name) {
                String(cString: $0.bindMemory(to: CChar.self).baseAddress!)
            }
            if name == "." || name == ".." { continue }
            let path = dir + "/" + name
            var st = stat()
            guard lstat(path, &st) == 0 else { continue }
            if (st.st_mode & S_IFMT) == S_IFDIR {
                walk(path, into: &map, depth: depth + 1)
            } else if (st.st_mode & S_IFMT) == S_IFREG {
                map[UInt64(st.st_ino)] = path
            }
        }
    }
}
