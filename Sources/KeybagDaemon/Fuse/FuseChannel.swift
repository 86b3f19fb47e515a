import CFuse
import CSystem
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization

/// The session's reads and writes of /dev/fuse, installed through libfuse's custom I/O
/// hooks for what libfuse 3.14 cannot do:
/// - ask the kernel for FUSE_DIRECT_IO_ALLOW_MMAP (kernel 6.6+, a bit in the INIT reply's
///   second flag word), which lets handles opened with direct I/O (class A) still be mapped
///   shared;
/// - ask for FUSE_HANDLE_KILLPRIV_V2: the daemon clears set-user-ID and set-group-ID bits
///   itself, so the kernel stops asking for `security.capability` (a GETXATTR round trip)
///   before every write; libfuse 3.14 does not pass the per-request "clear them" flags on,
///   so the read hook notes them for the thread that handles the request;
/// - take FUSE_TMPFILE (`open(2)` with `O_TMPFILE`, kernel 6.1+), which libfuse 3.14 answers
///   ENOSYS: the request has CREATE's layout and its name is always "/" (the kernel's name
///   for a file without one, never a real entry name), so the read hook relabels it CREATE
///   and the create handler tells the two apart by that name.
/// The hooks note the INIT request, set the bits the kernel offered in its reply, and pass
/// every other buffer through.
enum FuseChannel {
    /// Opcodes read by the hooks.
    static let opcodeSetattr: UInt32 = 4, opcodeOpen: UInt32 = 14, opcodeWrite: UInt32 = 16,
        opcodeInit: UInt32 = 26, opcodeCreate: UInt32 = 35, opcodeTmpfile: UInt32 = 51
    /// The name a relabelled FUSE_TMPFILE request carries.
    static let unnamedFileName = "/"
    /// FUSE_INIT_EXT: the second flag word is present.
    static let initExt: UInt32 = 1 << 30
    /// FUSE_HANDLE_KILLPRIV_V2 (first flag word).
    static let killPrivV2: UInt32 = 1 << 28
    /// FUSE_WRITEBACK_CACHE (first flag word).
    static let writebackCacheFlag: UInt32 = 1 << 16
    /// FUSE_DIRECT_IO_ALLOW_MMAP (flag bit 36) as a bit of the second word.
    static let allowMmap: UInt32 = 1 << 4
    /// Largest read and write request asked for, and the readahead window to match.
    static let requestSize = 1 << 20
    /// The mount's `read_ahead_kb` in sysfs, set before the session loop starts.
    static let readAheadFile = Locked<String?>(nil)
    /// Bytes of `fuse_in_header` / `fuse_out_header`.
    static let inHeaderSize = 40, outHeaderSize = 16

    /// The INIT request being answered: its unique id and the flags it offered.
    private struct PendingInit { var unique: UInt64 = 0; var flags: UInt32 = 0; var flags2: UInt32 = 0 }
    private static let pendingInit = Locked(PendingInit())
    /// Whether an INIT reply is still to be patched (checked on every reply without the lock).
    private static let initPending = Atomic<Bool>(false)
    /// Whether the kernel was told direct-I/O handles may be mapped shared.
    private static let granted = Atomic<Bool>(false)

    /// Whether the kernel says, per request, when set-ID bits must go (FUSE_HANDLE_KILLPRIV_V2).
    private static let killPrivGranted = Atomic<Bool>(false)

    /// Whether the kernel's write-back cache is in effect (set with the INIT reply).
    private static let writeback = Atomic<Bool>(false)

    /// What the INIT reply agreed (all false before it).
    static var negotiated: MountNegotiation {
        MountNegotiation(
            directIOMappable: granted.load(ordering: .acquiring), writeback: writeback.load(ordering: .acquiring))
    }

    /// Installs the hooks on a mounted session (same descriptor); false if libfuse refuses.
    static func install(_ se: OpaquePointer) -> Bool {
        var io = fuse_custom_io()
        io.read = { fd, buf, len, _ in
            let n = Glibc.read(fd, buf, len)
            if let buf, n >= FuseChannel.inHeaderSize { FuseChannel.noteRequest(buf, count: n) }
            return n
        }
        io.writev = { fd, iov, count, _ in
            guard let iov, count >= 2, FuseChannel.initPending.load(ordering: .relaxed), FuseChannel.patchReply(iov)
            else {
                return Glibc.writev(fd, iov, count)
            }
            let n = Glibc.writev(fd, iov, count)
            FuseChannel.raiseReadahead()
            return n
        }
        return fuse_session_custom_io(se, &io, fuse_session_fd(se)) == 0
    }

