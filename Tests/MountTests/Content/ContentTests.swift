import Foundation
import Glibc
import XCTest

/// File contents through the mount: any offset and size, holes, truncation, append,
/// O_TRUNC, open files renamed and unlinked, and what the store reveals.
final class ContentTests: XCTestCase {
    func testRandomWritesReadsAndTruncatesMatchAModel() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        var rng = SeededBytes(seed: 0x6b657962)
        for cls in ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"] {
            let p = m.path("model-\(cls)")
            let fd = sysOpen(p, O_RDWR | O_CREAT | O_EXCL)
            XCTAssertGreaterThanOrEqual(fd, 0)
            XCTAssertEqual(fsetXattr(fd, cls), 0, "class set before the first byte")
            var model: [UInt8] = []
            for step in 0..<300 {
                switch rng.int(0..<10) {
                case 0..<6:
                    let off = rng.int(0..<(model.count + 9000))
                    let data = rng.bytes(rng.int(1..<12000))
                    XCTAssertEqual(try sysPwrite(fd, data, off).get(), data.count)
                    if off > model.count { model += [UInt8](repeating: 0, count: off - model.count) }
                    let end = off + data.count
                    if end > model.count { model += [UInt8](repeating: 0, count: end - model.count) }
                    model.replaceSubrange(off..<end, with: data)
                case 6, 7:
                    let n = rng.int(0..<(model.count + 10000))
                    XCTAssertEqual(ftruncate(fd, off_t(n)), 0)
                    if n < model.count {
                        model.removeSubrange(n...)
                    } else {
                        model += [UInt8](repeating: 0, count: n - model.count)
                    }
                default:
                    let off = rng.int(0..<(model.count + 10))
                    let len = rng.int(0..<20000)
                    let want = off < model.count ? Array(model[off..<min(model.count, off + len)]) : []
                    XCTAssertEqual(try sysPread(fd, len, off).get(), want, "\(cls) step \(step) read \(off)+\(len)")
                }
                var st = stat()
                XCTAssertEqual(fstat(fd, &st), 0)
                XCTAssertEqual(Int(st.st_size), model.count, "\(cls) step \(step) size")
            }
            close(fd)
            XCTAssertEqual(try readFile(p).get(), model, "\(cls) whole file")
            XCTAssertEqual(try getXattr(p).get(), cls)
        }
        // Everything survives a remount (no state only in memory).
        try m.restart()
        m.unlock()
        for cls in ["none", "complete"] {
            var st = stat()
            XCTAssertEqual(stat(m.path("model-\(cls)"), &st), 0)
            XCTAssertEqual(try readFile(m.path("model-\(cls)")).get().count, Int(st.st_size))
        }
    }

    func testHolesAppendTruncAndOpenFileRenameUnlink() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        // A hole: write far past the end; the gap reads as zeros; size is exact.
        let fd = sysOpen(m.path("sparse"), O_RDWR | O_CREAT)
        XCTAssertEqual(try sysPwrite(fd, bytes("end"), 10_000_000).get(), 3)
        var st = stat()
        XCTAssertEqual(fstat(fd, &st), 0)
        XCTAssertEqual(st.st_size, 10_000_003)
        XCTAssertEqual(try sysPread(fd, 4, 5_000_000).get(), [0, 0, 0, 0])
        XCTAssertEqual(try sysPread(fd, 10, 9_999_998).get(), [0, 0] + bytes("end"))
        close(fd)
        var bst = stat()
        XCTAssertEqual(stat(m.backing("sparse"), &bst), 0)
        XCTAssertLessThan(Int(bst.st_blocks) * 512, 1_000_000, "the hole stays sparse in the store")

        // Append and O_TRUNC.
        XCTAssertEqual(writeFile(m.path("log"), bytes("one\n")), 0)
        let a = sysOpen(m.path("log"), O_WRONLY | O_APPEND)
        XCTAssertEqual(write(a, "two\n", 4), 4)
        XCTAssertEqual(write(a, "three\n", 6), 6)
        close(a)
        XCTAssertEqual(try readFile(m.path("log")).get(), bytes("one\ntwo\nthree\n"))
        let t = sysOpen(m.path("log"), O_WRONLY | O_TRUNC)
        XCTAssertEqual(write(t, "new", 3), 3)
        close(t)
        XCTAssertEqual(try readFile(m.path("log")).get(), bytes("new"))

        // Truncate up then down across block boundaries.
        XCTAssertEqual(writeFile(m.path("t"), [UInt8](repeating: 7, count: 5000)), 0)
        XCTAssertEqual(truncate(m.path("t"), 9000), 0)
        XCTAssertEqual(
            try readFile(m.path("t")).get(), [UInt8](repeating: 7, count: 5000) + [UInt8](repeating: 0, count: 4000))
        XCTAssertEqual(truncate(m.path("t"), 4097), 0)
        XCTAssertEqual(try readFile(m.path("t")).get(), [UInt8](repeating: 7, count: 4097))
        XCTAssertEqual(truncate(m.path("t"), 0), 0)
        XCTAssertEqual(try readFile(m.path("t")).get(), [])

        // An open file keeps working after rename and after unlink.
        XCTAssertEqual(writeFile(m.path("open"), bytes("still here")), 0)
        let o = sysOpen(m.path("open"), O_RDWR)
        XCTAssertEqual(rename(m.path("open"), m.path("renamed")), 0)
        XCTAssertEqual(try sysPread(o, 100, 0).get(), bytes("still here"))
        XCTAssertEqual(unlink(m.path("renamed")), 0)
        XCTAssertEqual(try sysPwrite(o, bytes("STILL"), 0).get(), 5)
        XCTAssertEqual(try sysPread(o, 100, 0).get(), bytes("STILL here"))
        close(o)

        // Hard links share content and class.
        XCTAssertEqual(writeFile(m.path("l1"), bytes("linked")), 0)
        XCTAssertEqual(link(m.path("l1"), m.path("l2")), 0)
        XCTAssertEqual(setXattr(m.path("l2"), "complete"), 0)
        XCTAssertEqual(try getXattr(m.path("l1")).get(), "complete")
        XCTAssertEqual(try readFile(m.path("l1")).get(), bytes("linked"))
        XCTAssertEqual(stat(m.path("l1"), &st), 0)
        XCTAssertEqual(st.st_nlink, 2)
    }

    /// Writes through a shared mapping reach the store by close (the daemon has no FLUSH;
    /// the kernel writes the pages back before closing): they survive a remount.
    func testSharedMappingWritesSurviveCloseAndRemount() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(writeFile(m.path("mapped"), [UInt8](repeating: 0, count: 10_000)), 0)
        let fd = sysOpen(m.path("mapped"), O_RDWR)
        XCTAssertGreaterThanOrEqual(fd, 0)
        let p = mmap(nil, 10_000, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        XCTAssertNotEqual(p, MAP_FAILED)
        let stamp = bytes("mapped-write")
        stamp.withUnsafeBytes { (p! + 5000).copyMemory(from: $0.baseAddress!, byteCount: stamp.count) }
        XCTAssertEqual(munmap(p, 10_000), 0)
        XCTAssertEqual(close(fd), 0)
        try m.restart()
        m.unlock()
        let back = try readFile(m.path("mapped")).get()
        XCTAssertEqual(back.count, 10_000)
        XCTAssertEqual(Array(back[5000..<(5000 + stamp.count)]), stamp)
    }

    /// The write-back cache (the default): a write() waits in the kernel's page cache and
    /// reaches the store at fsync(); with `--no-writeback-cache` it reaches the store at once.
    func testWritesReachTheStoreAtFsyncWithWritebackAndAtOnceWithout() throws {
        for writeback in [true, false] {
            let m = try MountFixture(mount: false)
            addTeardownBlock { m.close() }
            try m.mount(extra: writeback ? [] : ["--no-writeback-cache"])
            m.unlock()
            let fd = sysOpen(m.path("doc"), O_RDWR | O_CREAT | O_EXCL)
            XCTAssertGreaterThanOrEqual(fd, 0)
            let backing = m.backing("doc")
            func storeSize() -> Int { var st = stat(); return stat(backing, &st) == 0 ? Int(st.st_size) : -1 }
            let empty = storeSize()
            var rng = SeededBytes(seed: 7)
            let data = rng.bytes(64 * 1024 + 100)
            XCTAssertEqual(try sysPwrite(fd, data, 0).get(), data.count)
            let afterWrite = storeSize()
            XCTAssertEqual(fsync(fd), 0)
            let afterSync = storeSize()
            XCTAssertGreaterThan(
                afterSync, empty + data.count, "writeback \(writeback): the store holds the data after fsync")
            if writeback {
                XCTAssertEqual(afterWrite, empty, "with the write-back cache, write() alone leaves the store as it was")
            } else {
                XCTAssertEqual(afterWrite, afterSync, "without it, write() itself reaches the store")
            }
            XCTAssertEqual(try sysPread(fd, data.count, 0).get(), data)
            XCTAssertEqual(close(fd), 0)
            m.unmount()
            try m.mount()
            m.unlock()
            XCTAssertEqual(try readFile(m.path("doc")).get(), data, "writeback \(writeback): the bytes after a remount")
        }
    }

    /// A full store with the write-back cache: `fsync()` reports it (and `write()` once a
    /// write-back has failed), and files written before stay intact.
    func testFullStoreFailsFsyncAndLosesNothingElse() throws {
        let m = try mountedSmallStore("3m")
        var rng = SeededBytes(seed: 5)
        let kept = rng.bytes(200_000)
        XCTAssertEqual(writeFile(m.path("kept"), kept), 0)
        let fd = sysOpen(m.path("big"), O_RDWR | O_CREAT | O_EXCL)
        XCTAssertGreaterThanOrEqual(fd, 0)
        let chunk = rng.bytes(1 << 20)
        // write() lands in the page cache until a write-back has failed for want of space;
        // from then on write() itself reports the full store (XfstestsRegressionTests).
        var refused = false
        for i in 0..<4 {
            let r = sysPwrite(fd, chunk, i << 20)
            if errnoOf(r) == ENOSPC { refused = true; break }
            XCTAssertEqual(try r.get(), chunk.count, "write() \(i)")
        }
        XCTAssertEqual(fsync(fd), -1, "fsync reports the full store (write() refused: \(refused))")
        XCTAssertEqual(errno, ENOSPC)
        close(fd)
        let big = readFile(m.path("big"))
        XCTAssertEqual(errnoOf(big), 0, "the file that filled the store reads without EIO (no torn block)")
        // The kernel writes back several 1 MiB requests at once, so the one refused for want of
        // space need not be the last: every block reads as written there, or as zeros where
        // the write-back was refused (a hole), never as other bytes.
        if let b = try? big.get() {
            let written = (0..<4).flatMap { _ in chunk }
            var foreign: [Int] = []
            for start in stride(from: 0, to: b.count, by: 4096) {
                let got = b[start..<min(start + 4096, b.count)]
                if !got.elementsEqual(written[start..<(start + got.count)]) && got.contains(where: { $0 != 0 }) {
                    foreign.append(start)
                }
            }
            XCTAssertEqual(
                foreign.count, 0, "blocks that are neither what was written nor a hole, first at \(foreign.first ?? -1)"
            )
        }
        XCTAssertEqual(try readFile(m.path("kept")).get(), kept, "the file written before is intact")
        XCTAssertEqual(unlink(m.path("big")), 0)
        XCTAssertEqual(writeFile(m.path("after"), kept), 0, "space freed: writes work again")
        m.unmount()
        try m.mount()
        m.unlock()
        XCTAssertEqual(try readFile(m.path("kept")).get(), kept)
        XCTAssertEqual(try readFile(m.path("after")).get(), kept)
    }

    func testStoreRevealsNoKnownPlaintext() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let marker = "KEYBAGFS-KNOWN-PLAINTEXT-MARKER"
        let text = String(repeating: marker + " ", count: 2000)
        for cls in ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete"] {
            let fd = sysOpen(m.path("doc-\(cls)"), O_RDWR | O_CREAT)
            XCTAssertEqual(fsetXattr(fd, cls), 0)
            XCTAssertEqual(try sysPwrite(fd, bytes(text), 0).get(), text.utf8.count)
            close(fd)
        }
        let docNone = m.backing("doc-none")
        m.unmount()
        var found: [String] = []
        let e = FileManager.default.enumerator(atPath: m.store)!
        while let rel = e.nextObject() as? String {
            let full = m.store + "/" + rel
            guard let d = FileManager.default.contents(atPath: full) else { continue }
            if d.range(of: Data(marker.utf8)) != nil { found.append(rel) }
            if d.range(of: Data(m.passcode.utf8)) != nil { found.append(rel + " (passcode)") }
        }
        XCTAssertEqual(found, [], "plaintext in the store")
        // Sizes: header plus per-block overhead, not plaintext sizes.
        var st = stat()
        XCTAssertEqual(stat(docNone, &st), 0)
        XCTAssertGreaterThan(Int(st.st_size), text.utf8.count)
    }

    func testTamperedStoreReadsAsEIO() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        var rng = SeededBytes(seed: 42)
        let a = rng.bytes(3 * 4096), b = rng.bytes(3 * 4096)
        XCTAssertEqual(writeFile(m.path("a"), a), 0)
        XCTAssertEqual(writeFile(m.path("b"), b), 0)
        XCTAssertEqual(writeFile(m.path("c"), a), 0)
        let (pa, pb, pc) = (m.backing("a"), m.backing("b"), m.backing("c"))
        m.unmount()
        let header = 320
        let cblock = (try? Data(contentsOf: URL(fileURLWithPath: pa)).count).map { ($0 - header) / 3 } ?? 0
        XCTAssertGreaterThan(cblock, 4096)
        // a: one flipped bit in block 1. b: blocks 0 and 2 swapped. c: last block cut short.
        var da = try Data(contentsOf: URL(fileURLWithPath: pa))
        da[header + cblock + 100] ^= 0x01
        try da.write(to: URL(fileURLWithPath: pa))
        var db = try Data(contentsOf: URL(fileURLWithPath: pb))
        let b0 = db[(header)..<(header + cblock)], b2 = db[(header + 2 * cblock)..<(header + 3 * cblock)]
        db.replaceSubrange((header + 2 * cblock)..<(header + 3 * cblock), with: b0)
        db.replaceSubrange(header..<(header + cblock), with: b2)
        try db.write(to: URL(fileURLWithPath: pb))
        XCTAssertEqual(Glibc.truncate(pc, off_t(header + 3 * cblock - 10)), 0)
        try m.mount()
        m.unlock()
        let fa = sysOpen(m.path("a"), O_RDONLY)
        XCTAssertEqual(try sysPread(fa, 4096, 0).get(), Array(a[0..<4096]), "untouched block still reads")
        XCTAssertEqual(errnoOf(sysPread(fa, 4096, 4096)), EIO)
        close(fa)
        XCTAssertEqual(errnoOf(readFile(m.path("b"))), EIO)
        let fc = sysOpen(m.path("c"), O_RDONLY)
        XCTAssertEqual(errnoOf(sysPread(fc, 4096, 8192)), EIO)
        close(fc)
        // A header from another file: the file key no longer matches the blocks.
        m.unmount()
        var hb = try Data(contentsOf: URL(fileURLWithPath: pb))
        let ha = try Data(contentsOf: URL(fileURLWithPath: pa))
        hb.replaceSubrange(0..<header, with: ha[0..<header])
        try hb.write(to: URL(fileURLWithPath: pb))
        try m.mount()
        m.unlock()
        XCTAssertEqual(errnoOf(readFile(m.path("b"))), EIO)
        // The daemon is still serving.
        XCTAssertEqual(writeFile(m.path("ok"), bytes("fine")), 0)
        XCTAssertEqual(try readFile(m.path("ok")).get(), bytes("fine"))
    }
}
