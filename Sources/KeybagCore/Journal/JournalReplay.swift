import Foundation
import Glibc

/// Opening a store's overwrite journal: its live records (left by a power cut or a kill) are
/// replayed into their files first, then the ring starts empty under a fresh key.
public enum JournalReplay {
    /// What a replay did.
    public struct Summary: Sendable, Equatable {
        public var records = 0, written = 0, skipped = 0, files = 0, unknownFiles = 0
    }

    /// The journal's file name in the store: one per device (a sync engine may carry another
    /// device's, which is never read here).
    public static func fileName(deviceID: String) -> String { ".kbfs-journal-" + deviceID }

    /// Replays the journal of `deviceID` in `storePath` (when there is one) and returns the
    /// live journal, made when missing. `replayed`: the superblock a `replay` just returned
    /// (the records are not replayed a second time); else the journal is replayed here.
    public static func open(
        storePath: String, deviceID: String, ringSize: Int = OverwriteJournal.defaultRingSize,
        replayed: JournalSuperblock?? = nil, log: (String) -> Void
    ) throws -> OverwriteJournal {
        let path = storePath + "/" + fileName(deviceID: deviceID)
        var sb: JournalSuperblock?
        if let replayed { sb = replayed } else { sb = try replay(storePath: storePath, deviceID: deviceID, log: log) }
        if sb == nil || sb!.ringSize != ringSize || fileSize(path) != JournalSuperblock.ringStart + ringSize {
            sb = try create(path, ringSize: ringSize, firstSeq: sb?.tailSeq ?? 1)
        }
        let fd = Glibc.open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK)
        guard fd >= 0 else { throw KeybagError.system("open \(fileName(deviceID: deviceID))", errno) }
        var st = stat()
        // Replaced since it was replayed or made (a FIFO, another ring): not this journal.
        guard fstat(fd, &st) == 0, (st.st_mode & S_IFMT) == S_IFREG,
            Int(st.st_size) == JournalSuperblock.ringStart + sb!.ringSize, sb!.isWritten(in: fd)
        else {
            close(fd)
            throw KeybagError.corrupt(
                "the overwrite journal \(fileName(deviceID: deviceID)) changed while it was opened")
        }
        return OverwriteJournal(fd: fd, superblock: sb!)
    }

    /// Writes every live record of the journal into its file, syncs those files and moves
    /// the tail past them under a fresh checksum key; returns the superblock as it then is
    /// (nil: there is no journal file). A journal file that is not a regular file or whose
    /// superblock is damaged throws: its records cannot be told from garbage, and mounting
    /// without them could later put older bytes over newer ones (`setAside` moves it away).
    @discardableResult
    public static func replay(storePath: String, deviceID: String, log: (String) -> Void) throws -> JournalSuperblock? {
        let name = fileName(deviceID: deviceID)
        let fd = Glibc.open(storePath + "/" + name, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK)
        guard fd >= 0 else {
            if errno == ENOENT { return nil }  // any other failure must not let a new journal replace it
            throw KeybagError.system("open \(name)", errno)
        }
        defer { close(fd) }
        var st = stat()
        guard fstat(fd, &st) == 0, (st.st_mode & S_IFMT) == S_IFREG else {
            throw KeybagError.corrupt("the overwrite journal \(name) is not a regular file")
        }
        var head = [UInt8](repeating: 0, count: 512)
        guard try head.withUnsafeMutableBytes({ try FullIO.preadFull(fd, $0, offset: 0) }) == 512,
            let sb = JournalSuperblock.decode(head), Int(st.st_size) >= JournalSuperblock.ringStart + sb.ringSize
        else {
            throw KeybagError.corrupt(
                "the overwrite journal \(name) has no valid superblock (damaged or cut short); "
                    + "keybagfs fsck --repair sets it aside and the next mount makes a new one")
        }
        let (entries, end, nextSeq) = try scan(fd, sb)
        let summary = try write(entries, from: fd, sb, storePath: storePath)
        let fresh = sb.rekeyed(tailPos: end, tailSeq: nextSeq, fd: fd)
        try fresh.encoded().withUnsafeBytes { try FullIO.pwriteFull(fd, $0, offset: 0) }
        guard fdatasync(fd) == 0 else { throw KeybagError.system("fdatasync journal", errno) }
        if summary.records > 0 {
            log(
                "overwrite journal replayed: \(summary.records) records, \(summary.written) written into "
                    + "\(summary.files) files, \(summary.skipped) no longer needed"
                    + (summary.unknownFiles > 0 ? ", \(summary.unknownFiles) files gone" : ""))
        }
        return fresh
    }

    /// Moves a journal `replay` refused out of the way (kept beside it as `NAME.damaged`), so
    /// the next mount makes a new one; its records are lost.
    public static func setAside(storePath: String, deviceID: String) throws {
        let path = storePath + "/" + fileName(deviceID: deviceID)
        guard rename(path, path + ".damaged") == 0 else { throw KeybagError.system("rename journal", errno) }
    }

    /// One live record's place in the ring.
    struct Entry: Sendable, Equatable {
        let pos: Int, total: Int, seq: UInt64
    }

    /// The live records from the tail on, up to the first that is not whole (each read and
    /// checked, none kept: a reader holds one record at a time), with the sequence number of
    /// each file's last void record; where the ring's live part ends and the next sequence
    /// number.
    static func scan(_ fd: Int32, _ sb: JournalSuperblock) throws -> ([Entry], Int, UInt64) {
        var entries: [Entry] = []
        var pos = sb.tailPos, seq = sb.tailSeq, scanned = 0
        let minimum = JournalRecord.encodedLength(pathLength: 0, count: 0, version: sb.version)
        var header = [UInt8](repeating: 0, count: 32)
        while scanned < sb.ringSize {
            if sb.ringSize - pos < minimum {
                scanned += sb.ringSize - pos
                pos = 0
                continue
            }
            let at = JournalSuperblock.ringStart + pos
            let got = try header.withUnsafeMutableBytes { try FullIO.preadFull(fd, $0, offset: at) }
            guard got == header.count, let total = header.withUnsafeBytes({ JournalRecord.statedLength($0) }),
                total >= minimum, total <= sb.ringSize - pos, total <= JournalRecord.largestRecord
            else { break }
            guard let r = try read(fd, at: pos, total: total, seq: seq, sb) else { break }
            seq += 1
            scanned += total
            if r.kind == .wrap {
                scanned += sb.ringSize - pos - total
                pos = 0
                continue
            }
            entries.append(Entry(pos: pos, total: total, seq: r.seq))
            pos += total
        }
        return (entries, pos % sb.ringSize, seq)
    }

    /// The whole record of `total` bytes at ring position `pos`, nil when it is not one.
    static func read(_ fd: Int32, at pos: Int, total: Int, seq: UInt64, _ sb: JournalSuperblock) throws
        -> JournalRecord?
    {
        var whole = [UInt8](repeating: 0, count: total)
        let got = try whole.withUnsafeMutableBytes {
            try FullIO.preadFull(fd, $0, offset: JournalSuperblock.ringStart + pos)
        }
        guard got == total else { return nil }
        return whole.withUnsafeBytes { JournalRecord.decode($0, seq: seq, key: sb.key, version: sb.version) }
    }

    /// The records of `entries`, read again one at a time from the journal `fd`.
    static func records(_ entries: [Entry], from fd: Int32, _ sb: JournalSuperblock) throws -> [JournalRecord] {
        try entries.compactMap { try read(fd, at: $0.pos, total: $0.total, seq: $0.seq, sb) }
    }

    /// Writes the records at `entries` into their files (read one at a time from `fd`).
    static func write(_ entries: [Entry], from fd: Int32, _ sb: JournalSuperblock, storePath: String) throws -> Summary
    {
        var lastVoid: [JournalFileKey: UInt64] = [:]
        var records = 0
        for e in entries {
            guard let r = try read(fd, at: e.pos, total: e.total, seq: e.seq, sb) else { break }
            records += 1
            if r.kind == .void { lastVoid[r.file.key] = r.seq }
        }
        var files = JournalFileFinder(storePath: storePath, sameStore: sb.isWritten(in: fd))
        defer { files.closeAll() }
        var summary = Summary(records: records)
        for e in entries.prefix(records) {
            guard let r = try read(fd, at: e.pos, total: e.total, seq: e.seq, sb) else { break }
            try write(r, lastVoid: lastVoid, files: &files, summary: &summary)
        }
        summary.files = try files.syncAll()
        summary.unknownFiles = files.missing
        return summary
    }

    /// Writes `records` into their files (`sameStore`: the store they were written in, where
    /// a file is also known by its inode number and stamp): a void record ends its file's
    /// earlier ones, a `bytes` record is written where the file reaches past it, an
    /// `exactEnd` one where the file ends right after it. Each file is checked first.
    static func write(_ records: [JournalRecord], storePath: String, sameStore: Bool = true) throws -> Summary {
        var summary = Summary(records: records.count)
        var lastVoid: [JournalFileKey: UInt64] = [:]
        for r in records where r.kind == .void { lastVoid[r.file.key] = r.seq }
        var files = JournalFileFinder(storePath: storePath, sameStore: sameStore)
        defer { files.closeAll() }
        for r in records { try write(r, lastVoid: lastVoid, files: &files, summary: &summary) }
        summary.files = try files.syncAll()
        summary.unknownFiles = files.missing
        return summary
    }

    /// Replays one record (see `write(_:storePath:sameStore:)`).
    static func write(
        _ r: JournalRecord, lastVoid: [JournalFileKey: UInt64], files: inout JournalFileFinder, summary: inout Summary
    ) throws {
        guard r.kind != .void else { return }
        if let v = lastVoid[r.file.key], r.seq < v {
            summary.skipped += 1
            return
        }
        guard let (fd, size) = try files.open(r.file) else {
            summary.skipped += 1
            return
        }
        let end = r.offset + r.bytes.count
        guard r.kind == .exactEnd ? end == size : end <= size else {
            summary.skipped += 1
            return
        }
        try r.bytes.withUnsafeBytes { try FullIO.pwriteFull(fd, $0, offset: r.offset) }
        summary.written += 1
    }

    /// Makes a journal file of `ringSize` zeroed ring bytes (written, so overwriting it later
    /// changes no metadata) under a temporary name, then renames it into place.
    static func create(_ path: String, ringSize: Int, firstSeq: UInt64) throws -> JournalSuperblock {
        let temp = path + ".new"
        unlink(temp)
        let fd = Glibc.open(temp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard fd >= 0 else { throw KeybagError.system("create journal", errno) }
        defer { close(fd) }
        let sb = JournalSuperblock.fresh(ringSize: ringSize, firstSeq: firstSeq).rekeyed(
            tailPos: 0, tailSeq: firstSeq, fd: fd)
        var page = [UInt8](repeating: 0, count: 1 << 20)
        page.replaceSubrange(0..<512, with: sb.encoded())
        var at = 0
        while at < JournalSuperblock.ringStart + ringSize {
            let n = min(page.count, JournalSuperblock.ringStart + ringSize - at)
            try page.withUnsafeBytes {
                try FullIO.pwriteFull(fd, UnsafeRawBufferPointer(rebasing: $0[0..<n]), offset: at)
            }
            if at == 0 { page.replaceSubrange(0..<512, with: [UInt8](repeating: 0, count: 512)) }
            at += n
        }
        guard Glibc.fsync(fd) == 0, rename(temp, path) == 0 else { throw KeybagError.system("create journal", errno) }
        let dir = Glibc.open(PathText.parent(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dir >= 0 {
            _ = Glibc.fsync(dir)
            close(dir)
        }
        return sb
    }

    /// A file's size, or -1.
    static func fileSize(_ path: String) -> Int {
        var st = stat()
        return lstat(path, &st) == 0 ? Int(st.st_size) : -1
    }
}
