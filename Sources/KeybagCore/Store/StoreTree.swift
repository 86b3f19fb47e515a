import Glibc

/// The one walk of a store's tree of entries (`data/`), shared by fsck, rewrap and the
/// journal's finder: folders depth first by descriptor (`openat` with `O_NOFOLLOW`, so no
/// symlink is followed and nothing but a folder is opened), each folder's entries listed once
/// and in name order, each with its kind (`BackingKind`) and `lstat`; at most `maxDepth` deep.
public enum StoreTree {
    /// The deepest folder walked (each level holds one descriptor); a deeper one is reported
    /// as not openable (ELOOP).
    public static let maxDepth = 256

    /// A folder of the tree while it is walked.
    public struct Folder {
        /// The folder, open (`O_RDONLY|O_DIRECTORY`) until its walk ends.
        public let fd: Int32
        /// Its path in the store (`data/…`), or relative to where the walk began.
        public let path: String
        /// Its entries' names (without . and ..), sorted.
        public let names: [String]
    }

    /// One entry of a folder.
    public struct Entry {
        /// The backing name, and the path (the folder's path and the name).
        public let name: String, path: String
        /// What the name is.
        public let kind: BackingKind
        /// Its `lstat`; nil when it is gone since the folder was listed.
        public let stat: stat?

        /// Whether the entry is a folder (not a symlink to one).
        public var isFolder: Bool { stat.map { $0.st_mode & S_IFMT == S_IFDIR } ?? false }
        /// Whether the entry is a regular file (not a symlink to one).
        public var isRegularFile: Bool { stat.map { $0.st_mode & S_IFMT == S_IFREG } ?? false }
    }

    /// Walks folder `fd` (at `path`) and everything below it. `enter` runs first in each
    /// folder and makes what its entries are seen with (fsck: the folder's metadata); `visit`
    /// runs for each entry and returns, for a folder, what to walk it with (nil: not walked).
    /// A folder that does not open (or is too deep) goes to `unopenable` with what it was to
    /// be walked with and the errno.
    public static func walk<Down, Here>(
        _ fd: Int32, path: String, _ down: Down, depth: Int = 0,
        enter: (Folder, Down) throws -> Here, visit: (Folder, Entry, Here) throws -> Down?,
        unopenable: (Entry, Down, Int32) throws -> Void
    ) rethrows {
        let folder = Folder(fd: fd, path: path, names: DirectoryEntries.names(of: fd).sorted())
        let here = try enter(folder, down)
        for name in folder.names {
            var st = stat()
            let entry = Entry(
                name: name, path: path.isEmpty ? name : path + "/" + name, kind: BackingKind.of(name),
                stat: fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 ? st : nil)
            guard let next = try visit(folder, entry, here), entry.isFolder else { continue }
            guard depth + 1 < maxDepth else {
                try unopenable(entry, next, ELOOP)
                continue
            }
            let sub = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
            guard sub >= 0 else {
                try unopenable(entry, next, errno)
                continue
            }
            defer { close(sub) }
            try walk(
                sub, path: entry.path, next, depth: depth + 1, enter: enter, visit: visit, unopenable: unopenable)
        }
    }
}
