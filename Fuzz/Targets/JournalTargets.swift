import CSodium
import CSystem
import Foundation
import Glibc
import KeybagCore

extension FuzzTarget {
    /// The overwrite journal (`STORE/.kbfs-journal-ID`). Its checksums are unkeyed (BLAKE2b of
    /// the superblock, CRC32C of each record, the session from the superblock's key): any
    /// store writer can make a journal that reads as whole, so the harness makes every
    /// checksum right, and the replay itself is what the fuzzer searches.
    static let journalTargets: [FuzzTarget] = [
        // The input is a program of records (`JournalProgram`) laid into a ring, or (first
        // byte odd) the journal file's raw bytes with the superblock's checksum made right;
        // then a replay into a copy of the seed store, as a mount runs it.
        FuzzTarget(name: "journal") { input in
            _ = JournalSuperblock.decode(input)
            input.withUnsafeBytes { b in
                _ = JournalRecord.statedLength(b)
                _ = JournalRecord.decode(b, seq: 1, key: [UInt8](repeating: 0, count: 32))
            }
            let store = SeedStore.shared.freshCopy()
            let path = store + "/" + JournalReplay.fileName(deviceID: SeedStore.shared.deviceID)
            if input.first.map({ $0 & 1 == 1 }) ?? true {
                put(JournalProgram.rawJournal(Array(input.dropFirst())), at: path)
                JournalProgram.extendToRing(path)
            } else {
                put([], at: path)
                JournalProgram(input, store: store, journalPath: path).write(to: path)
            }
            _ = try? JournalReplay.replay(storePath: store, deviceID: SeedStore.shared.deviceID) { _ in }
        }
    ]
}

/// A journal made from a fuzz input: a superblock (ring, tail, sequence) and records naming
/// the seed store's files (by their real identity, or a crafted one), laid out as the writer
/// lays them (wrapping at the ring's end), some torn or out of sequence.
struct JournalProgram {
    var superblock: JournalSuperblock
    var records: [(JournalRecord, tear: Bool)] = []

    /// The program `input` spells, for the files of the working copy `store`.
    init(_ input: [UInt8], store: String, journalPath: String) {
        var r = ByteReader(input.dropFirst())
        let ring = [4096, 8192, 65536][Int(r.byte()) % 3]
        superblock = JournalSuperblock.fresh(ringSize: ring, firstSeq: UInt64(r.byte()) + 1)
        superblock.tailPos = Int(r.u16()) * 16 % ring
        let fd = open(journalPath, O_RDONLY | O_CLOEXEC)
        var st = stat()
        if fd >= 0, fstat(fd, &st) == 0, r.byte() & 1 == 0 {
            superblock.journalIno = UInt64(st.st_ino)
            superblock.journalStamp = kbfs_inode_stamp(fd)
        }
        if fd >= 0 { close(fd) }
        let files = Self.identities(store)
        var seq = superblock.tailSeq
        while !r.atEnd && records.count < 64 {
            let op = r.byte()
            let kind = JournalRecord.Kind(rawValue: op % 5) ?? .bytes
            var id = files.isEmpty ? Self.crafted(&r) : files[Int(r.byte()) % files.count]
            if op & 0x80 != 0 { id = Self.crafted(&r) }
            let offset = Int(r.u16()) * (op & 0x40 != 0 ? 1 : 16) + (op & 0x20 != 0 ? 0 : FileHeader.size)
            let data = r.bytes(Int(r.u16()) % 9000)
            if op & 0x10 != 0 { seq += UInt64(r.byte()) }  // a gap: the journal ends there
            records.append((JournalRecord(kind: kind, seq: seq, file: id, offset: offset, bytes: data), op & 8 != 0))
            seq += 1
        }
    }

    /// The identities the seed store's files have in the working copy `store`.
    static func identities(_ store: String) -> [JournalFileID] {
        let folder = Keybag.dataDirName + "/" + SeedStore.shared.docsFolder
        return SeedStore.shared.regularFiles(in: folder).compactMap { name in
            let fd = open(store + "/" + folder + "/" + name, O_RDONLY | O_CLOEXEC)
            guard fd >= 0 else { return nil }
            defer { close(fd) }
            var st = stat()
            guard fstat(fd, &st) == 0, let h = try? HeaderSlots.read(fd: fd) else { return nil }
            return JournalFileID(
                ino: UInt64(st.st_ino), stamp: kbfs_inode_stamp(fd), fileID: h.current.fileID, path: folder + "/" + name
            )
        }
    }

