import CSodium
import Foundation

/// A device's name for itself inside a store: BLAKE2b-128 keyed by its device key over the
/// store id, in hex. It says nothing about the key, and differs from store to store.
public enum DeviceIdentity {
    /// The id of the device holding `deviceKey` in store `storeID`.
    public static func id(deviceKey: SecureKey, storeID: String) throws -> String {
        var out = [UInt8](repeating: 0, count: 16)
        let msg = Array("keybagfs-device-id-v1|\(storeID)".utf8)
        try deviceKey.withBytes { k in
            _ = crypto_generichash(
                &out, 16, msg, UInt64(msg.count), k.baseAddress!.assumingMemoryBound(to: UInt8.self), k.count)
        }
        return out.map { String(format: "%02x", $0) }.joined()
    }

    /// Whether `s` has the shape of a device id (32 lowercase hex digits).
    public static func isWellFormed(_ s: String) -> Bool {
        s.utf8.count == 32 && s.utf8.allSatisfy { (0x30...0x39).contains($0) || (0x61...0x66).contains($0) }
    }
}

/// One device of a store, as `keybagfs device list` shows it.
public struct StoreDevice: Sendable, Equatable {
    /// Its id (nil: the device that made the store, before it mounted with devices support).
    public var id: String?
    /// Its name, as it gave it.
    public var name: String?
    /// Its keybag inside the store (nil once removed).
    public var keybag: String?
    /// When it was removed (Unix time), or nil.
    public var removedAt: Double?
    /// The key set its removal started (files of this set and later are closed to it).
    public var removedBeforeKeySet: Int?
}

/// The devices of a store: one keybag per device (`keybag` for the device that made the
/// store, `devices/ID.keybag` for each added one), each written only by its own device, and
/// a record per removed device. Nothing here is shared state that two devices rewrite.
public enum StoreDevices {
    /// Folder inside the store for added devices' keybags and removal records.
    public static let dirName = "devices"

    /// A device keybag's path inside the store.
    public static func keybagPath(_ id: String) -> String { "\(dirName)/\(id).keybag" }

    /// A removal record's path inside the store.
    static func removalPath(_ id: String) -> String { "\(dirName)/\(id).removed" }

    /// The removal record of `id`, or nil when it was never removed.
    static func removal(storePath: String, id: String) -> DeviceRemoval? {
        guard let data = try? StoreFileOpen.contents(storePath + "/" + removalPath(id)) else { return nil }
        return try? JSONDecoder().decode(DeviceRemoval.self, from: data)
    }

    /// File names in the devices folder (none when it does not exist or is not a real folder).
    static func entries(_ storePath: String) -> [String] {
        var st = stat()
        guard lstat(storePath + "/" + dirName, &st) == 0, st.st_mode & S_IFMT == S_IFDIR else { return [] }
        return ((try? FileManager.default.contentsOfDirectory(atPath: storePath + "/" + dirName)) ?? []).sorted()
    }

    /// Makes the devices folder; refuses one that is a symlink or no folder (the tools run as root).
    static func makeFolder(_ storePath: String) throws {
        let path = storePath + "/" + dirName
        if mkdir(path, 0o700) != 0 && errno != EEXIST { throw KeybagError.system("cannot make \(path)", errno) }
        var st = stat()
        guard lstat(path, &st) == 0, st.st_mode & S_IFMT == S_IFDIR else {
            throw KeybagError.invalid("\(path) is not a folder (a symlink?)")
        }
    }

    /// The newest key set a removal started (0 when no device was removed). A device whose
    /// keybag is older writes files that removed devices can still open, until it takes up
    /// the newer set (`keybagfs recover`).
    public static func newestKeySet(storePath: String) -> Int {
        entries(storePath).filter { $0.hasSuffix(".removed") }
            .compactMap { removal(storePath: storePath, id: String($0.dropLast(8)))?.keySet }.max() ?? 0
    }

    /// Every device of the store, present and removed.
    public static func list(storePath: String) -> [StoreDevice] {
        var out: [StoreDevice] = []
        if let kb = try? Keybag.load(storePath: storePath, relativePath: Keybag.fileName) {
            out.append(StoreDevice(id: kb.file.deviceID, name: kb.file.deviceName, keybag: Keybag.fileName))
        }
        for e in entries(storePath) {
            let rel = dirName + "/" + e
            if e.hasSuffix(".keybag"), let kb = try? Keybag.load(storePath: storePath, relativePath: rel) {
                out.append(StoreDevice(id: kb.file.deviceID, name: kb.file.deviceName, keybag: dirName + "/" + e))
            } else if e.hasSuffix(".removed"), let r = removal(storePath: storePath, id: String(e.dropLast(8))) {
                out.append(StoreDevice(id: r.deviceID, removedAt: r.removedAt, removedBeforeKeySet: r.keySet))
            }
        }
        return out
    }
}
