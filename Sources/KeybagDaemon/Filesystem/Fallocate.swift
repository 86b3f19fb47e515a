import CSystem
import Dispatch
import Glibc
import KeybagCore
import KeybagProtocol
import Synchronization

/// fallocate of an open file: reservations, holes punched, ranges zeroed.
extension FileIO {
    /// fallocate: mode 0 (allocate, growing the size), KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE,
    /// ZERO_RANGE (optionally KEEP_SIZE); other modes are EOPNOTSUPP.
    /// The kernel leaves set-ID bits to us here (no per-request flag, as for writes), so they
    /// go as after a write by `caller`.
    func fallocate(_ h: OpenFile, mode: Int32, offset: Int, length: Int, caller: Caller) throws {
        let keepSize: Int32 = 0x01, punchHole: Int32 = 0x02, zeroRange: Int32 = 0x10
        guard offset >= 0, length > 0 else { throw FSError(EINVAL) }
        guard offset <= Self.maxFileSize - length else { throw FSError(EFBIG) }
        guard mode & ~(keepSize | punchHole | zeroRange) == 0 else { throw FSError(EOPNOTSUPP) }
        if mode & punchHole != 0 && (mode & keepSize == 0 || mode & zeroRange != 0) { throw FSError(EOPNOTSUPP) }
        guard h.writable else { throw FSError(EBADF) }
        let layout = content.layout
        try retryingWhileSpaceReturns {
            try withContentKey(h.node, .write) { key in
                let size = try content.plainSize(fd: h.fd)
                let end = offset + length
                let journal = journaling?.file(h.node, h.file, fd: h.fd, key: key)
                journal?.noteInPlace()
                if mode & (punchHole | zeroRange) != 0 {
                    try content.zeroRange(
                        fd: h.fd, key: key, offset: offset, length: length, journal: journal
                    ) { off, len in
                        guard kbfs_fallocate(h.fd, punchHole | keepSize, Int64(off), Int64(len)) == 0 else {
                            return false
                        }
                        h.file.noteHole(at: off)
                        return true
                    }
                }
                if mode & keepSize == 0 && end > size {
                    try content.truncate(fd: h.fd, key: key, to: end, journal: journal)
                }
                if mode & (punchHole | zeroRange) == 0 {
                    // Reserve backing space for the range (best effort where the backing fs cannot).
                    let whole = layout.cipherRange(ofWhole: PlainRange(offset: offset, end: end).blocks)
                    let b0 = whole.lowerBound, b1 = whole.upperBound
                    let bsize = layout.backingSize(plainSize: max(size, mode & keepSize == 0 ? end : size))
                    let upTo = mode & keepSize == 0 ? min(b1, bsize) : b1
                    if upTo > b0 && kbfs_fallocate(h.fd, keepSize, Int64(b0), Int64(upTo - b0)) != 0 && errno == ENOSPC
                    {
                        throw FSError(ENOSPC)
                    }
                }
            }
        }
        clearSetIDAfterModification(h, by: caller)
    }
}