    /// Notes, for the thread about to handle it, whether a request asks for set-ID bits to
    /// be cleared; remembers an INIT request and the flags it offers; relabels FUSE_TMPFILE.
    /// (Internal, not private, for the unit tests.)
    static func noteRequest(_ p: UnsafeMutableRawPointer, count: Int) {
        var opcode = p.loadUnaligned(fromByteOffset: 4, as: UInt32.self)
        if opcode == opcodeTmpfile {
            p.storeBytes(of: opcodeCreate, toByteOffset: 4, as: UInt32.self)
            opcode = opcodeCreate
        }
        func word(_ offset: Int) -> UInt32 {
            count >= inHeaderSize + offset + 4
                ? p.loadUnaligned(fromByteOffset: inHeaderSize + offset, as: UInt32.self) : 0
        }
        let worded = killPrivGranted.load(ordering: .relaxed)
        func note(_ kills: Bool) { kbfs_set_request_kills_setid(worded ? (kills ? 1 : 0) : -1) }
        switch opcode {
        case opcodeWrite: note(word(20) & (1 << 2) != 0)  // FUSE_WRITE_KILL_SUIDGID
        case opcodeSetattr: note(word(0) & (1 << 11) != 0)  // FATTR_KILL_SUIDGID
        case opcodeOpen: note(word(4) & 1 != 0)  // FUSE_OPEN_KILL_SUIDGID
        case opcodeCreate: note(word(12) & 1 != 0)
        case opcodeInit:
            kbfs_set_request_kills_setid(-1)
            let flags = word(12), flags2 = word(16)
            guard count >= inHeaderSize + 20 else { return }
            pendingInit.withLock {
                $0 = PendingInit(
                    unique: p.loadUnaligned(fromByteOffset: 8, as: UInt64.self), flags: flags,
                    flags2: flags & initExt != 0 ? flags2 : 0)
            }
            initPending.store(true, ordering: .relaxed)
        default: kbfs_set_request_kills_setid(-1)
        }
    }

    /// The sysfs file of the mount's readahead window (`/sys/class/bdi/MAJ:MIN/read_ahead_kb`),
    /// from the device number of the filesystem now mounted at `mountpoint`: this session's,
    /// whatever `subtype=` or `fsname=` the user gave and whatever other keybagfs mounts
    /// start beside it (statx without sync: a stat of the mount point would wait for INIT).
    static func noteReadaheadFile(mountpoint: String) {
        var major: UInt32 = 0, minor: UInt32 = 0
        guard kbfs_mount_device(mountpoint, &major, &minor) == 0 else { return }
        readAheadFile.withLock { $0 = "/sys/class/bdi/\(major):\(minor)/read_ahead_kb" }
    }

    /// Raises the kernel's readahead for this mount to one request (it starts at 128 KiB
    /// and the INIT reply can only lower it); best effort: needs root.
    private static func raiseReadahead() {
        guard let path = readAheadFile.withLock({ $0 }) else { return }
        let fd = open(path, O_WRONLY | O_CLOEXEC)
        guard fd >= 0 else { return }
        let text = "\(requestSize / 1024)"
        _ = Glibc.write(fd, text, text.utf8.count)
        close(fd)
    }

    /// Sets the offered flags in the successful reply to the noted INIT request; true if
    /// `iov` was that reply. (Internal, not private, for the unit tests.)
    @discardableResult
    static func patchReply(_ iov: UnsafeMutablePointer<iovec>) -> Bool {
        guard iov[0].iov_len >= outHeaderSize, let head = iov[0].iov_base else { return false }
        let offered: PendingInit? = pendingInit.withLock { p in
            guard head.loadUnaligned(fromByteOffset: 8, as: UInt64.self) == p.unique else { return nil }
            defer { p = PendingInit() }
            return p
        }
        guard let offered else { return false }
        initPending.store(false, ordering: .relaxed)
        guard head.loadUnaligned(fromByteOffset: 4, as: Int32.self) == 0, iov[1].iov_len >= 36,
            let body = iov[1].iov_base
        else { return true }
        var flags = body.loadUnaligned(fromByteOffset: 12, as: UInt32.self)
        if offered.flags & killPrivV2 != 0 {
            flags |= killPrivV2
            killPrivGranted.store(true, ordering: .releasing)
        }
        if offered.flags2 & allowMmap != 0, flags & initExt != 0, !Failpoint.kernelWithoutDirectIOMmap.isOn {
            let flags2 = body.loadUnaligned(fromByteOffset: 32, as: UInt32.self)
            body.storeBytes(of: flags2 | allowMmap, toByteOffset: 32, as: UInt32.self)
            granted.store(true, ordering: .releasing)
        }
        body.storeBytes(of: flags, toByteOffset: 12, as: UInt32.self)
        writeback.store(flags & writebackCacheFlag != 0, ordering: .releasing)
        return true
    }
}
