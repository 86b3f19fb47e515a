import Foundation
import Glibc

/// Whether a mounted store has writers besides its daemon (another device's sync engine), so
/// that the daemon must watch it for changes underneath. Watching costs every create, write
/// and rename in the store a fanotify event (measured: untar of the medium tree about 20 %
/// slower), so a store that nothing else writes is not watched in full.
public enum StoreSharing {
    /// How `keybagfs mount --watch-store` decides.
    public enum Mode: String, Sendable, CaseIterable {
        /// Watch in full when `evidence` finds another writer; otherwise watch only the store's
        /// top level (the store root, `devices/` and the data root), and in full from the first
        /// change another process makes there.
        case auto
        /// Always watch in full (a sync engine that leaves no marker, such as rclone or Unison).
        case on
        /// Never watch: the daemon is the only writer.
        case off
    }

    /// Files a sync engine keeps at the root of a folder it syncs, with the engine's name.
    public static let folderMarkers: [(name: String, engine: String)] = [
        (".stfolder", "Syncthing"), (".dropbox", "Dropbox"), (".dropbox.cache", "Dropbox"),
        (".sync", "Resilio Sync"), (".owncloudsync.log", "Nextcloud or ownCloud"),
    ]

    /// Whether `name` is a marker file of a sync engine; its engine's name if so. Nextcloud's
    /// and ownCloud's journals are `.sync_HEX.db` or `._sync_HEX.db`.
    public static func engine(ofMarker name: String) -> String? {
        if let m = folderMarkers.first(where: { $0.name == name }) { return m.engine }
        if (name.hasPrefix(".sync_") || name.hasPrefix("._sync_")) && name.hasSuffix(".db") {
            return "Nextcloud or ownCloud"
        }
        return nil
    }

    /// Why the store at `storePath` has another writer, or nil when nothing says so: another
    /// device's keybag in `devices/`, or a sync engine's marker in the store or in a folder
    /// above it (the engine syncs a folder that holds the store).
    public static func evidence(storePath: String) -> String? {
        if let kb = StoreDevices.entries(storePath).first(where: { $0.hasSuffix(".keybag") }) {
            return "the store has several devices (\(StoreDevices.dirName)/\(kb))"
        }
        var dir = URL(fileURLWithPath: storePath).standardizedFileURL.resolvingSymlinksInPath().path
        while true {
            for name in (try? FileManager.default.contentsOfDirectory(atPath: dir)) ?? [] {
                if let engine = engine(ofMarker: name) {
                    return "\(engine) syncs \(dir) (\(name))"
                }
            }
            if dir == "/" || dir.isEmpty { return nil }
            dir = PathText.parent(dir)
        }
    }
}
