import CSystem
import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `FuseChannel`'s read and write hooks on request and reply bytes built as the kernel and
/// libfuse lay them out (`fuse_in_header`, `fuse_init_in`, `fuse_out_header`,
/// `fuse_init_out`): FUSE_TMPFILE relabelled CREATE, the INIT reply given the bits the kernel
/// offered and no others, the per-request word on set-ID bits.
final class FuseChannelTests: XCTestCase {
    /// A request: the 40-byte header (`opcode`, `unique`) and `body`.
    func request(_ opcode: UInt32, unique: UInt64 = 9, _ body: [UInt8]) -> [UInt8] {
        var bytes = [UInt8](repeating: 0, count: FuseChannel.inHeaderSize) + body
        let length = UInt32(bytes.count)
        bytes.withUnsafeMutableBytes { p in
            p.storeBytes(of: length, toByteOffset: 0, as: UInt32.self)
            p.storeBytes(of: opcode, toByteOffset: 4, as: UInt32.self)
            p.storeBytes(of: unique, toByteOffset: 8, as: UInt64.self)
        }
        return bytes
    }

    /// `count` bytes of zero with 32-bit `words` at their offsets.
    func body(_ count: Int, _ words: [Int: UInt32]) -> [UInt8] {
        var b = [UInt8](repeating: 0, count: count)
        b.withUnsafeMutableBytes { p in
            for (off, w) in words { p.storeBytes(of: w, toByteOffset: off, as: UInt32.self) }
        }
        return b
    }

    /// Runs the read hook's noting on `bytes` (the first `count` of them, as read).
    @discardableResult
    func note(_ bytes: [UInt8], count: Int? = nil) -> [UInt8] {
        var b = bytes
        b.withUnsafeMutableBytes { FuseChannel.noteRequest($0.baseAddress!, count: count ?? $0.count) }
        return b
    }

    /// An INIT request (`fuse_init_in`: flags at 12, flags2 at 16; 64 bytes).
    func initRequest(unique: UInt64, flags: UInt32, flags2: UInt32) -> [UInt8] {
        request(FuseChannel.opcodeInit, unique: unique, body(64, [0: 7, 4: 38, 12: flags, 16: flags2]))
    }

    /// Passes a reply (`fuse_out_header` with `error`, then a 64-byte `fuse_init_out` with
    /// `flags` at 12 and `flags2` at 32) through the write hook's patching: whether it took
    /// the reply as INIT's, and the flag words after.
    func reply(unique: UInt64, error: Int32 = 0, flags: UInt32, flags2: UInt32) -> (Bool, UInt32, UInt32) {
        var head = [UInt8](repeating: 0, count: FuseChannel.outHeaderSize)
        head.withUnsafeMutableBytes { p in
            p.storeBytes(of: UInt32(16 + 64), toByteOffset: 0, as: UInt32.self)
            p.storeBytes(of: error, toByteOffset: 4, as: Int32.self)
            p.storeBytes(of: unique, toByteOffset: 8, as: UInt64.self)
        }
        var out = body(64, [12: flags, 32: flags2])
        let taken = head.withUnsafeMutableBytes { h in
            out.withUnsafeMutableBytes { o in
                var iov = [
                    iovec(iov_base: h.baseAddress, iov_len: h.count), iovec(iov_base: o.baseAddress, iov_len: o.count),
                ]
                return iov.withUnsafeMutableBufferPointer { FuseChannel.patchReply($0.baseAddress!) }
            }
        }
        return out.withUnsafeBytes {
            (taken, $0.load(fromByteOffset: 12, as: UInt32.self), $0.load(fromByteOffset: 32, as: UInt32.self))
        }
    }

    func testATmpfileRequestIsRelabelledACreateWithItsArgumentsIntact() {
        let args = body(16, [0: UInt32(O_RDWR), 4: 0o100600, 8: 0o022]) + Array("/\0".utf8)
        let seen = note(request(FuseChannel.opcodeTmpfile, args))
        XCTAssertEqual(seen.withUnsafeBytes { $0.load(fromByteOffset: 4, as: UInt32.self) }, FuseChannel.opcodeCreate)
        XCTAssertEqual(Array(seen[FuseChannel.inHeaderSize...]), args)
        XCTAssertEqual(String(decoding: seen.suffix(2).dropLast(), as: UTF8.self), FuseChannel.unnamedFileName)
        let mkdir = request(22, args)
        XCTAssertEqual(note(mkdir), mkdir, "other requests pass through untouched")
    }

