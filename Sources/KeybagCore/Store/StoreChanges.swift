/// A file a sync engine keeps in the folder it syncs: its temporary copy of a file being
/// transferred, or its own folder files (Syncthing's `.stfolder`, `.stignore`, `.stversions`).
/// Stored names are base64url (no `.`) or the store's own forms, so none of these can be an
/// entry of the mount: the daemon skips them silently and `fsck` names them without touching
/// them (the engine may still be writing one).
public struct SyncEngineFile: Sendable, Equatable {
    /// What the file is for.
    public enum Role: Sendable, Equatable {
        /// A transfer in progress: renamed over its target when complete, removed if abandoned.
        case temporary
        /// The engine's own file at the root of the synced folder.
        case folderFile
        /// The engine's copy of a directory's `.kbfs-dir` that changed on two devices apart
        /// (`.sync-conflict-DATE-TIME-DEVICE.kbfs-dir`); the directory keeps its own.
        case metadataConflict
    }

    /// The engine that writes such names.
    public let engine: String
    /// What the file is for.
    public let role: Role

    /// Syncthing's files at the root of a synced folder.
    public static let syncthingFolderFiles: Set<String> = [".stfolder", ".stignore", ".stversions"]

    /// The sync engine file a backing name is, if any (the store's own `.kbfs-*` names never are).
    public init?(backing name: String) {
        guard !name.hasPrefix(NameCipher.reservedPrefix) else { return nil }
        if Self.syncthingFolderFiles.contains(name) {
            (engine, role) = ("Syncthing", .folderFile)
        } else if name.hasPrefix(".sync-conflict-") && name.hasSuffix(DirectoryMeta.fileName) {
            (engine, role) = ("Syncthing", .metadataConflict)
        } else if name.hasSuffix(".tmp") && (name.hasPrefix(".syncthing.") || name.hasPrefix("~syncthing~")) {
            (engine, role) = ("Syncthing", .temporary)
        } else if name.hasSuffix(".partial") {
            (engine, role) = ("rclone", .temporary)
        } else if name.hasPrefix(".unison.") {
            (engine, role) = ("Unison", .temporary)
        } else if name.hasSuffix(".!sync") {
            (engine, role) = ("Resilio Sync", .temporary)
        } else if name.contains("~tmp~") {
            (engine, role) = ("a sync engine", .temporary)
        } else if Self.isRsyncTemporary(name) {
            (engine, role) = ("rsync", .temporary)
        } else {
            return nil
        }
    }

    /// rsync's `.NAME.XXXXXX`: a dot, a stored name, a dot and six random letters or digits.
    static func isRsyncTemporary(_ name: String) -> Bool {
        let u = Array(name.utf8)
        guard u.count > 8, u[0] == UInt8(ascii: "."), u[u.count - 7] == UInt8(ascii: ".") else { return false }
        let stem = String(decoding: u[1..<(u.count - 7)], as: UTF8.self)
        let suffixOK = u[(u.count - 6)...].allSatisfy {
            (0x30...0x39).contains($0) || (0x41...0x5a).contains($0)
                || (0x61...0x7a).contains($0)
        }
        return suffixOK && (BackingKind.isBase64URL(stem) || NameCipher.isLongName(stem) || NameCipher.isSideFile(stem))
    }

    /// One line for people: what the file is and why it is left alone.
    public var description: String {
        switch role {
        case .temporary:
            return "\(engine)'s temporary file of a transfer in progress or abandoned (left alone: the engine may "
                + "still be writing it, and removes it itself)"
        case .folderFile:
            return "\(engine)'s own file at the root of the synced folder (not an entry of the mount)"
        case .metadataConflict:
            return "\(engine)'s copy of the directory's metadata, made when the folder was created on two devices "
                + "apart (left alone: names made under the copy's IV show in the mount too)"
        }
    }
}

/// What a backing entry of `STORE/data` is, judged by its name alone.
public enum BackingKind: Sendable, Equatable {
    /// An encrypted short name, or a sync engine's conflict copy of one.
    case name
    /// A hashed long name `kbl.H`.
    case longName
    /// A long name's side file `kbl.H.name`; `entry` is `kbl.H`.
    case sideFile(entry: String)
    /// The directory's metadata `.kbfs-dir`.
    case directoryMeta
    /// The store's own temporary `.kbfs-tmp-*` (or another reserved name).
    case storeFile
    /// A sync engine's file (see `SyncEngineFile`).
    case syncEngine(SyncEngineFile)
    /// Anything else: written by someone else, never an entry of the mount.
    case foreign

