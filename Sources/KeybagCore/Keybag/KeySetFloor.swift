import Foundation
import Glibc

/// The newest key set each device has held, kept outside the store: a keybag restored from
/// an older copy (from before a device's removal, so that new files would use keys the
/// removed device holds) is refused instead of used. One file per store,
/// `STATE/STOREID.keysets` (JSON: device id → key set), where STATE is `$STATE_DIRECTORY`
/// (systemd's StateDirectory=) or /var/lib/keybagfs: the daemon and every command find the
/// same file whatever path their device key comes from.
public enum KeySetFloor {
    /// The folder of what each device keeps outside the store: `$STATE_DIRECTORY` or
    /// /var/lib/keybagfs.
    static var stateFolder: String {
        ProcessInfo.processInfo.environment["STATE_DIRECTORY"]?.split(separator: ":").first.map(String.init)
            ?? "/var/lib/keybagfs"
    }

    /// The floor file of store `storeID`.
    static func path(storeID: String) -> String { stateFolder + "/\(storeID).keysets" }

    /// The recorded floors; an unreadable file is an error (fail closed), an absent one none.
    static func floors(at path: String) throws -> [String: Int] {
        var st = stat()
        guard lstat(path, &st) == 0 || errno != ENOENT else { return [:] }
        guard let d = try? StoreFileOpen.contents(path),
            let all = try? JSONDecoder().decode([String: Int].self, from: d)
        else {
            throw KeybagError.corrupt(
                "the key-set record \(path) is unreadable; remove it only if no keybag was rolled back")
        }
        return all
    }

    /// Refuses `kb` when its device held a newer key set before.
    public static func check(_ kb: Keybag, deviceID: String) throws {
        let floor = try floors(at: path(storeID: kb.file.storeID))[deviceID] ?? 0
        guard kb.currentKeySet >= floor else {
            throw KeybagError.corrupt(
                "this device's keybag has key set \(kb.currentKeySet) but the device held key set \(floor) before: "
                    + "the keybag was rolled back to an older copy (removed devices could open new files); "
                    + "restore the newer keybag, or take the keys up again with `keybagfs recover`")
        }
    }

    /// Records `kb`'s key set as its device's floor when it is newer (never lowers it).
    public static func record(_ kb: Keybag, deviceID: String) throws {
        let p = path(storeID: kb.file.storeID)
        var all = try floors(at: p)
        guard kb.currentKeySet > all[deviceID] ?? 0 else { return }
        all[deviceID] = kb.currentKeySet
        let dir = PathText.parent(p)
        try? FileManager.default.createDirectory(
            atPath: dir, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        try AtomicFile.write(try JSONEncoder().encode(all), to: p)
    }

    /// `check`, then `record`: what a daemon does at start.
    public static func checkAndRecord(_ kb: Keybag, deviceKey: SecureKey) throws {
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: kb.file.storeID)
        try check(kb, deviceID: id)
        try record(kb, deviceID: id)
    }
}
