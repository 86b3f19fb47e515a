import Glibc

/// The two header slots at the start of a backing file (docs/FORMAT.md, "File header"):
/// reading the current header, writing a new file's, and the crash-safe class change.
public enum HeaderSlots {
    /// Reads the header of the backing file.
    public static func current(fd: Int32) throws -> FileHeader { try read(fd: fd).current }

    /// Reads the header and the index of a superseded slot an interrupted class change left.
    public static func read(fd: Int32) throws -> (current: FileHeader, superseded: Int?) {
        var buf = [UInt8](repeating: 0, count: FileHeader.size)
        let n = try buf.withUnsafeMutableBytes { try FullIO.preadFull(fd, $0, offset: 0) }
        guard n == FileHeader.size else { throw KeybagError.corrupt("file header truncated") }
        return try FileHeader.parseSlots(buf)
    }

    /// Erases a header slot (the older class's wrap) and makes that durable.
    public static func erase(fd: Int32, index: Int) throws {
        let zeros = [UInt8](repeating: 0, count: FileHeader.slotSize)
        try zeros.withUnsafeBytes { try FullIO.pwriteFull(fd, $0, offset: index * FileHeader.slotSize) }
        guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync", errno) }
    }

    /// Writes a new file's header (its slot and an empty other slot).
    public static func writeNew(fd: Int32, _ header: FileHeader) throws {
        var buf = [UInt8](repeating: 0, count: FileHeader.size)
        let slot = header.encodeSlot()
        buf.replaceSubrange(header.slotOffset..<(header.slotOffset + FileHeader.slotSize), with: slot)
        try buf.withUnsafeBytes { try FullIO.pwriteFull(fd, $0, offset: 0) }
    }

    /// Writes a header's slot and makes it durable: the crash-safe class change.
    public static func write(fd: Int32, _ header: FileHeader) throws {
        let slot = header.encodeSlot()
        try slot.withUnsafeBytes { try FullIO.pwriteFull(fd, $0, offset: header.slotOffset) }
        guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync", errno) }
    }
}
