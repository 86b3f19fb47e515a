import Foundation
import Glibc

/// The store's exclusive lock (`flock` on the store directory): one daemon per store, and
/// no offline tool while it is mounted. A holder that is exiting — right after `kill -9` the
/// daemon's main thread is a zombie while its other threads still close their descriptors —
/// is waited for (bounded); a live holder is refused at once, by pid.
public enum StoreLock {
    /// Longest wait for a holder that is exiting.
    public static let exitingHolderWait: Double = 30
    /// Longest wait for a live holder: a daemon just unmounted (`umount` then `mount` at
    /// once) releases the store as its session ends, a moment after `umount` returns.
    public static let liveHolderWait: Double = 0.5

    /// Why the lock was not taken.
    public enum Refusal: Error, Equatable {
        /// A live process holds it (its pid when /proc/locks shows it).
        case heldByLiveProcess(pid: Int32?)
        /// The exiting holder still held it after `exitingHolderWait`.
        case exitingHolderStayed(pid: Int32)
    }

    /// Takes the lock on `fd` (an open store directory). `note` hears, once, that the lock
    /// is held by an exiting process being waited for.
    public static func acquire(
        fd: Int32, maxWait: Double = exitingHolderWait, note: (String) -> Void
    ) throws {
        if flock(fd, LOCK_EX | LOCK_NB) == 0 { return }
        guard errno == EWOULDBLOCK else { throw KeybagError.system("cannot lock the store", errno) }
        var st = stat()
        guard fstat(fd, &st) == 0 else { throw KeybagError.system("cannot stat the store", errno) }
        let holder = holderPID(
            locks: (try? String(contentsOfFile: "/proc/locks", encoding: .utf8)) ?? "", device: st.st_dev,
            inode: st.st_ino)
        guard let pid = holder, isExiting(pid: pid) else {
            let deadline = Date().addingTimeInterval(liveHolderWait)
            while Date() < deadline {
                usleep(10_000)
                if flock(fd, LOCK_EX | LOCK_NB) == 0 { return }
            }
            throw Refusal.heldByLiveProcess(pid: holder)
        }
        note("the store's lock is held by process \(pid), which is exiting; waiting for it (at most \(Int(maxWait)) s)")
        let deadline = Date().addingTimeInterval(maxWait)
        while Date() < deadline {
            usleep(20_000)
            if flock(fd, LOCK_EX | LOCK_NB) == 0 { return }
            guard errno == EWOULDBLOCK || errno == EINTR else {
                throw KeybagError.system("cannot lock the store", errno)
            }
            // Another process may have taken it in between: a live one is not waited for.
            let now = holderPID(
                locks: (try? String(contentsOfFile: "/proc/locks", encoding: .utf8)) ?? "", device: st.st_dev,
                inode: st.st_ino)
            if let now, now != pid, !isExiting(pid: now) { throw Refusal.heldByLiveProcess(pid: now) }
        }
        throw Refusal.exitingHolderStayed(pid: pid)
    }

    /// The pid /proc/locks gives for a FLOCK write lock on (`device`, `inode`), or nil. Its
    /// lines read `1: FLOCK  ADVISORY  WRITE 1234 fe:00:16221233 0 EOF` (major and minor in
    /// hex, the inode in decimal; blocked waiters, `->` lines, are skipped).
    public static func holderPID(locks: String, device: dev_t, inode: ino_t) -> Int32? {
        let d = UInt64(device)
        let major = ((d >> 8) & 0xfff) | ((d >> 32) & ~0xfff), minor = (d & 0xff) | ((d >> 12) & ~0xff)
        let want = String(format: "%02llx:%02llx:%llu", major, minor, UInt64(inode))
        for line in locks.split(separator: "\n") {
            let f = line.split(separator: " ", omittingEmptySubsequences: true)
            guard f.count >= 6, f[1] == "FLOCK", f[3] == "WRITE", f[5] == want, let pid = Int32(f[4]), pid > 0
            else { continue }
            return pid
        }
        return nil
    }

    /// Whether process `pid` is on its way out: gone, a zombie or dead (its main thread has
    /// exited; other threads may still be closing descriptors).
    public static func isExiting(pid: Int32) -> Bool {
        guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8) else { return true }
        return processState(stat: stat).map { $0 == "Z" || $0 == "X" || $0 == "x" } ?? true
    }

    /// The state letter of a /proc/PID/stat line (the field after the command's last `)`).
    public static func processState(stat: String) -> Character? {
        guard let close = stat.lastIndex(of: ")") else { return nil }
        return stat[stat.index(after: close)...].first { $0 != " " }
    }
}
