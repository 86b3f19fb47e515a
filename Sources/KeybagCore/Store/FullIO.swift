import Glibc

/// Whole-buffer positional I/O on a store file (short reads and EINTR retried).
public enum FullIO {
    /// pread until `buf` is full or EOF; returns bytes read.
    public static func preadFull(_ fd: Int32, _ buf: UnsafeMutableRawBufferPointer, offset: Int) throws -> Int {
        var done = 0
        while done < buf.count {
            let n = pread(fd, buf.baseAddress! + done, buf.count - done, off_t(offset + done))
            if n < 0 { if errno == EINTR { continue }; throw KeybagError.system("pread", errno) }
            if n == 0 { break }
            done += n
        }
        return done
    }

    /// pwrite all of `buf` (ENOSPC and friends surface as errors).
    public static func pwriteFull(_ fd: Int32, _ buf: UnsafeRawBufferPointer, offset: Int) throws {
        var done = 0
        while done < buf.count {
            let n = pwrite(fd, buf.baseAddress! + done, buf.count - done, off_t(offset + done))
            if n < 0 { if errno == EINTR { continue }; throw KeybagError.system("pwrite", errno) }
            done += n
        }
    }
}
