import CSodium
import Foundation
import Glibc
import Synchronization
import XCTest

@testable import KeybagCore

/// The content format and the file header on real temporary files, without FUSE.
final class FormatTests: TempDirTestCase {
    func newFile(_ name: String, cipher: ContentCipher, cls: ProtectionClass = .none) throws -> (
        Int32, FileContentKey, FileHeader, SecureKey
    ) {
        let fd = open(dir + "/" + name, O_RDWR | O_CREAT | O_TRUNC, 0o600)
        XCTAssertGreaterThanOrEqual(fd, 0)
        let classKey = SecureKey(random: 32)
        let raw = SecureKey(random: 32)
        let h = try FileHeader.create(fileKey: raw, class: cls, cipher: cipher, using: .symmetric(classKey))
        try HeaderSlots.writeNew(fd: fd, h)
        return (fd, try FileContentKey(key: raw, header: h), h, classKey)
    }

    func testLayoutSizesRoundTrip() {
        for cipher in ContentCipher.allCases {
            let l = BlockLayout(cipher: cipher)
            for size in [0, 1, 4095, 4096, 4097, 8192, 1_000_000, 12_345_678] {
                XCTAssertEqual(l.plainSize(backingSize: l.backingSize(plainSize: size)), size, "\(cipher) \(size)")
            }
            XCTAssertEqual(
                l.plainSize(backingSize: FileHeader.size + l.overhead), 0, "a fragment without payload is ignored")
        }
    }

    func testRandomIOMatchesModelForBothCiphers() throws {
        for cipher in ContentCipher.allCases where cipher.isAvailable {
            for sealsEnd in [true, false] {
                let (fd, sealedKey, _, _) = try newFile("model-\(cipher.name)-\(sealsEnd)", cipher: cipher)
                defer { close(fd) }
                // Files written before the end was sealed (header flags 0) must keep working.
                let key =
                    sealsEnd
                    ? sealedKey
                    : try FileContentKey(key: sealedKey.key, cipher: cipher, fileID: sealedKey.fileID, sealsEnd: false)
                let c = EncryptedContent(layout: BlockLayout(cipher: cipher))
                var model: [UInt8] = []
                var seed: UInt64 = 0x1234_5678
                func rnd(_ n: Int) -> Int {
                    seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17; return Int(seed % UInt64(max(n, 1)))
                }
                for _ in 0..<400 {
                    if rnd(4) == 0 {
                        let n = rnd(model.count + 9000)
                        try c.truncate(fd: fd, key: key, to: n)
                        if n < model.count {
                            model.removeSubrange(n...)
                        } else {
                            model += [UInt8](repeating: 0, count: n - model.count)
                        }
                    } else {
                        let off = rnd(model.count + 9000)
                        let data = (0..<(1 + rnd(10000))).map { _ in UInt8(truncatingIfNeeded: rnd(256)) }
                        try data.withUnsafeBytes { try c.write(fd: fd, key: key, offset: off, data: $0) }
                        if off + data.count > model.count {
                            model += [UInt8](repeating: 0, count: off + data.count - model.count)
                        }
                        model.replaceSubrange(off..<(off + data.count), with: data)
                    }
                    XCTAssertEqual(try c.plainSize(fd: fd), model.count)
                }
                var out = [UInt8](repeating: 0, count: model.count + 100)
                let n = try out.withUnsafeMutableBytes { try c.read(fd: fd, key: key, offset: 0, into: $0) }
                XCTAssertEqual(Array(out[0..<n]), model, "\(cipher.name) sealsEnd \(sealsEnd)")
            }
        }
    }