    /// The kind of the backing entry `name`.
    public static func of(_ name: String) -> BackingKind {
        if name == DirectoryMeta.fileName { return .directoryMeta }
        if name.hasPrefix(NameCipher.reservedPrefix) { return .storeFile }
        if NameCipher.isSideFile(name) { return .sideFile(entry: String(name.dropLast(NameCipher.longSuffix.count))) }
        if let copy = ConflictCopy(backing: name), copy.isLong { return .name }
        if NameCipher.isLongName(name) { return .longName }
        if let s = SyncEngineFile(backing: name) { return .syncEngine(s) }
        if isBase64URL(name) || ConflictCopy(backing: name) != nil { return .name }
        return .foreign
    }

    /// Whether `s` is non-empty unpadded base64url, the alphabet of stored short names.
    static func isBase64URL(_ s: String) -> Bool {
        !s.isEmpty
            && s.utf8.allSatisfy { c in
                (0x30...0x39).contains(c) || (0x41...0x5a).contains(c) || (0x61...0x7a).contains(c)
                    || c == UInt8(ascii: "-") || c == UInt8(ascii: "_")
            }
    }
}

/// A change another writer (a sync engine) made in a directory of `STORE/data`, and what the
/// mount must forget because of it. The daemon's watcher reports each change it did not make
/// itself; this decides what it means, the daemon tells the kernel.
public struct StoreChange: Sendable, Equatable {
    /// What happened to the entry.
    public enum Event: Sendable, Equatable {
        /// Created, or moved in (a rename over it counts as a new entry).
        case appeared
        /// Deleted, or moved out.
        case vanished
        /// Its content was written and closed in place (same inode).
        case written
        /// Its mode, owner or times changed.
        case attributesChanged
    }

    /// What the mount must drop.
    public struct Response: Sendable, Equatable {
        /// The backing entry whose plaintext name the kernel must look up again.
        public var entry: String?
        /// The backing entry whose object's attributes (mode, owner, times) are stale.
        public var attributes: String?
        /// The backing entry whose object was rewritten in place: its size, pages, header and
        /// key are stale, and it is looked up again.
        public var rewritten: String?
        /// The directory's metadata (name IV, default class) must be read again.
        public var directoryMeta = false
        /// Every name of the directory must be looked up again (the IVs its names decrypt
        /// under changed: a metadata copy came or went).
        public var everyEntry = false
        /// A directory appeared: watch it and everything below it; classes may inherit anew.
        public var newDirectory = false
        /// A directory moved or went: inherited classes must be recomputed.
        public var classesMayChange = false

        /// Nothing to drop.
        public static let nothing = Response()
        /// Whether there is nothing to drop.
        public var isNothing: Bool { self == .nothing }

        /// A response; every field defaults to nothing.
        public init(
            entry: String? = nil, attributes: String? = nil, rewritten: String? = nil,
            directoryMeta: Bool = false, everyEntry: Bool = false, newDirectory: Bool = false,
            classesMayChange: Bool = false
        ) {
            self.entry = entry
            self.attributes = attributes
            self.rewritten = rewritten
            self.directoryMeta = directoryMeta
            self.everyEntry = everyEntry
            self.newDirectory = newDirectory
            self.classesMayChange = classesMayChange
        }
    }

    /// The backing name that changed.
    public let name: String
    /// What happened to it.
    public let event: Event
    /// Whether the entry is a directory.
    public let isDirectory: Bool

    /// A change of `name` in a watched directory.
    public init(name: String, event: Event, isDirectory: Bool) {
        self.name = name
        self.event = event
        self.isDirectory = isDirectory
    }

    /// What the mount must drop for this change.
    public var response: Response {
        switch BackingKind.of(name) {
        case .name, .longName:
            switch event {
            case .appeared:
                return Response(entry: name, newDirectory: isDirectory, classesMayChange: isDirectory)
            case .vanished:
                return Response(entry: name, classesMayChange: isDirectory)
            case .written:
                return Response(rewritten: name)
            case .attributesChanged:
                return Response(attributes: name)
            }
        case .sideFile(let entry):
            // A side file is written before its entry; a new one names the entry anew.
            return event == .appeared || event == .written ? Response(entry: entry) : .nothing
        case .directoryMeta:
            // A vanished one is the engine emptying the directory to remove it: the IV known
            // here stays (a fresh one written now would hide every name synced in later).
            // Names under the old IV may now show as conflict names or not at all (and back).
            return event == .appeared || event == .written
                ? Response(directoryMeta: true, everyEntry: true, classesMayChange: true) : .nothing
        case .syncEngine(let file) where file.role == .metadataConflict:
            // Names made on the losing device decrypt under the copy's IV.
            return Response(directoryMeta: true, everyEntry: true)
        case .storeFile, .syncEngine, .foreign:
            return .nothing
        }
    }
}
