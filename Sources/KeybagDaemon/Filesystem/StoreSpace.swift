import CSystem
import Dispatch
import Glibc
import KeybagCore
import Synchronization

/// The store's free space as the write path sees it.
///
/// With the kernel's write-back cache, write(2) copies into the page cache without asking
/// the daemon; the write-back comes later, and when it finds no space the data is lost and
/// only fsync or close report it. So near the end of the space the mount turns **tight**:
/// every attribute reply has timeout 0, and a GETATTR naming a writable handle — which the
/// kernel sends before each write(2) into the page cache — answers ENOSPC while less than
/// `Thresholds.refuseBelow` is available, so write(2) itself fails. The mount turns tight
/// when a write finds less than `Thresholds.tightBelow` available (before anything is lost:
/// that leaves room for all the dirty pages the kernel may hold for the mount), or when a
/// write fails for want of space; while tight, the kernel may hold only a few MiB of dirty
/// pages for the mount (its bdi's `max_bytes`, lowered by the daemon). It turns loose again
/// above `Thresholds.looseAbove`. docs/FORMAT.md, "A full store".
final class StoreSpace: Sendable {
    /// Byte counts that decide the states, from the store's size and the kernel's dirty limit.
    struct Thresholds: Equatable {
        /// Dirty bytes the kernel may hold for the mount while tight.
        let tightDirty: Int
        /// Below this much available, cached writes are refused (tight).
        let refuseBelow: Int
        /// Below this much available, a write makes the mount tight.
        let tightBelow: Int
        /// At or above this much available, the mount turns loose.
        let looseAbove: Int

        /// For a store of `size` bytes and a mount whose kernel may hold `dirty` bytes of
        /// dirty pages (loose), of which `tightDirty` while tight (0: the limit cannot be
        /// lowered, and only a failed write makes the mount tight). While loose, the kernel may
        /// hold twice `dirty` and a write(2) more (its limit is soft; a 1 MiB write(2) can be
        /// one large folio, counted at once) before the mount turns tight. While tight, a check lets
        /// a write(2) of up to `promisedWrite` through while the kernel holds up to twice
        /// `tightDirty` (its limit is soft: pages dirtied between two looks, pages under
        /// write-back); all of it sealed must fit in `refuseBelow`.
        init(size: Int, dirty: Int, canLowerDirty: Bool) {
            tightDirty = canLowerDirty ? min(4 << 20, size / 32) : 0
            refuseBelow = Self.sealed(Self.promisedWrite(size: size) + 2 * tightDirty)
            tightBelow = canLowerDirty ? Self.sealed(2 * dirty + Self.promisedWrite(size: size)) + refuseBelow : 0
            looseAbove = max(tightBelow, refuseBelow) + min(16 << 20, size / 16)
        }

        /// The largest write(2) whose data is never lost for want of space (docs/FORMAT.md).
        static func promisedWrite(size: Int) -> Int { min(4 << 20, size / 16) }

        /// At least the store bytes `plain` content bytes take: 64 per 4 KiB block (the
        /// costlier cipher's nonce and tag take 40) and a last partly filled page.
        static func sealed(_ plain: Int) -> Int { plain + plain / 64 + 4096 }
    }

    /// The store's data directory.
    private let storeFD: Int32
    /// Whether the mount is tight now.
    private let tight = Atomic<Bool>(false)
    /// When (CLOCK_MONOTONIC ns) a write last looked at the free space.
    private let lastLook = Atomic<UInt64>(0)
    /// Whether the last look found the store near `tightBelow` (within `nearMargin`): then
    /// every write looks, since 10 ms of write-back can take more than the margin.
    private let near = Atomic<Bool>(true)
    /// The mount's bdi folder in sysfs (its dirty limit), once the session exists.
    private let bdi = Locked<String?>(nil)
    /// The bdi's `max_ratio_fine` and `max_bytes` before the daemon lowered them.
    private let saved = Locked<(ratio: String, bytes: Int)?>(nil)
    /// Requests waiting for space that deleted files are about to give back.
    private let waiters = Atomic<Int>(0)
    /// Most requests that wait for space at a time (see `retryingWhileSpaceReturns`): a
    /// quarter of the FUSE threads, at most 4, so that threads stay free for the releases.
    private let maxWaiters: Int
    /// Whether a request may wait for space now (false while a lock is evicting or done:
    /// no request waits then, and a write's plaintext must not outlive its request).
    private let mayWait: @Sendable () -> Bool
    /// Tries, 20 ms apart, while no deleted file is held (see `waitingForSpace`).
    static let settleTries = 5
    /// Longest wait for space (ns), and longest wait for the next release of a deleted file.
    static let longestWait: UInt64 = 5_000_000_000, longestWaitForARelease: UInt64 = 300_000_000
    /// How often (ns) writes look at the free space while it is far from `tightBelow`.
    static let lookInterval: UInt64 = 10_000_000
    /// Free space above `tightBelow` within which every write looks (10 ms of write-back at
    /// over 20 GB/s).
    static let nearMargin = 256 << 20