    func testTheInitReplyGetsTheBitsTheKernelOfferedOnce() {
        let offered = FuseChannel.initExt | FuseChannel.killPrivV2 | FuseChannel.writebackCacheFlag
        note(initRequest(unique: 101, flags: offered, flags2: FuseChannel.allowMmap))
        XCTAssertEqual(
            reply(unique: 100, flags: FuseChannel.initExt, flags2: 0).0, false, "another request's reply is left alone")
        let (taken, flags, flags2) = reply(
            unique: 101, flags: FuseChannel.initExt | FuseChannel.writebackCacheFlag, flags2: 1)
        XCTAssertTrue(taken)
        XCTAssertEqual(flags, FuseChannel.initExt | FuseChannel.writebackCacheFlag | FuseChannel.killPrivV2)
        XCTAssertEqual(flags2, 1 | FuseChannel.allowMmap, "libfuse's own second-word bits are kept")
        XCTAssertEqual(FuseChannel.negotiated, MountNegotiation(directIOMappable: true, writeback: true))
        XCTAssertEqual(reply(unique: 101, flags: 0, flags2: 0).0, false, "a reply is patched once")
    }

    func testBitsTheKernelDidNotOfferAreNeverSet() {
        // No second flag word (no FUSE_INIT_EXT): its allow-mmap bit is not an offer.
        note(initRequest(unique: 202, flags: 0, flags2: FuseChannel.allowMmap))
        let (taken, flags, flags2) = reply(unique: 202, flags: FuseChannel.initExt, flags2: 0)
        XCTAssertTrue(taken)
        XCTAssertEqual(flags, FuseChannel.initExt)
        XCTAssertEqual(flags2, 0)
        // Offered, but the reply (libfuse) does not use the second word: it is not written.
        note(initRequest(unique: 203, flags: FuseChannel.initExt, flags2: FuseChannel.allowMmap))
        XCTAssertEqual(reply(unique: 203, flags: 0, flags2: 0).2, 0)
    }

    func testAFailedInitReplyIsLeftAlone() {
        note(
            initRequest(unique: 303, flags: FuseChannel.initExt | FuseChannel.killPrivV2, flags2: FuseChannel.allowMmap)
        )
        let (taken, flags, flags2) = reply(unique: 303, error: -EPROTO, flags: 0, flags2: 0)
        XCTAssertTrue(taken, "the INIT is answered: nothing is left pending")
        XCTAssertEqual([flags, flags2], [0, 0])
    }

    func testATruncatedInitRequestIsNotNoted() {
        note(initRequest(unique: 404, flags: FuseChannel.killPrivV2, flags2: 0), count: FuseChannel.inHeaderSize + 16)
        XCTAssertEqual(reply(unique: 404, flags: 0, flags2: 0).0, false)
    }

    /// Once INIT granted FUSE_HANDLE_KILLPRIV_V2, each request that carries the kernel's word
    /// on set-ID bits passes it to the thread handling it; others carry none (-1).
    func testEachRequestPassesOnTheKernelsWordOnSetIDBits() {
        note(initRequest(unique: 505, flags: FuseChannel.killPrivV2, flags2: 0))
        XCTAssertTrue(reply(unique: 505, flags: 0, flags2: 0).0)
        func word(_ opcode: UInt32, _ body: [UInt8], count: Int? = nil) -> Int32 {
            note(request(opcode, body), count: count.map { FuseChannel.inHeaderSize + $0 })
            return kbfs_request_kills_setid()
        }
        XCTAssertEqual(word(FuseChannel.opcodeWrite, body(40, [20: 1 << 2])), 1, "FUSE_WRITE_KILL_SUIDGID")
        XCTAssertEqual(word(FuseChannel.opcodeWrite, body(40, [20: 1 << 1])), 0)
        XCTAssertEqual(word(FuseChannel.opcodeSetattr, body(88, [0: 1 << 11])), 1, "FATTR_KILL_SUIDGID")
        XCTAssertEqual(word(FuseChannel.opcodeSetattr, body(88, [0: 1 << 3])), 0)
        XCTAssertEqual(word(FuseChannel.opcodeOpen, body(8, [4: 1])), 1, "FUSE_OPEN_KILL_SUIDGID")
        XCTAssertEqual(word(FuseChannel.opcodeCreate, body(16, [12: 1])), 1)
        XCTAssertEqual(word(FuseChannel.opcodeTmpfile, body(16, [12: 0])), 0, "a relabelled TMPFILE is a create")
        XCTAssertEqual(word(FuseChannel.opcodeWrite, body(40, [20: 1 << 2]), count: 20), 0, "a short request says keep")
        XCTAssertEqual(word(3, body(0, [:])), -1, "GETATTR carries no word")
    }
}
