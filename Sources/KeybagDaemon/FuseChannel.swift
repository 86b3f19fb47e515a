import CFuse
import Glibc
import Synchronization

/// The session's reads and writes of /dev/fuse, installed through libfuse's custom I/O
/// hooks for one purpose: libfuse 3.14 cannot ask the kernel for FUSE_DIRECT_IO_ALLOW_MMAP
/// (kernel 6.6+, a bit in the INIT reply's second flag word), which lets handles opened
/// with direct I/O (class A) still be mapped shared. The hooks note the INIT request, set
/// the bit in its reply when the kernel offered it, and pass every other buffer through.
enum FuseChannel {
    /// FUSE_INIT's opcode.
    static let opcodeInit: UInt32 = 26
    /// FUSE_INIT_EXT: the second flag word is present.
    static let initExt: UInt32 = 1 << 30
    /// FUSE_DIRECT_IO_ALLOW_MMAP (flag bit 36) as a bit of the second word.
    static let allowMmap: UInt32 = 1 << 4
    /// Bytes of `fuse_in_header` / `fuse_out_header`.
    static let inHeaderSize = 40, outHeaderSize = 16

    /// The unique id of an INIT request that offered the flag, until its reply is sent.
    private static let pendingInit = Atomic<UInt64>(0)
    /// Whether the kernel was told direct-I/O handles may be mapped shared.
    private static let granted = Atomic<Bool>(false)

    /// Whether direct-I/O handles may be mapped shared on this mount.
    static var directIOMappable: Bool { granted.load(ordering: .acquiring) }

    /// Installs the hooks on a mounted session (same descriptor); false if libfuse refuses.
    static func install(_ se: OpaquePointer) -> Bool {
        var io = fuse_custom_io()
        io.read = { fd, buf, len, _ in
            let n = Glibc.read(fd, buf, len)
            if let buf, n >= FuseChannel.inHeaderSize + 20 { FuseChannel.noteRequest(UnsafeRawPointer(buf)) }
            return n
        }
        io.writev = { fd, iov, count, _ in
            if let iov, count >= 2, FuseChannel.pendingInit.load(ordering: .relaxed) != 0 { FuseChannel.patchReply(iov) }
            return Glibc.writev(fd, iov, count)
        }
        return fuse_session_custom_io(se, &io, fuse_session_fd(se)) == 0
    }

    /// Remembers an INIT request whose second flag word offers the flag.
    private static func noteRequest(_ p: UnsafeRawPointer) {
        guard p.loadUnaligned(fromByteOffset: 4, as: UInt32.self) == opcodeInit else { return }
        let flags = p.loadUnaligned(fromByteOffset: inHeaderSize + 12, as: UInt32.self)
        let flags2 = p.loadUnaligned(fromByteOffset: inHeaderSize + 16, as: UInt32.self)
        guard flags & initExt != 0, flags2 & allowMmap != 0 else { return }
        pendingInit.store(p.loadUnaligned(fromByteOffset: 8, as: UInt64.self), ordering: .relaxed)
    }

    /// Sets the flag in the successful reply to the noted INIT request.
    private static func patchReply(_ iov: UnsafeMutablePointer<iovec>) {
        guard iov[0].iov_len >= outHeaderSize, let head = iov[0].iov_base,
              head.loadUnaligned(fromByteOffset: 8, as: UInt64.self) == pendingInit.load(ordering: .relaxed) else { return }
        pendingInit.store(0, ordering: .relaxed)
        guard head.loadUnaligned(fromByteOffset: 4, as: Int32.self) == 0, iov[1].iov_len >= 36, let body = iov[1].iov_base,
              body.loadUnaligned(fromByteOffset: 12, as: UInt32.self) & initExt != 0 else { return }
        let flags2 = body.loadUnaligned(fromByteOffset: 32, as: UInt32.self)
        body.storeBytes(of: flags2 | allowMmap, toByteOffset: 32, as: UInt32.self)
        granted.store(true, ordering: .releasing)
    }
}