    init(storeFD: Int32, threads: Int, mayWait: @escaping @Sendable () -> Bool) {
        self.storeFD = storeFD
        self.maxWaiters = min(4, threads / 4)
        self.mayWait = mayWait
    }

    /// Tells where the mount's dirty limit lives (`/sys/class/bdi/MAJ:MIN`).
    func attach(bdi folder: String) { bdi.withLock { $0 = folder } }

    /// Whether the mount is tight (attribute replies get timeout 0).
    var isTight: Bool { tight.load(ordering: .relaxed) }

    // MARK: states

    /// After a successful write: looks at the free space (at most every 10 ms while far from
    /// the end; after every write near it) and turns the mount tight when little is left.
    /// True when it turned tight now (the caller then makes the kernel ask for attributes
    /// again).
    func noteWritten() -> Bool {
        guard !isTight else { return false }
        let now = DispatchTime.now().uptimeNanoseconds
        let last = lastLook.load(ordering: .relaxed)
        if !near.load(ordering: .relaxed) {
            guard now &- last >= Self.lookInterval,
                lastLook.compareExchange(expected: last, desired: now, ordering: .relaxed).exchanged
            else { return false }
        }
        guard let (available, t) = measure() else { return false }
        near.store(available < t.tightBelow + Self.nearMargin, ordering: .relaxed)
        return available < t.tightBelow ? turnTight() : false
    }

    /// A write failed for want of space: the mount turns tight. True when it turned now.
    func noteFull() -> Bool { turnTight() }

    /// A GETATTR naming a writable handle while tight: ENOSPC below `refuseBelow` (after
    /// waiting for space deleted files are about to give back); turns loose above
    /// `looseAbove`.
    func checkBeforeCachedWrite() throws {
        func roomy() -> Bool { measure().map { $0.available >= $0.thresholds.refuseBelow } ?? true }
        if !roomy() { try waitingForSpace { if !roomy() { throw FSError(ENOSPC) } } }
        if let (available, t) = measure(), available >= t.looseAbove { turnLoose() }
    }

    /// Bytes available to the daemon's writes (statvfs `f_bavail`: ext4 keeps a reserve for
    /// its metadata out of reach even of root, which `f_bfree` counts) and the thresholds;
    /// nil when the store's filesystem gives no space figures (0 blocks: tmpfs without a size,
    /// some FUSE and network filesystems), where nothing is refused ahead and only a write that
    /// fails for want of space turns the mount tight.
    private func measure() -> (available: Int, thresholds: Thresholds)? {
        var s = statvfs()
        guard fstatvfs(storeFD, &s) == 0, s.f_blocks > 0 else { return nil }
        func bytes(_ blocks: fsblkcnt_t) -> Int {  // saturating: some filesystems report "unlimited"
            let (b, over) = UInt64(blocks).multipliedReportingOverflow(by: UInt64(s.f_frsize))
            return over || b > UInt64(Int.max) ? Int.max : Int(b)
        }
        let folder = bdi.withLock { $0 }
        let loose = folder.flatMap { Self.readNumber($0 + "/max_bytes") }  // absent before Linux 6.2
        let dirty = saved.withLock { $0?.bytes } ?? loose ?? (64 << 20)
        let t = Thresholds(size: bytes(s.f_blocks), dirty: dirty, canLowerDirty: loose != nil && geteuid() == 0)
        return (bytes(s.f_bavail), t)
    }

    /// Turns tight and lowers the kernel's dirty limit for the mount; true if it was loose.
    private func turnTight() -> Bool {
        guard !tight.exchange(true, ordering: .relaxed) else { return false }
        if let folder = bdi.withLock({ $0 }), let t = measure()?.thresholds, t.tightDirty > 0,
            let ratio = Self.readText(folder + "/max_ratio_fine"), let bytes = Self.readNumber(folder + "/max_bytes")
        {
            saved.withLock { if $0 == nil { $0 = (ratio, bytes) } }
            Self.writeText(folder + "/max_bytes", "\(t.tightDirty)")
        }
        return true
    }

    /// Turns loose and gives the kernel its dirty limit back.
    private func turnLoose() {
        guard tight.exchange(false, ordering: .relaxed) else { return }
        let before = saved.withLock { s -> (ratio: String, bytes: Int)? in
            defer { s = nil }; return s
        }
        if let folder = bdi.withLock({ $0 }), let before { Self.writeText(folder + "/max_ratio_fine", before.ratio) }
    }

