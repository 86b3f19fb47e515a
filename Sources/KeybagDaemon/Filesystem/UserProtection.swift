import Dispatch
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization

/// The `user.protection` xattr: a file's class (changed by rewrapping its key) and a
/// directory's default.
extension Attributes {
    /// The class of a file, or the stored default of a directory (ENODATA where none).
    func protection(of id: UInt64) throws -> ProtectionClass {
        let n = try table.known(id)
        if n.isDirectory {
            guard let c = try directories.meta(of: n).defaultClass else { throw FSError(ENODATA) }
            return c
        }
        guard let file = n.file else { throw FSError(ENODATA) }
        if let c = file.io.read({ $0.protectionClass }) { return c }
        return try file.io.write { st in try st.header { try io.readHeader(n) }.protectionClass }
    }

    /// Changes a file's class by rewrapping its key (the rules are `FileKeyLife`'s): the new
    /// slot is written and made durable, then the old slot is erased and that made durable,
    /// so no older class's wrap survives a finished change. On a directory, stores the
    /// default for new children.
    func setProtection(of id: UInt64, to cls: ProtectionClass) throws {
        let n = try table.known(id)
        if n.isDirectory { return try directories.setDirectoryClass(n, cls) }
        guard let file = n.file else { throw FSError(EPERM) }
        let fd = try check(n.open(O_RDWR))
        defer { close(fd) }
        try file.io.write { st in
            _ = try st.header { try io.readHeader(n) }
            try st.changeClass(to: cls, keyring: io.keyring, cipher: io.cipher) { next in
                try HeaderSlots.write(fd: fd, next)
                Failpoint.classChangeBetweenSlots.hit()
                try HeaderSlots.erase(fd: fd, index: 1 - next.slot)
            }
        }
        var after = stat()
        if fstat(fd, &after) == 0 { file.headerRewritten.withLock { $0 = after.st_mtim } }
    }

    /// Removes a directory's stored default (files always have a class: EPERM).
    func removeProtection(of id: UInt64) throws {
        let n = try table.known(id)
        guard n.isDirectory else { throw FSError(n.isRegular ? EPERM : ENODATA) }
        guard try directories.meta(of: n).defaultClass != nil else { throw FSError(ENODATA) }
        try directories.setDirectoryClass(n, nil)
    }
}
