import CSystem
import Foundation
import Glibc

extension FileManager {
    /// The protection class of a file, or the default class a directory gives new files.
    public func protection(ofItemAtPath path: String) throws -> FileProtectionType {
        var buf = [UInt8](repeating: 0, count: 128)
        let n = getxattr(path, protectionAttribute, &buf, buf.count)
        guard n >= 0 else {
            throw ProtectionErrors.error(errno, path: path, writing: false, what: "reading the protection of")
        }
        let name = String(decoding: buf[0..<n], as: UTF8.self)
        guard let t = FileProtectionType(keybagfsName: name) else {
            throw CocoaError(
                .fileReadCorruptFile,
                userInfo: [
                    NSFilePathErrorKey: path,
                    NSLocalizedDescriptionKey: "unknown protection class \"\(name)\" on \(path)",
                ])
        }
        return t
    }

    /// Sets the protection class of a file, or the default class of a directory. Changing
    /// a file's class is crash-safe in keybagfs (the file reads in the old or new class).
    public func setProtection(_ protection: FileProtectionType, ofItemAtPath path: String) throws {
        guard let name = protection.keybagfsName else {
            throw ProtectionErrors.invalidArgument(path: path, "unknown protection type \(protection.rawValue)")
        }
        guard setxattr(path, protectionAttribute, name, name.utf8.count, 0) == 0 else {
            throw ProtectionErrors.error(errno, path: path, writing: true, what: "setting the protection of")
        }
    }

    /// `attributesOfItem(atPath:)` with `.protectionKey` filled in from keybagfs.
    public func protectedAttributesOfItem(atPath path: String) throws -> [FileAttributeKey: Any] {
        var attrs = try attributesOfItem(atPath: path)
        attrs[.protectionKey] = try protection(ofItemAtPath: path)
        return attrs
    }

    /// `setAttributes(_:ofItemAtPath:)` that also applies `.protectionKey` (Foundation on
    /// Linux ignores it).
    public func setProtectedAttributes(_ attributes: [FileAttributeKey: Any], ofItemAtPath path: String) throws {
        var rest = attributes
        if let p = rest.removeValue(forKey: .protectionKey) {
            let type = (p as? FileProtectionType) ?? (p as? String).map { FileProtectionType(rawValue: $0) }
            guard let type else {
                throw ProtectionErrors.invalidArgument(path: path, "protectionKey must be a FileProtectionType")
            }
            try setProtection(type, ofItemAtPath: path)
        }
        if !rest.isEmpty { try setAttributes(rest, ofItemAtPath: path) }
    }
}

extension Data {
    /// Writes the data to a file of class `protection`: the file is created inside a fresh
    /// private folder whose default class is `protection` (so it never exists with another
    /// class, not even empty), written, synced, and renamed into place; the folder is removed.
    /// `.withoutOverwriting` fails if `url` exists. Errors are `CocoaError`s; EACCES from a
    /// locked class says so (`isProtectedDataUnavailable`).
    public func write(to url: URL, protection: FileProtectionType, options: Data.WritingOptions = []) throws {
        let path = url.path
        guard let className = protection.keybagfsName else {
            throw ProtectionErrors.invalidArgument(path: path, "unknown protection type \(protection.rawValue)")
        }
        let dir = url.deletingLastPathComponent().path
        func fail(_ code: Int32, _ what: String) -> CocoaError {
            ProtectionErrors.error(code, path: path, writing: true, what: what)
        }
        var template = Array((dir + "/.fp-write.XXXXXX").utf8CString)
        guard let made = mkdtemp(&template) else { throw fail(errno, "creating a temporary folder for") }
        let tmpDir = String(cString: made)
        defer { rmdir(tmpDir) }
        guard setxattr(tmpDir, protectionAttribute, className, className.utf8.count, 0) == 0 else {
            throw fail(errno, "setting the class for")
        }
        let tmp = tmpDir + "/" + url.lastPathComponent
        let mask = umask(0)
        umask(mask)
        let fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o666 & ~mask)
        // Judged on the file being created, whose folder carries the class asked for.
        guard fd >= 0 else {
            throw ProtectionErrors.error(errno, path: path, writing: true, what: "creating", classOf: tmp)
        }
        var linked = false
        defer { if !linked { unlink(tmp) } }
        let err: Int32 = withUnsafeBytes { b -> Int32 in
            var off = 0
            while off < b.count {
                let n = Glibc.write(fd, b.baseAddress! + off, b.count - off)
                if n < 0 { if errno == EINTR { continue }; return errno }
                off += n
            }
            return fsync(fd) == 0 ? 0 : errno
        }
        close(fd)
        guard err == 0 else { throw fail(err, "writing") }
        if options.contains(.withoutOverwriting) {
            guard link(tmp, path) == 0 else { throw fail(errno, "creating") }
        } else {
            guard rename(tmp, path) == 0 else { throw fail(errno, "replacing") }
            linked = true
        }
        let dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dfd >= 0 { fsync(dfd); close(dfd) }
    }

    /// `write(to:options:)` that honours the file protection options on a keybagfs mount
    /// (`.completeFileProtection`, `…UnlessOpen`, `…UntilFirstUserAuthentication`,
    /// `.noFileProtection`); without one it is Foundation's write.
    public func writeProtected(to url: URL, options: Data.WritingOptions = []) throws {
        guard let p = options.fileProtection else { return try write(to: url, options: options) }
        try write(to: url, protection: p, options: options)
    }
}