    /// An identity from the input: any inode, stamp, file id and path.
    static func crafted(_ r: inout ByteReader) -> JournalFileID {
        let path = String(decoding: r.bytes(Int(r.byte()) % 80), as: UTF8.self)
        return JournalFileID(ino: UInt64(r.u16()), stamp: UInt64(r.byte()), fileID: r.bytes(16), path: path)
    }

    /// Writes the ring file: superblock, then the records from the tail on.
    func write(to path: String) {
        var file = [UInt8](repeating: 0, count: JournalSuperblock.ringStart + superblock.ringSize)
        file.replaceSubrange(0..<512, with: superblock.encoded())
        var at = superblock.tailPos
        for (rec, tear) in records {
            let n = JournalRecord.encodedLength(pathLength: rec.file.path.utf8.count, count: rec.bytes.count)
            guard n <= superblock.ringSize else { break }
            if at + n > superblock.ringSize {
                let wrap = JournalRecord(kind: .wrap, seq: rec.seq, file: rec.file)
                let w = JournalRecord.encodedLength(pathLength: rec.file.path.utf8.count, count: 0)
                if at + w <= superblock.ringSize { place(wrap, at: at, in: &file, tear: false) }
                at = 0
            }
            place(rec, at: at, in: &file, tear: tear)
            at = (at + n) % superblock.ringSize
        }
        put(file, at: path)
    }

    /// Encodes `rec` at ring position `at` (a torn one loses its last 16 bytes).
    private func place(_ rec: JournalRecord, at: Int, in file: inout [UInt8], tear: Bool) {
        let base = JournalSuperblock.ringStart + at
        let n = JournalRecord.encodedLength(pathLength: rec.file.path.utf8.count, count: rec.bytes.count)
        file.withUnsafeMutableBytes { f in
            _ = rec.encode(into: UnsafeMutableRawBufferPointer(rebasing: f[base..<(base + n)]), key: superblock.key)
            if tear { memset(f.baseAddress! + base + n - 16, 0x5a, 16) }
        }
    }

    /// Raw journal bytes with a right superblock checksum (a writer can compute it).
    static func rawJournal(_ raw: [UInt8]) -> [UInt8] {
        var b = raw
        guard b.count >= 96, Array(b[0..<4]) == JournalSuperblock.magic else { return b }
        let version = b.withUnsafeBytes { UInt32(littleEndian: $0.loadUnaligned(fromByteOffset: 4, as: UInt32.self)) }
        let summed = version == 1 ? 64 : 80
        var sum = [UInt8](repeating: 0, count: 16)
        _ = crypto_generichash(&sum, 16, Array(b[0..<summed]), UInt64(summed), nil, 0)
        b.replaceSubrange(summed..<(summed + 16), with: sum)
        return b
    }

    /// Grows the raw journal at `path` (sparse) to the ring its superblock states, within the
    /// readers' limit, so the replay reads its records rather than refusing a short file.
    static func extendToRing(_ path: String) {
        guard let d = try? StoreFileOpen.contents(path), let sb = JournalSuperblock.decode([UInt8](d)) else {
            return
        }
        truncate(path, off_t(max(d.count, JournalSuperblock.ringStart + sb.ringSize)))
    }
}

/// Reads a fuzz input front to back; past its end every read is zeros.
struct ByteReader {
    private var rest: ArraySlice<UInt8>
    init(_ bytes: ArraySlice<UInt8>) { rest = bytes }
    var atEnd: Bool { rest.isEmpty }
    /// The next byte.
    mutating func byte() -> UInt8 { rest.popFirst() ?? 0 }
    /// The next two bytes, little-endian.
    mutating func u16() -> UInt16 { UInt16(byte()) | UInt16(byte()) << 8 }
    /// The next `n` bytes (fewer at the end).
    mutating func bytes(_ n: Int) -> [UInt8] {
        let b = Array(rest.prefix(n))
        rest = rest.dropFirst(n)
        return b
    }
}
