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
