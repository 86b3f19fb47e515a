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
        guard !BackingKind.isStoreFile(name) else { return nil }
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
        if isStoreFile(name) { return .storeFile }
        if NameCipher.isSideFile(name) { return .sideFile(entry: String(name.dropLast(NameCipher.longSuffix.count))) }
        if let s = SyncEngineFile(backing: name) { return .syncEngine(s) }
        if let copy = ConflictCopy(backing: name), copy.isLong { return .name }
        if NameCipher.isLongName(name) { return .longName }
        if isBase64URL(name) || ConflictCopy(backing: name) != nil { return .name }
        return .foreign
    }

    /// Whether `name` is under the store's reserved prefix (`.kbfs-…`: the metadata, a
    /// temporary, a journal): the one place that prefix is tested.
    static func isStoreFile(_ name: String) -> Bool { name.hasPrefix(NameCipher.reservedPrefix) }

    /// A new temporary name under the reserved prefix (`.kbfs-tmp-` and 12 random
    /// characters): never an entry of the mount, removed by `fsck` if a crash leaves it.
    public static func temporaryName() -> String {
        NameCipher.reservedPrefix + "tmp-" + Base64URL.encode(Sodium.randomArray(9))
    }

    /// Whether the entry carries a name of the mount (or might: foreign entries and sync
    /// engines' files are judged by what they decrypt to): not the store's own files nor a
    /// long name's side file.
    public var carriesName: Bool {
        switch self {
        case .directoryMeta, .storeFile, .sideFile: return false
        case .name, .longName, .syncEngine, .foreign: return true
        }
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
