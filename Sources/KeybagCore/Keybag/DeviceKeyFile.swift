import Foundation

/// The device key file: 32 random bytes, mode 0600, outside the store.
public enum DeviceKeyFile {
    /// Default location for a store id.
    public static func defaultPath(storeID: String) -> String { "/var/lib/keybagfs/\(storeID).key" }

    /// Creates a new device key at `path` (refuses to overwrite), returns it.
    public static func create(at path: String) throws -> SecureKey {
        let dir = PathText.parent(path)
        if !dir.isEmpty {
            try? FileManager.default.createDirectory(
                atPath: dir, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        }
        let fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw KeybagError.system("cannot create device key \(path)", errno) }
        defer { close(fd) }
        let key = SecureKey(random: 32)
        let n = try key.withBytes { write(fd, $0.baseAddress!, 32) }
        guard n == 32, fsync(fd) == 0 else { throw KeybagError.system("cannot write device key \(path)", errno) }
        syncFolder(of: path)
        return key
    }

    /// Makes a new or renamed entry in the folder of `path` durable.
    public static func syncFolder(of path: String) {
        let dir = PathText.parent(path)
        let dfd = open(dir.isEmpty ? "." : dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dfd >= 0 { fsync(dfd); close(dfd) }
    }

    /// Reads a device key; it must be exactly 32 bytes.
    public static func load(from path: String) throws -> SecureKey {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { throw KeybagError.system("cannot read device key \(path)", errno) }
        defer { close(fd) }
        var st = stat()
        guard fstat(fd, &st) == 0, st.st_size == 32 else {
            throw KeybagError.invalid("device key \(path) must be exactly 32 bytes")
        }
        return try SecureKey(count: 32) { out in
            guard read(fd, out.baseAddress!, 32) == 32 else {
                throw KeybagError.system("cannot read device key \(path)", errno)
            }
        }
    }
}
