import Foundation
import Glibc

/// The newest key set a device has held, kept beside its device key (outside the store): a
/// keybag restored from an older copy (from before a device's removal, so that new files
/// would use keys the removed device holds) is refused instead of used. JSON: store id →
/// key set, in `DEVICEKEY.keysets`, or in /var/lib/keybagfs when the key's folder is
/// read-only (a systemd credential).
public enum KeySetFloor {
    /// Where the floor of the device key at `deviceKeyPath` lives.
    static func path(deviceKeyPath: String, storeID: String) -> String {
        let dir = (deviceKeyPath as NSString).deletingLastPathComponent
        if access(dir.isEmpty ? "." : dir, W_OK) == 0 { return deviceKeyPath + ".keysets" }
        return "/var/lib/keybagfs/\(storeID).keysets"
    }

    /// The recorded floors (empty when none).
    static func floors(at path: String) -> [String: Int] {
        guard let d = FileManager.default.contents(atPath: path) else { return [:] }
        return (try? JSONDecoder().decode([String: Int].self, from: d)) ?? [:]
    }

    /// Refuses `kb` when its device held a newer key set before; records its set otherwise.
    public static func check(_ kb: Keybag, deviceKeyPath: String) throws {
        let p = path(deviceKeyPath: deviceKeyPath, storeID: kb.file.storeID)
        var all = floors(at: p)
        let floor = all[kb.file.storeID] ?? 0
        guard kb.currentKeySet >= floor else {
            throw KeybagError.corrupt(
                "this device's keybag has key set \(kb.currentKeySet) but the device held key set \(floor) before: " +
                    "the keybag was rolled back to an older copy (its removed devices could open new files); " +
                    "restore the newer keybag or run `keybagfs recover`")
        }
        guard kb.currentKeySet > floor else { return }
        all[kb.file.storeID] = kb.currentKeySet
        try Keybag.writeAtomically(try JSONEncoder().encode(all), to: p)
    }
}