    // MARK: waiting for space

    /// Runs `body`, and again when it failed for want of space, as long as space is coming
    /// back (`longestWait`, 5 s, at most):
    /// - files deleted while open hold their blocks until their last handle's release, which
    ///   the kernel sends in the background, behind the write-back queued for other files
    ///   (a program that deletes a file and writes the next one meets a full store that is
    ///   not): each such release is waited for;
    /// - a journaling filesystem (ext4) reuses freed blocks only after its next commit: the
    ///   store's filesystem is committed before each retry.
    /// At most `maxWaiters` requests wait at a time, so that FUSE threads stay free for the
    /// releases they wait for; the others fail at once. `body` must leave nothing half done
    /// when it throws.
    func retryingWhileSpaceReturns<R>(_ body: () throws -> R) throws -> R {
        do { return try body() } catch  where [ENOSPC, EDQUOT].contains(FSError(error).errno) {
            return try waitingForSpace(body)
        }
    }

    /// The retries of `retryingWhileSpaceReturns`: wait for each release of a deleted file,
    /// commit the store, try again. A file whose descriptor is closed is still being freed
    /// for a moment (its last close truncates it), so the last tries are 20 ms apart.
    /// Ends when nothing was held for `settleTries` tries, or after `longestWait`.
    private func waitingForSpace<R>(_ body: () throws -> R) throws -> R {
        guard mayWait(), waiters.add(1, ordering: .relaxed).newValue <= maxWaiters else {
            waiters.subtract(1, ordering: .relaxed)
            throw FSError(ENOSPC)
        }
        defer { waiters.subtract(1, ordering: .relaxed) }
        let deadline = DispatchTime.now().uptimeNanoseconds + Self.longestWait
        var held = bytesHeldByDeletedOpenFiles()
        var settling = 0
        while true {
            // A file kept open after its deletion (by a program that wants it) gives nothing
            // back: a release that does not come within `longestWaitForARelease` ends the wait.
            let releaseDeadline = min(deadline, DispatchTime.now().uptimeNanoseconds + Self.longestWaitForARelease)
            while held > 0 && bytesHeldByDeletedOpenFiles() >= held {
                guard DispatchTime.now().uptimeNanoseconds < releaseDeadline, mayWait() else { throw FSError(ENOSPC) }
                usleep(20_000)
            }
            if held == 0 && settling > 0 { usleep(20_000) }
            kbfs_syncfs(storeFD)
            do { return try body() } catch  where [ENOSPC, EDQUOT].contains(FSError(error).errno) {
                held = bytesHeldByDeletedOpenFiles()
                settling = held == 0 ? settling + 1 : 0
                if settling > Self.settleTries || DispatchTime.now().uptimeNanoseconds >= deadline || !mayWait() {
                    throw error
                }
            }
        }
    }

    /// Backing bytes of files deleted while open (they return with their last close): every
    /// descriptor of the daemon's on the store's device is looked at, since the kernel may
    /// forget a node before it releases the node's last handle.
    private func bytesHeldByDeletedOpenFiles() -> Int {
        var store = stat()
        guard fstat(storeFD, &store) == 0 else { return 0 }
        let dfd = Glibc.open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard dfd >= 0, let dir = fdopendir(dfd) else { if dfd >= 0 { close(dfd) }; return 0 }
        defer { closedir(dir) }
        var held = 0
        while let ent = readdir(dir) {
            guard let fd = Int32(String(cString: DirectoryNames.entryName(ent))) else { continue }
            var st = stat()
            if fstat(fd, &st) == 0 && st.st_nlink == 0 && st.st_mode & S_IFMT == S_IFREG && st.st_dev == store.st_dev {
                held += Int(st.st_blocks) * 512
            }
        }
        return held
    }

    // MARK: sysfs

    /// The first line of a small file, trimmed; nil when unreadable.
    private static func readText(_ path: String) -> String? {
        let fd = Glibc.open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var buf = [UInt8](repeating: 0, count: 64)
        let n = Glibc.read(fd, &buf, buf.count)
        guard n > 0 else { return nil }
        return String(decoding: buf[0..<n], as: UTF8.self).split(separator: "\n").first.map(String.init)
    }

    /// A decimal number from a small file.
    private static func readNumber(_ path: String) -> Int? { readText(path).flatMap { Int($0) } }

    /// Writes a value to a sysfs file (best effort: needs root).
    private static func writeText(_ path: String, _ text: String) {
        let fd = Glibc.open(path, O_WRONLY | O_CLOEXEC)
        guard fd >= 0 else { return }
        _ = Glibc.write(fd, text, text.utf8.count)
        close(fd)
    }
}
