import CSystem
import Foundation
import Glibc

/// Finds the files a replay writes into, below the store's `data/` folder only (never through
/// a symlink, never anything but a regular file): by the path a record names, else (renamed
/// since) by its inode number. Only a file whose header carries the record's file id counts;
/// in the store the records were written in (`sameStore`), also only the inode they were
/// written into (its number and stamp), so another version of the file (a sync engine's
/// rename over it, a new file on a reused inode number) never takes its records; in a copy of
/// the store (other inode numbers) the path and file id decide.
struct JournalFileFinder {
    let storePath: String
    let sameStore: Bool
    private var opened: [JournalFileKey: (fd: Int32, size: Int)] = [:]
    private var gone: Set<JournalFileKey> = []
    private var byInode: [UInt64: String]?
    /// The files found so far by (device, inode), and the descriptors to close.
    private var byFound: [UInt64: [(dev: UInt64, fd: Int32)]] = [:]
    private var owned: [Int32] = []
    /// Files no longer in the store (deleted, or replaced by another file).
    private(set) var missing = 0
    /// An `O_PATH` descriptor of the store's `data/` folder (-1: there is none).
    private let dataFD: Int32

    init(storePath: String, sameStore: Bool) {
        self.storePath = storePath
        self.sameStore = sameStore
        dataFD = Glibc.open(storePath + "/" + Keybag.dataDirName, kbfs_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
    }

    /// A read-write descriptor of the record's file and its backing size, nil when it is gone.
    /// Throws when a file cannot be looked at for another reason than being gone (its
    /// records must not be dropped then).
    mutating func open(_ id: JournalFileID) throws -> (Int32, Int)? {
        if let f = opened[id.key] { return (f.fd, f.size) }
        if gone.contains(id.key) { return nil }
        let prefix = Keybag.dataDirName + "/"
        let hint = Self.isInsideData(id.path) ? try check(String(id.path.dropFirst(prefix.count)), id) : nil
        if var f = try hint ?? byInodeScan(id) {
            // One descriptor per file found, however many identities name it (a crafted journal's
            // records under many inode numbers would otherwise use up the descriptors).
            var st = stat()
            if fstat(f.fd, &st) != 0 {
                owned.append(f.fd)
            } else {
                let inode = (UInt64(st.st_dev), UInt64(st.st_ino))
                if let same = byFound[inode.1]?.first(where: { $0.dev == inode.0 }) {
                    close(f.fd)
                    f = (same.fd, f.size)
                } else {
                    byFound[inode.1, default: []].append((inode.0, f.fd))
                    owned.append(f.fd)
                }
            }
            opened[id.key] = f
            return (f.fd, f.size)
        }
        gone.insert(id.key)
        missing += 1
        return nil
    }

    /// Syncs every file written into; returns how many.
    mutating func syncAll() throws -> Int {
        for fd in owned where fdatasync(fd) != 0 { throw KeybagError.system("fdatasync", errno) }
        return owned.count
    }

    /// Closes what was opened.
    mutating func closeAll() {
        for fd in owned { close(fd) }
        owned = []
        opened = [:]
        if dataFD >= 0 { close(dataFD) }
    }

    /// Whether a record's path names a file below `data/` (no `..`, not absolute): a record
    /// written by someone else is never followed out of the store.
    static func isInsideData(_ path: String) -> Bool {
        let parts = path.split(separator: "/", omittingEmptySubsequences: false)
        return parts.first == Substring(Keybag.dataDirName) && parts.count > 1
            && !parts.contains { $0 == ".." || $0 == "." || $0.isEmpty }
    }

    /// The file at `rel` (below `data/`) when it is the record's; nil when it is not, is not
    /// a regular file, lies through a symlink, or is gone. Nothing but a regular file found
    /// below `data/` is ever opened for reading or writing.
    func check(_ rel: String, _ id: JournalFileID) throws -> (fd: Int32, size: Int)? {
        guard dataFD >= 0 else { return nil }
        let pathFD = kbfs_open_beneath(dataFD, rel)
        guard pathFD >= 0 else {
            if [ENOENT, ENOTDIR, ELOOP, EXDEV, ENAMETOOLONG].contains(errno) { return nil }
            throw KeybagError.system("open data/\(rel) to replay the overwrite journal", errno)
        }
        defer { close(pathFD) }
        var st = stat()
        guard fstat(pathFD, &st) == 0, (st.st_mode & S_IFMT) == S_IFREG,
            !sameStore || UInt64(st.st_ino) == id.ino
        else { return nil }
        let fd = Glibc.open("/proc/self/fd/\(pathFD)", O_RDWR | O_CLOEXEC | O_NONBLOCK)
        guard fd >= 0 else { throw KeybagError.system("open data/\(rel) to replay the overwrite journal", errno) }
        var header = [UInt8](repeating: 0, count: FileHeader.size)
        let got = header.withUnsafeMutableBytes { (try? FullIO.preadFull(fd, $0, offset: 0)) ?? 0 }
        guard fstat(fd, &st) == 0, (st.st_mode & S_IFMT) == S_IFREG,
            !sameStore || id.stamp == 0 || kbfs_inode_stamp(fd) == id.stamp,
            got == FileHeader.size, (try? FileHeader.parse(header))?.fileID == id.fileID
        else {
            close(fd)
            return nil
        }
        return (fd, Int(st.st_size))
    }

    /// The file found by inode number in `data/` (the tree is walked once; in the store the
    /// records were written in only: elsewhere inode numbers name other files).
    private mutating func byInodeScan(_ id: JournalFileID) throws -> (fd: Int32, size: Int)? {
        guard sameStore else { return nil }
        if byInode == nil {
            byInode = Self.regularFilesByInode(storePath + "/" + Keybag.dataDirName)
        }
        guard let rel = byInode?[id.ino] else { return nil }
        return try check(rel, id)
    }

    /// Regular files under `data` by inode number, with their paths relative to it (`StoreTree`).
    static func regularFilesByInode(_ data: String) -> [UInt64: String] {
        var map: [UInt64: String] = [:]
        let fd = Glibc.open(data, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { return map }
        defer { close(fd) }
        StoreTree.walk(
            fd, path: "", (), enter: { _, _ in },
            visit: { _, e, _ -> Void? in
                if e.isFolder { return () }
                if e.isRegularFile, let st = e.stat { map[UInt64(st.st_ino)] = e.path }
                return nil
            }, unopenable: { _, _, _ in })
        return map
    }
}
