import Foundation
import Glibc

/// Opening a store's overwrite journal: its live records (left by a power cut or a kill) are
/// replayed into their files first, then the ring starts empty.
public enum JournalReplay {
    /// What a replay did.
    public struct Summary: Sendable, Equatable {
        public var records = 0, written = 0, skipped = 0, files = 0, unknownFiles = 0
    }

    /// The journal's file name in the store: one per device (a sync engine may carry another
    /// device's, which is never read here).
    public static func fileName(deviceID: String) -> String { ".kbfs-journal-" + deviceID }

    /// Replays the journal of `deviceID` in `storePath` (when there is one) and returns the
    /// live journal, made when missing.
    public static func open(
        storePath: String, deviceID: String, ringSize: Int = OverwriteJournal.defaultRingSize,
        log: (String) -> Void
    ) throws -> OverwriteJournal {
        let path = storePath + "/" + fileName(deviceID: deviceID)
        var sb = try replay(storePath: storePath, deviceID: deviceID, log: log)
        if sb == nil || sb!.ringSize != ringSize || fileSize(path) != JournalSuperblock.ringStart + ringSize {
            sb = try create(path, ringSize: ringSize, firstSeq: sb?.tailSeq ?? 1)
        }
        let fd = Glibc.open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW)
        guard fd >= 0 else { throw KeybagError.system("open \(fileName(deviceID: deviceID))", errno) }
        return OverwriteJournal(fd: fd, superblock: sb!)
    }

    /// Writes every live record of the journal into its file, syncs those files and moves
    /// the tail past them; returns the superblock as it then is (nil: no usable journal).
    @discardableResult
    public static func replay(storePath: String, deviceID: String, log: (String) -> Void) throws -> JournalSuperblock? {
        let path = storePath + "/" + fileName(deviceID: deviceID)
        let fd = Glibc.open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW)
        guard fd >= 0 else {
            if errno == ENOENT { return nil }  // any other failure must not let a new journal replace it
            throw KeybagError.system("open \(fileName(deviceID: deviceID))", errno)
        }
        defer { close(fd) }
        var head = [UInt8](repeating: 0, count: 512)
        guard try head.withUnsafeMutableBytes({ try EncryptedContent.preadFull(fd, $0, offset: 0) }) == 512,
            var sb = JournalSuperblock.decode(head)
        else {
            log("the overwrite journal \(fileName(deviceID: deviceID)) has no valid superblock: made anew")
            return nil
        }
        let (records, end, nextSeq) = try scan(fd, sb)
        guard !records.isEmpty else { return sb }
        let summary = try write(records, storePath: storePath)
        sb.tailPos = end
        sb.tailSeq = nextSeq
        try sb.encoded().withUnsafeBytes { try EncryptedContent.pwriteFull(fd, $0, offset: 0) }
        guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync journal", errno) }
        log(
            "overwrite journal replayed: \(summary.records) records, \(summary.written) written into "
                + "\(summary.files) files, \(summary.skipped) no longer needed"
                + (summary.unknownFiles > 0 ? ", \(summary.unknownFiles) files gone" : ""))
        return sb
    }

    /// The live records from the tail on, up to the first that is not whole; where the ring's
    /// live part ends and the next sequence number.
    static func scan(_ fd: Int32, _ sb: JournalSuperblock) throws -> ([JournalRecord], Int, UInt64) {
        var records: [JournalRecord] = []
        var pos = sb.tailPos, seq = sb.tailSeq, scanned = 0
        let minimum = JournalRecord.encodedLength(pathLength: 0, count: 0)
        var header = [UInt8](repeating: 0, count: JournalRecord.headerSize)
        while scanned < sb.ringSize {
            if sb.ringSize - pos < minimum {
                scanned += sb.ringSize - pos
                pos = 0
                continue
            }
            let at = JournalSuperblock.ringStart + pos
            let got = try header.withUnsafeMutableBytes { try EncryptedContent.preadFull(fd, $0, offset: at) }
            guard got == header.count, let total = header.withUnsafeBytes({ JournalRecord.statedLength($0) }),
                total >= minimum, total <= sb.ringSize - pos
            else { break }
            var whole = [UInt8](repeating: 0, count: total)
            _ = try whole.withUnsafeMutableBytes { try EncryptedContent.preadFull(fd, $0, offset: at) }
            guard let r = whole.withUnsafeBytes({ JournalRecord.decode($0, seq: seq, key: sb.key) }) else { break }
            seq += 1
            scanned += total
            if r.kind == .wrap {
                scanned += sb.ringSize - pos - total
                pos = 0
                continue
            }
            records.append(r)
            pos += total
        }
        return (records, pos % sb.ringSize, seq)
    }

    /// Writes the records into their files: a void record ends its file's earlier ones, a
    /// `bytes` record is written where the file reaches past it, an `exactEnd` one where the
    /// file ends right after it. Each file is checked (inode and header file id) first.
    static func write(_ records: [JournalRecord], storePath: String) throws -> Summary {
        var summary = Summary(records: records.count)
        var lastVoid: [UInt64: UInt64] = [:]
        for r in records where r.kind == .void { lastVoid[r.file.ino] = r.seq }
        var files = JournalFileFinder(storePath: storePath)
        defer { files.closeAll() }
        for r in records where r.kind != .void {
            if let v = lastVoid[r.file.ino], r.seq < v {
                summary.skipped += 1
                continue
            }
            guard let (fd, size) = try files.open(r.file) else {
                summary.skipped += 1
                continue
            }
            let end = r.offset + r.bytes.count
            guard r.kind == .exactEnd ? end == size : end <= size else {
                summary.skipped += 1
                continue
            }
            try r.bytes.withUnsafeBytes { try EncryptedContent.pwriteFull(fd, $0, offset: r.offset) }
            summary.written += 1
        }
        summary.files = try files.syncAll()
        summary.unknownFiles = files.missing
        return summary
    }

    /// Makes a journal file of `ringSize` zeroed ring bytes (written, so overwriting it later
    /// changes no metadata) under a temporary name, then renames it into place.
    static func create(_ path: String, ringSize: Int, firstSeq: UInt64) throws -> JournalSuperblock {
        let temp = path + ".new"
        unlink(temp)
        let fd = Glibc.open(temp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw KeybagError.system("create journal", errno) }
        defer { close(fd) }
        let sb = JournalSuperblock.fresh(ringSize: ringSize, firstSeq: firstSeq)
        var page = [UInt8](repeating: 0, count: 1 << 20)
        page.replaceSubrange(0..<512, with: sb.encoded())
        var at = 0
        while at < JournalSuperblock.ringStart + ringSize {
            let n = min(page.count, JournalSuperblock.ringStart + ringSize - at)
            try page.withUnsafeBytes {
                try EncryptedContent.pwriteFull(fd, UnsafeRawBufferPointer(rebasing: $0[0..<n]), offset: at)
            }
            if at == 0 { page.replaceSubrange(0..<512, with: [UInt8](repeating: 0, count: 512)) }
            at += n
        }
        guard Glibc.fsync(fd) == 0, rename(temp, path) == 0 else { throw KeybagError.system("create journal", errno) }
        let dir = Glibc.open((path as NSString).deletingLastPathComponent, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dir >= 0 {
            _ = Glibc.fsync(dir)
            close(dir)
        }
        return sb
    }

    /// A file's size, or -1.
    static func fileSize(_ path: String) -> Int {
        var st = stat()
        return stat(path, &st) == 0 ? Int(st.st_size) : -1
    }
}