    /// Reads and writes of 64 blocks or more run in two halves on two threads: at unaligned
    /// offsets, across holes, past the end and over damage in either half they match the model.
    func testLargeReadsAndWritesSplitOverTwoThreadsMatchTheModel() throws {
        XCTAssertEqual(EncryptedContent.parallelBlocks, 64)
        for cipher in ContentCipher.allCases where cipher.isAvailable {
            let (fd, key, _, _) = try newFile("split-\(cipher.name)", cipher: cipher)
            defer { close(fd) }
            let c = EncryptedContent(layout: BlockLayout(cipher: cipher))
            var seed: UInt64 = 0x5eed
            func rnd(_ n: Int) -> Int {
                seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17; return Int(seed % UInt64(max(n, 1)))
            }
            var model = (0..<(700 * 1024 + 123)).map { _ in UInt8(truncatingIfNeeded: rnd(256)) }
            try model.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 0, data: $0) }
            // Block-sized appends (marked blocks inside the file) and a hole, then a tail.
            for _ in 0..<3 {
                let block = (0..<4096).map { _ in UInt8(truncatingIfNeeded: rnd(256)) }
                try block.withUnsafeBytes { try c.write(fd: fd, key: key, offset: model.count, data: $0) }
                model += block
            }
            let tail = (0..<5000).map { _ in UInt8(truncatingIfNeeded: rnd(256)) }
            let tailAt = model.count + 300 * 1024
            try tail.withUnsafeBytes { try c.write(fd: fd, key: key, offset: tailAt, data: $0) }
            model += [UInt8](repeating: 0, count: tailAt - model.count) + tail
            XCTAssertEqual(try c.plainSize(fd: fd), model.count)
            // Large overwrites and extensions at unaligned offsets (the sealing split).
            for _ in 0..<20 {
                let off = rnd(model.count + 200_000)
                let data = (0..<(256 * 1024 + rnd(800 * 1024))).map { _ in UInt8(truncatingIfNeeded: rnd(256)) }
                try data.withUnsafeBytes { try c.write(fd: fd, key: key, offset: off, data: $0) }
                if off + data.count > model.count {
                    model += [UInt8](repeating: 0, count: off + data.count - model.count)
                }
                model.replaceSubrange(off..<(off + data.count), with: data)
                XCTAssertEqual(try c.plainSize(fd: fd), model.count)
            }
            for _ in 0..<60 {
                let off = rnd(model.count)
                let len = 256 * 1024 + rnd(800 * 1024)
                var out = [UInt8](repeating: 0xEE, count: len)
                let n = try out.withUnsafeMutableBytes { try c.read(fd: fd, key: key, offset: off, into: $0) }
                XCTAssertEqual(n, min(len, model.count - off), "\(cipher.name) read \(len) at \(off)")
                XCTAssertEqual(Array(out[0..<n]), Array(model[off..<(off + n)]), "\(cipher.name) read \(len) at \(off)")
            }
            // One flipped byte in a block of either half fails the whole read.
            let full = backing(fd)
            for block in [3, 150] {
                var bad = full
                bad[FileHeader.size + block * c.layout.cipherBlockSize + 40] ^= 1
                setBacking(fd, bad)
                var out = [UInt8](repeating: 0, count: 1 << 20)
                XCTAssertThrowsError(
                    try out.withUnsafeMutableBytes { try c.read(fd: fd, key: key, offset: 0, into: $0) },
                    "\(cipher.name): damage in block \(block)")
            }
            setBacking(fd, full)
        }
    }

    /// Reads the whole file, mapping errors to a label.
    func readAll(_ fd: Int32, _ key: FileContentKey, _ c: EncryptedContent) -> String {
        var out = [UInt8](repeating: 0, count: 100_000)
        do {
            _ = try out.withUnsafeMutableBytes { try c.read(fd: fd, key: key, offset: 0, into: $0) }; return "ok"
        } catch KeybagError.corrupt { return "corrupt" } catch { return "\(error)" }
    }

    func testEveryTamperOfABlockIsAnError() throws {
        let cipher = ContentCipher.default
        let c = EncryptedContent(layout: BlockLayout(cipher: cipher))
        let (fd, key, _, _) = try newFile("t", cipher: cipher)
        defer { close(fd) }
        let data = [UInt8](repeating: 0x5a, count: 3 * 4096 + 100)
        try data.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 0, data: $0) }
        XCTAssertEqual(readAll(fd, key, c), "ok")
        var original = [UInt8](repeating: 0, count: Int(lseek(fd, 0, SEEK_END)))
        _ = pread(fd, &original, original.count, 0)
        // Every byte of the content region, flipped one at a time (sampled every 7 bytes).
        for pos in stride(from: FileHeader.size, to: original.count, by: 7) {
            var b = original[pos] ^ 0x80
            _ = pwrite(fd, &b, 1, off_t(pos))
            XCTAssertEqual(readAll(fd, key, c), "corrupt", "flip at \(pos)")
            b = original[pos]
            _ = pwrite(fd, &b, 1, off_t(pos))
        }
        XCTAssertEqual(readAll(fd, key, c), "ok")
        // Blocks swapped within the file.
        let cb = BlockLayout(cipher: cipher).cipherBlockSize
        var swapped = original
        swapped.replaceSubrange(
            (FileHeader.size)..<(FileHeader.size + cb),
            with: original[(FileHeader.size + cb)..<(FileHeader.size + 2 * cb)])
        swapped.replaceSubrange(
            (FileHeader.size + cb)..<(FileHeader.size + 2 * cb),
            with: original[(FileHeader.size)..<(FileHeader.size + cb)])
        _ = pwrite(fd, swapped, swapped.count, 0)
        XCTAssertEqual(readAll(fd, key, c), "corrupt")
        // A block from another file with the same key but another file id.
        let other = try FileContentKey(key: key.key, cipher: cipher, fileID: Sodium.randomArray(16), sealsEnd: true)
        _ = pwrite(fd, original, original.count, 0)
        XCTAssertEqual(readAll(fd, other, c), "corrupt")
        // A truncated last block.
        XCTAssertEqual(ftruncate(fd, off_t(original.count - 5)), 0)
        var out = [UInt8](repeating: 0, count: 200)
        XCTAssertThrowsError(
            try out.withUnsafeMutableBytes { try c.read(fd: fd, key: key, offset: 3 * 4096, into: $0) })
    }

    /// Backing bytes of a file.
    func backing(_ fd: Int32) -> [UInt8] {
        var b = [UInt8](repeating: 0, count: Int(lseek(fd, 0, SEEK_END)))
        _ = pread(fd, &b, b.count, 0)
        return b
    }

    /// Replaces a file's backing bytes.
    func setBacking(_ fd: Int32, _ b: [UInt8]) {
        XCTAssertEqual(ftruncate(fd, 0), 0)
        XCTAssertEqual(pwrite(fd, b, b.count, 0), b.count)
    }

    func testTheEndOfAFileIsAuthenticated() throws {
        for cipher in ContentCipher.allCases where cipher.isAvailable {
            let c = EncryptedContent(layout: BlockLayout(cipher: cipher))
            let cb = c.layout.cipherBlockSize
            let (fd, key, _, _) = try newFile("end-\(cipher.name)", cipher: cipher)
            defer { close(fd) }
            let data = (0..<21_480).map { UInt8(truncatingIfNeeded: $0 * 7 + 3) }
            try data.withUnsafeBytes { try c.write(fd: fd, key: key, offset: 0, data: $0) }
            let full = backing(fd)
            XCTAssertEqual(readAll(fd, key, c), "ok")
            // Cut at each block boundary: the new last block was not sealed as the end.
            for blocks in 1...5 {
                setBacking(fd, Array(full[0..<(FileHeader.size + blocks * cb)]))
                XCTAssertEqual(try c.plainSize(fd: fd), blocks * 4096)
                XCTAssertEqual(readAll(fd, key, c), "corrupt", "\(cipher.name): cut after \(blocks) blocks")
            }
            // Whole blocks appended: zeros (a hole cannot be the end), or a copy of the last one.
            setBacking(fd, full + [UInt8](repeating: 0, count: cb))
            XCTAssertEqual(readAll(fd, key, c), "corrupt", "zero block appended")
            setBacking(fd, full + Array(full[(FileHeader.size + 5 * cb)...]))
            XCTAssertEqual(readAll(fd, key, c), "corrupt", "last block appended again")
            // An older, longer version's tail after a shrink: the shrunk end was sealed as the end.
            setBacking(fd, full)
            try c.truncate(fd: fd, key: key, to: 8192)
            XCTAssertEqual(readAll(fd, key, c), "ok")
            setBacking(fd, backing(fd) + Array(full[(FileHeader.size + 2 * cb)..<(FileHeader.size + 3 * cb)]))
            XCTAssertEqual(readAll(fd, key, c), "corrupt", "an old block 2 put back after a shrink")
            // The last block zeroed is damage, not a hole.
            setBacking(fd, full)
            var zeroed = full
            zeroed.replaceSubrange(
                (FileHeader.size + 5 * cb)..<full.count,
                with: [UInt8](repeating: 0, count: full.count - FileHeader.size - 5 * cb))
            setBacking(fd, zeroed)
            XCTAssertEqual(readAll(fd, key, c), "corrupt", "zeroed last block")
            // A hole inside the file still reads as zeros, and a write past the end keeps the gap sparse.
            setBacking(fd, full)
            try [UInt8](repeating: 9, count: 10).withUnsafeBytes {
                try c.write(fd: fd, key: key, offset: 100_000, data: $0)
            }
            var st = stat()
            fstat(fd, &st)
            XCTAssertLessThan(Int(st.st_blocks) * 512, 60_000, "the gap stays a hole")
            var out = [UInt8](repeating: 1, count: 100_010)
            let n = try out.withUnsafeMutableBytes { try c.read(fd: fd, key: key, offset: 0, into: $0) }
            XCTAssertEqual(n, 100_010)
            XCTAssertEqual(Array(out[0..<data.count]), data)
            XCTAssertTrue(out[data.count..<100_000].allSatisfy { $0 == 0 })
            XCTAssertEqual(Array(out[100_000...]), [UInt8](repeating: 9, count: 10))
        }
    }

    func testAFileWithoutASealedEndStillReads() throws {
        // Files written before the format sealed the end (header flags 0) read as before.
        let cipher = ContentCipher.default
        let c = EncryptedContent(layout: BlockLayout(cipher: cipher))
        let fd = open(dir + "/legacy", O_RDWR | O_CREAT | O_TRUNC, 0o600)
        defer { close(fd) }
        let sym = SecureKey(random: 32), raw = SecureKey(random: 32)
        var h = try FileHeader.create(fileKey: raw, class: .none, cipher: cipher, using: .symmetric(sym))
        h.flags = 0
        h = try h.rewrapped(fileKey: raw, to: .none, using: .symmetric(sym))
        try HeaderSlots.writeNew(fd: fd, h)
        let parsed = try HeaderSlots.current(fd: fd)
        XCTAssertFalse(parsed.endIsSealed)
        let key = try FileContentKey(key: try parsed.unwrap(using: .symmetric(sym)), header: parsed)
        try [UInt8](repeating: 4, count: 9000).withUnsafeBytes { try c.write(fd: fd, key: key, offset: 0, data: $0) }
        XCTAssertEqual(readAll(fd, key, c), "ok")
    }

    func testHeaderRoundTripForEveryClassAndTamper() throws {
        let sym = SecureKey(random: 32)
        let bSecret = SecureKey(random: 32)
        let bPublic = try ClassBAgreement.publicKey(of: bSecret)
        for cls in ProtectionClass.allCases {
            let raw = SecureKey(random: 32)
            let wrap: FileHeader.ClassKey = cls == .completeUnlessOpen ? .classBPublic(bPublic) : .symmetric(sym)
            let unwrap: FileHeader.ClassKey =
                cls == .completeUnlessOpen ? .classBPrivate(bSecret, bPublic) : .symmetric(sym)
            let h = try FileHeader.create(fileKey: raw, class: cls, cipher: .xchacha20poly1305, using: wrap)
            var bytes = h.encodeSlot() + [UInt8](repeating: 0, count: FileHeader.slotSize)
            let parsed = try FileHeader.parse(bytes)
            XCTAssertEqual(parsed, h)
            let got = try parsed.unwrap(using: unwrap)
            XCTAssertTrue(try raw.withBytes { a in try got.withBytes { b in Array(a) == Array(b) } })
            if cls == .completeUnlessOpen {
                XCTAssertThrowsError(try parsed.unwrap(using: .classBPublic(bPublic)), "public key cannot unwrap") {
                    e in
                    XCTAssertEqual(e as? KeybagError, .keyUnavailable)
                }
            }
            // A flipped bit anywhere in the slot body: the slot is rejected (checksum),
            // and a slot with a valid checksum but another class fails the key wrap.
            for pos in 0..<FileHeader.slotSize {
                bytes[pos] ^= 0x04
                XCTAssertThrowsError(try FileHeader.parse(bytes), "flip at \(pos)")
                bytes[pos] ^= 0x04
            }
            var forged = parsed
            forged.protectionClass = cls == .none ? .complete : .none
            XCTAssertThrowsError(
                try FileHeader.parse(forged.encodeSlot() + [UInt8](repeating: 0, count: 160)).unwrap(
                    using: .symmetric(sym)))
        }
    }

    func testHeaderBytesAreAuthenticatedEvenWithARecomputedChecksum() throws {
        // The checksum is unkeyed: an editor can recompute it. Bytes 10 and 11 must still
        // count, through the key wrap's associated data or the parser.
        let sym = SecureKey(random: 32), raw = SecureKey(random: 32)
        let h = try FileHeader.create(
            fileKey: raw, class: .completeUntilFirstUserAuthentication, cipher: .default, using: .symmetric(sym))
        for (pos, value) in [(10, UInt8(0)), (10, 2), (11, 1), (150, 1)] {
            var slot = h.encodeSlot()
            slot[pos] = value
            var sum = [UInt8](repeating: 0, count: 16)
            crypto_generichash(&sum, 16, slot, UInt64(FileHeader.bodySize), nil, 0)
            slot.replaceSubrange(FileHeader.bodySize..<(FileHeader.bodySize + 16), with: sum)
            let edited = slot + [UInt8](repeating: 0, count: FileHeader.slotSize)
            XCTAssertThrowsError(
                try FileHeader.parse(edited).unwrap(using: .symmetric(sym)), "byte \(pos) = \(value) accepted")
        }
    }

    func testHeaderSlotsNeverFallBackToAnOlderClass() throws {
        let a = SecureKey(random: 32), d = SecureKey(random: 32)
        let raw = SecureKey(random: 32)
        let empty = [UInt8](repeating: 0, count: FileHeader.slotSize)
        let h1 = try FileHeader.create(fileKey: raw, class: .none, cipher: .aes256gcm, using: .symmetric(d))
        let h2 = try h1.rewrapped(fileKey: raw, to: .complete, using: .symmetric(a))
        XCTAssertEqual(h2.slot, 1)
        XCTAssertEqual(h2.generation, 2)
        // A finished change: the new slot and an erased one.
        XCTAssertEqual(try FileHeader.parseSlots(empty + h2.encodeSlot()).current.protectionClass, .complete)
        XCTAssertNil(try FileHeader.parseSlots(empty + h2.encodeSlot()).superseded)
        // Cut off between the two writes: the newer wins, the older is named for erasure.
        let both = try FileHeader.parseSlots(h1.encodeSlot() + h2.encodeSlot())
        XCTAssertEqual(both.current.protectionClass, .complete)
        XCTAssertEqual(both.superseded, 0)
        // A damaged newest slot is corrupt: never the class D wrap beside it.
        for cut in [1, 10, 60, 100, 131, 140, 147] {
            var bad = h2.encodeSlot()
            bad[cut] ^= 0x01
            XCTAssertThrowsError(try FileHeader.parse(h1.encodeSlot() + bad), "byte \(cut)") {
                guard case KeybagError.corrupt = $0 else { return XCTFail("\($0)") }
            }
            let torn = Array(h2.encodeSlot()[0..<cut]) + [UInt8](repeating: 0, count: FileHeader.slotSize - cut)
            // A tear whose lost bytes were zero anyway (the checksum's last byte is 0 in one
            // header of 256) lost nothing: that slot is whole and must read as such.
            if torn == h2.encodeSlot() {
                XCTAssertEqual(try FileHeader.parse(h1.encodeSlot() + torn).protectionClass, .complete)
                continue
            }
            XCTAssertThrowsError(try FileHeader.parse(h1.encodeSlot() + torn), "torn at \(cut)")
        }
        XCTAssertThrowsError(try FileHeader.parse(empty + empty), "no slot at all")
        XCTAssertThrowsError(try FileHeader.parse(h2.encodeSlot() + h2.encodeSlot()), "two slots of one generation")
        // The next change goes to slot 0 again, above generation 2.
        let h3 = try h2.rewrapped(fileKey: raw, to: .none, using: .symmetric(d))
        XCTAssertEqual(h3.slot, 0)
        XCTAssertEqual(try FileHeader.parse(h3.encodeSlot() + empty).protectionClass, ProtectionClass.none)
    }

    func testWipedKeyRefusesUse() throws {
        let k = SecureKey(random: 32)
        XCTAssertFalse(k.isWiped)
        k.wipe()
        XCTAssertTrue(k.isWiped)
        XCTAssertThrowsError(try k.withBytes { _ in 0 }) { XCTAssertEqual($0 as? KeybagError, .keyUnavailable) }
        let raw = SecureKey(random: 32)
        let fk = try FileContentKey(key: raw, cipher: .default, fileID: Sodium.randomArray(16), sealsEnd: true)
        fk.wipe()
        var out = [UInt8](repeating: 0, count: 100)
        let plain = [UInt8](repeating: 1, count: 10)
        XCTAssertThrowsError(
            try plain.withUnsafeBytes { p in
                try out.withUnsafeMutableBytes { try fk.seal(p, block: 0, last: true, into: $0) }
            })
    }

    /// Nonces come from a per-thread stream (no getrandom per block): every sealed block of
    /// two threads sealing the same plaintext under one key carries a nonce of its own, the
    /// nonce bytes look uniform (XAES-256-GCM: each batch's start), and a stream's state never
    /// hands out the same bytes twice.
    func testBlockNoncesNeverRepeatAcrossSealsAndThreads() throws {
        for cipher in ContentCipher.allCases where cipher.isAvailable {
            let key = try FileContentKey(
                key: SecureKey(random: 32), cipher: cipher, fileID: Sodium.randomArray(16), sealsEnd: true)
            let ns = cipher.nonceSize
            let perThread = 30_000
            let nonces = Mutex<[[UInt8]]>([])
            let plain = [UInt8](repeating: 7, count: 4096)
            DispatchQueue.concurrentPerform(iterations: 2) { _ in
                var mine: [[UInt8]] = []
                var out = [UInt8](repeating: 0, count: 4096 + ns + 16)
                for b in 0..<perThread {
                    plain.withUnsafeBytes { p in
                        out.withUnsafeMutableBytes { o in try! key.seal(p, block: UInt64(b), last: false, into: o) }
                    }
                    mine.append(Array(out[0..<ns]))
                }
                nonces.withLock { $0 += mine }
            }
            let all = nonces.withLock { $0 }
            XCTAssertEqual(all.count, 2 * perThread)
            XCTAssertEqual(Set(all).count, all.count, "\(cipher): a nonce repeated")
            if cipher == .xaes256gcm {
                // A context's blocks under one key share a random prefix and count the suffix
                // up (CipherTests): one batch per context here, each suffix run consecutive.
                let batches = Dictionary(grouping: all) { Array($0[0..<20]) }
                XCTAssertLessThanOrEqual(batches.count, 4, "one batch per context")
                for run in batches.values {
                    let lows = run.map { $0[20..<24].reduce(UInt32(0)) { $0 << 8 | UInt32($1) } }.sorted()
                    XCTAssertEqual(lows.last! &- lows.first!, UInt32(run.count - 1), "consecutive suffixes")
                }
                continue  // the stream's own bits are checked through the other ciphers
            }
            // Each bit position is set in about half of the nonces (a stuck or zero stream fails).
            for bit in 0..<(ns * 8) {
                let ones = all.reduce(0) { $0 + Int(($1[bit / 8] >> (bit % 8)) & 1) }
                XCTAssertEqual(Double(ones) / Double(all.count), 0.5, accuracy: 0.02, "\(cipher) nonce bit \(bit)")
            }
            // Every block still opens.
            var out = [UInt8](repeating: 0, count: 4096 + ns + 16)
            var back = [UInt8](repeating: 0, count: 4096)
            try plain.withUnsafeBytes { p in
                try out.withUnsafeMutableBytes { o in try key.seal(p, block: 9, last: false, into: o) }
            }
            XCTAssertEqual(
                try out.withUnsafeBytes { o in
                    try back.withUnsafeMutableBytes { try key.open(o, block: 9, last: false, into: $0) }
                }, 4096)
            XCTAssertEqual(back, plain)
        }
    }
}
