import CSystem
import Dispatch
import Foundation
import Glibc
import KeybagCore

/// Watches every directory of `STORE/data` for changes this daemon did not make (a sync
/// engine writing into a mounted store) and makes the kernel and the node table forget what
/// they knew of the changed entries; what a change means is `StoreChange`'s (KeybagCore).
///
/// fanotify, not inotify: each event carries the pid of the process that caused it, so the
/// daemon's own changes (every create, write-back, rename: the bulk of all events) are dropped
/// by one comparison, with no bookkeeping of the events it expects to cause, and the long
/// cache timeouts stay free where the daemon is the only writer. The events name the
/// directory by file handle and the entry by name (`FAN_REPORT_DFID_NAME`, Linux 5.9); marks
/// are per directory, added as directories appear, like inotify watches. Run as root the group
/// has an unbounded queue and number of marks; unprivileged (Linux 5.13) its queue can
/// overflow, and then everything the kernel may hold is dropped (`forgetEverything`).
///
/// Watching in full costs each of the daemon's own creates, writes and renames an event, so a
/// store that `StoreSharing` finds no other writer of is watched only at its top level (the
/// store root, `devices/`, the data root): the first change another process makes there
/// turns on the full watch and drops everything cached, as after a lost event.
final class StoreWatcher: Sendable {
    /// The backing identity of a watched directory.
    private struct Directory: Hashable, Sendable { let dev: UInt64; let ino: UInt64 }

    private let fs: Filesystem
    /// The fanotify group.
    private let fan: Int32
    /// A real (not `O_PATH`) descriptor of `STORE/data`, to open directories by handle.
    private let dataFD: Int32
    /// The file handle of `STORE/xattrs` (empty when it is not watched): a set another writer
    /// adds or removes there changes the count `XattrStorage` keeps.
    private let xattrsHandle: [UInt8]
    /// Written once by `stop` to end the reading thread.
    private let stopPipe: (read: Int32, write: Int32)
    /// Watched directories by file handle (the bytes fanotify reports).
    private let watched = Locked<[[UInt8]: Directory]>([:])
    /// This process: events it caused are its own changes.
    private let ownPID = getpid()
    /// Whether a mark failed (logged once).
    private let markFailed = Locked(false)
    /// Signalled when the reading thread has ended.
    private let finished = DispatchSemaphore(value: 0)
    /// Whether every directory of the data folder is watched, not only the top level.
    private let full: Locked<Bool>
    /// The store's path: a removal record arriving in `devices/` is read from there.
    private let storePath: String
    /// The newest key set this device must know of, and the one it holds (the controller's keybag).
    private let keySetStanding: @Sendable () -> (newest: Int, holding: Int)
    /// The file handles of the store root and of its `devices/` folder (empty until it exists).
    private let rootHandle: [UInt8]
    private let devicesHandle = Locked<[UInt8]>([])
    /// Where notes go: the mount's.
    private var log: EventLog { fs.log }

    /// Starts watching the store `storePath` for `fs`, in `full` or only at its top level until
    /// another writer shows; nil (logged) where fanotify is not available to this process.
    static func start(
        fs: Filesystem, storePath: String, full: Bool,
        keySetStanding: @escaping @Sendable () -> (newest: Int, holding: Int)
    ) -> StoreWatcher? {
        let dataPath = storePath + "/" + Keybag.dataDirName, xattrsPath = storePath + "/" + Keybag.xattrsDirName
        var fan = kbfs_fanotify_open(geteuid() == 0 ? 1 : 0)
        if fan < 0 && geteuid() == 0 { fan = kbfs_fanotify_open(0) }
        guard fan >= 0 else {
            let e = String(cString: strerror(errno))
            fs.log("cannot watch the store for changes underneath (fanotify: \(e)); entries are cached 1 s")
            return nil
        }
        let data = open(dataPath, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        var p: [Int32] = [-1, -1]
        guard data >= 0, pipe(&p) == 0 else {
            fs.log("cannot watch the store for changes underneath: \(String(cString: strerror(errno)))")
            close(fan)
            if data >= 0 { close(data) }
            return nil
        }
        for fd in p { _ = fcntl(fd, F_SETFD, FD_CLOEXEC) }
        let x = open(xattrsPath, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        var buf = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
        let len = x >= 0 && kbfs_fanotify_watch(fan, x) == 0 ? kbfs_handle_of(x, &buf, Int32(buf.count)) : 0
        if x >= 0 { close(x) }
        // The store root and its devices folder, in every mode: another device's removal
        // shows there while mounted (`checkRemovals`).
        let root = open(storePath, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        var rootHandle = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
        let rootLen =
            root >= 0 && kbfs_fanotify_watch(fan, root) == 0
            ? kbfs_handle_of(root, &rootHandle, Int32(rootHandle.count)) : 0
        if root >= 0 { close(root) }
        let w = StoreWatcher(
            fs: fs, fan: fan, dataFD: data, xattrsHandle: len > 0 ? Array(buf[0..<Int(len)]) : [],
            stopPipe: (p[0], p[1]), full: full, storePath: storePath,
            rootHandle: rootLen > 0 ? Array(rootHandle[0..<Int(rootLen)]) : [], keySetStanding: keySetStanding)
        w.watchDevicesFolder()
        if full { w.watchTree(dup(data)) } else { _ = w.watch(data) }  // else the data root only
        if full { fs.underneath.expectAnotherWriter() }
        NamedThread.start("kbfs-watcher") { [w] in w.run() }
        return w
    }

    /// A watcher of the group `fan` (taken over); `start` makes it.
    private init(
        fs: Filesystem, fan: Int32, dataFD: Int32, xattrsHandle: [UInt8], stopPipe: (read: Int32, write: Int32),
        full: Bool, storePath: String, rootHandle: [UInt8],
        keySetStanding: @escaping @Sendable () -> (newest: Int, holding: Int)
    ) {
        self.keySetStanding = keySetStanding
        self.full = Locked(full)
        self.storePath = storePath
        self.rootHandle = rootHandle
        self.fs = fs
        self.fan = fan
        self.dataFD = dataFD
        self.xattrsHandle = xattrsHandle
        self.stopPipe = stopPipe
    }

    /// Ends the reading thread and waits (2 s at most) until it has: nothing is told to the
    /// kernel after that. The pipe stays open (two descriptors until exit), so a late `stop`
    /// never writes into a reused descriptor.
    func stop() {
        var b: UInt8 = 1
        _ = write(stopPipe.write, &b, 1)
        _ = finished.wait(timeout: .now() + 2)
    }

    // MARK: marks

    /// Watches the directory open as `fd` (taken over) and every directory below it, but not
    /// the folders of a sync engine (`.stversions`).
    private func watchTree(_ fd: Int32) {
        var pending = [fd]
        while let dir = pending.popLast() {
            defer { close(dir) }
            guard watch(dir) else { continue }
            guard let entries = try? DirectoryNames.backingEntries(dirFD: dir) else { continue }
            for e in entries where e.type == UInt8(DT_DIR) || e.type == UInt8(DT_UNKNOWN) {
                switch BackingKind.of(e.name) {
                case .name, .longName: break
                default: continue
                }
                let sub = openat(dir, e.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                if sub >= 0 { pending.append(sub) }
            }
        }
    }

    /// Marks one directory and remembers its handle; false when it cannot be watched.
    private func watch(_ dir: Int32) -> Bool {
        var st = stat()
        var buf = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
        let len = kbfs_handle_of(dir, &buf, Int32(buf.count))
        guard fstat(dir, &st) == 0, kbfs_fanotify_watch(fan, dir) == 0 else {
            let e = errno
            if !markFailed.withLock({ f in
                defer { f = true }; return f
            }) {
                log(
                    "cannot watch a store directory for changes underneath: " + String(cString: strerror(e)))
            }
            return false
        }
        if len > 0 {
            let id = Directory(dev: UInt64(st.st_dev), ino: UInt64(st.st_ino))
            watched.withLock { $0[Array(buf[0..<Int(len)])] = id }
        }
        return true
    }

    /// Marks the store's `devices/` folder, if it exists, and remembers its handle.
    private func watchDevicesFolder() {
        let fd = open(storePath + "/" + StoreDevices.dirName, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { return }
        defer { close(fd) }
        var buf = [UInt8](repeating: 0, count: Int(kbfs_HANDLE_BUFFER))
        let len = kbfs_fanotify_watch(fan, fd) == 0 ? kbfs_handle_of(fd, &buf, Int32(buf.count)) : 0
        if len > 0 { devicesHandle.withLock { $0 = Array(buf[0..<Int(len)]) } }
    }

    /// Another device's removal record arrived: if it started a key set this device lacks,
    /// nothing new is wrapped from now on (the removed device could open it).
    private func checkRemovals() {
        let (newest, holding) = keySetStanding()
        guard newest > holding, newest > Int(fs.keyring.currentKeySet), !fs.keyring.refusesNewWraps else { return }
        fs.keyring.fallBehind()
        log(
            "another device removed a device and started key set \(newest): new files and class changes are "
                + "refused until this device takes it up (at its next unlock, when the set was handed to it; else "
                + "with `keybagfs recover` and a new mount)")
    }

    /// From now on every directory is watched and another writer is expected.
    private func watchInFull() {
        full.withLock { $0 = true }
        fs.underneath.expectAnotherWriter()
    }

    /// Watches the new directory `name` of the directory `handle` (the node `parent`, when the
    /// kernel knows it) and everything already below it.
    private func watchNew(_ name: String, in handle: [UInt8], parent: Node?) {
        if Failpoint.watcherCannotMarkNewDirectories.isOn { return }
        let p =
            parent.map { dup($0.fd) }
            ?? handle.withUnsafeBufferPointer { kbfs_open_handle(dataFD, $0.baseAddress, kbfs_O_PATH | O_CLOEXEC) }
        guard p >= 0 else { return }
        defer { close(p) }
        let sub = openat(p, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        if sub >= 0 { watchTree(sub) }
    }

    /// The directory a reported handle names: a watched one, else found by opening the handle.
    private func directory(_ handle: [UInt8]) -> Directory? {
        if let d = watched.withLock({ $0[handle] }) { return d }
        let fd = handle.withUnsafeBufferPointer { kbfs_open_handle(dataFD, $0.baseAddress, kbfs_O_PATH | O_CLOEXEC) }
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var st = stat()
        guard fstat(fd, &st) == 0 else { return nil }
        let d = Directory(dev: UInt64(st.st_dev), ino: UInt64(st.st_ino))
        watched.withLock { $0[handle] = d }
        return d
    }

    // MARK: events

    /// The reading thread: waits for events or `stop`.
    private func run() {
        var buf = [UInt8](repeating: 0, count: 64 * 1024)
        var fds = [
            pollfd(fd: fan, events: Int16(POLLIN), revents: 0),
            pollfd(fd: stopPipe.read, events: Int16(POLLIN), revents: 0),
        ]
        while true {
            fds[0].revents = 0
            fds[1].revents = 0
            guard poll(&fds, 2, -1) >= 0 || errno == EINTR else { break }
            if fds[1].revents != 0 { break }
            guard fds[0].revents != 0 else { continue }
            let n = read(fan, &buf, buf.count)
            if n < 0 && (errno == EINTR || errno == EAGAIN) { continue }
            guard n > 0 else { break }
            handle(events: buf, count: n)
        }
        close(fan)
        close(dataFD)
        finished.signal()
    }

    /// Parses one read's events and applies those another process caused.
    private func handle(events buf: [UInt8], count: Int) {
        let devices = devicesHandle.withLock { $0 }
        var batch = sort(events: buf, count: count, devices: devices)
        if batch.devicesChanged {
            if devices.isEmpty { watchDevicesFolder() }
            checkRemovals()
        }
        if batch.foreign {
            watchInFull()
            forgetEverything(because: "another process changed the store: watching all of it from now on")
            return
        }
        for d in batch.ownDirectories { watchNew(d.name, in: d.handle, parent: nil) }
        if !batch.changes.isEmpty && Failpoint.watcherLosesEvents.isOn { batch.changes = []; batch.overflow = true }
        if !batch.changes.isEmpty { fs.underneath.namesChanged() }
        var relist: [UInt64: Node] = [:]
        for c in batch.changes {
            if let dir = apply(c.change, in: c.handle) { relist[dir.id] = dir }
        }
        for dir in relist.values { forgetEveryName(of: dir) }
        if batch.xattrSetsChanged {
            fs.attributes.xattrs.recount()
        }
        if batch.overflow { forgetEverything(because: "the store watcher lost events (queue overflow)") }
    }

    /// What one read of fanotify events asks for, sorted by kind.
    private struct EventBatch {
        /// Other writers' changes of entries, by the handle of their directory.
        var changes: [(handle: [UInt8], change: StoreChange)] = []
        /// Directories the daemon itself made (to be watched).
        var ownDirectories: [(handle: [UInt8], name: String)] = []
        var overflow = false
        var xattrSetsChanged = false
        /// Another process changed the store while only the root was watched.
        var foreign = false
        var devicesChanged = false
    }

    /// Sorts the events in `buf` (`devices`: the handle of devices/, if watched).
    private func sort(events buf: [UInt8], count: Int, devices: [UInt8]) -> EventBatch {
        var batch = EventBatch()
        var offset = 0
        let watchingAll = full.withLock { $0 }
        buf.withUnsafeBufferPointer { b in
            var ev = kbfs_fan_event()
            while kbfs_fanotify_next(b.baseAddress, count, &offset, &ev) == 1 {
                if ev.mask & kbfs_FAN_Q_OVERFLOW != 0 { batch.overflow = true; continue }
                guard let h = ev.handle, let name = ev.name else { continue }
                let isDir = ev.mask & kbfs_FAN_ONDIR != 0
                // The daemon's own changes need nothing, but the directories it makes are watched.
                let own = ev.pid == ownPID
                guard !own || watchingAll && isDir && ev.mask & kbfs_FAN_CREATE != 0 else { continue }
                let handle = Array(UnsafeBufferPointer(start: h, count: Int(ev.handle_len)))
                // The store root and devices/: removal records (and a devices folder made).
                if handle == rootHandle || handle == devices {
                    batch.devicesChanged =
                        batch.devicesChanged || handle == devices || String(cString: name) == StoreDevices.dirName
                    if !watchingAll { batch.foreign = true }
                    continue
                }
                if !watchingAll {
                    batch.foreign = true
                    continue
                }
                if !xattrsHandle.isEmpty && handle == xattrsHandle {
                    batch.xattrSetsChanged = true
                    continue
                }
                let entry = String(cString: name)
                if own {
                    batch.ownDirectories.append((handle, entry))
                    continue
                }
                for e in Self.events(ev.mask) {
                    batch.changes.append((handle, StoreChange(name: entry, event: e, isDirectory: isDir)))
                }
            }
        }
        return batch
    }

    /// The changes one event's mask reports (merged events report several).
    private static func events(_ mask: UInt64) -> [StoreChange.Event] {
        var out: [StoreChange.Event] = []
        if mask & (kbfs_FAN_DELETE | kbfs_FAN_MOVED_FROM) != 0 { out.append(.vanished) }
        if mask & (kbfs_FAN_CREATE | kbfs_FAN_MOVED_TO) != 0 { out.append(.appeared) }
        if mask & kbfs_FAN_CLOSE_WRITE != 0 { out.append(.written) }
        if mask & kbfs_FAN_ATTRIB != 0 { out.append(.attributesChanged) }
        return out
    }

    /// Makes the kernel and the node table forget what `change` in the directory `handle`
    /// made stale. Runs on the watcher's thread, holding no lock a FUSE request needs; the
    /// kernel is told from the notifier's queue.
    /// Returns the directory whose every name must be looked up again (`forgetEveryName`), once
    /// per batch of events.
    private func apply(_ change: StoreChange, in handle: [UInt8]) -> Node? {
        let r = change.response
        guard !r.isNothing, let d = directory(handle) else { return nil }
        if r.classesMayChange { fs.classes.changed() }
        let dir = fs.table.node(dev: d.dev, ino: d.ino)
        if r.newDirectory { watchNew(change.name, in: handle, parent: dir) }
        // The kernel holds nothing below a directory it does not know.
        guard let dir, dir.isDirectory else { return nil }
        if r.everyEntry { return dir }  // its metadata is forgotten there, after the names it gave
        if r.directoryMeta { dir.directory?.forget() }
        if let entry = r.entry ?? r.rewritten { forgetEntry(entry, of: dir) }
        if let changed = r.rewritten ?? r.attributes, let n = node(of: changed, in: dir) {
            if r.rewritten != nil, let file = n.file {
                // With the write-back cache the kernel keeps its own size of an inode it
                // holds, whatever the daemon replies: the rewritten file gets a new node
                // (new lookups see its new size), and handles of this one answer EIO.
                file.io.write { $0.supersede() }
                fs.table.retire(n)
                fs.kernel.dropPagesSoon(n.id, pass: "a file rewritten underneath")
            } else {
                fs.kernel.refreshAttributes([n.id])
            }
        }
        fs.kernel.refreshAttributes([dir.id])
        return nil
    }

    /// The IVs a directory's names decrypt under changed (its metadata or a copy of it came or
    /// went): the kernel forgets every name the directory showed with the metadata known so
    /// far, the metadata is read again, and every name it shows now is forgotten too.
    private func forgetEveryName(of dir: Node) {
        var names = Set(((try? fs.namespace.listing(dir)) ?? []).map(\.name))
        dir.directory?.forget()
        names.formUnion(((try? fs.namespace.listing(dir)) ?? []).map(\.name))
        for name in names where name != "." && name != ".." { fs.kernel.forgetEntrySoon(parent: dir.id, name: name) }
        fs.kernel.refreshAttributes([dir.id])
    }

    /// Makes the kernel look the backing entry `entry` of `dir` up again (by its plaintext name,
    /// and by its conflict name where it decrypts under a metadata copy's IV).
    private func forgetEntry(_ entry: String, of dir: Node) {
        guard let ivs = try? fs.directories.nameIVs(of: dir),
            let found = try? fs.directories.plaintextName(dirFD: dir.fd, backing: entry, ivs: ivs)
        else { return }
        fs.kernel.forgetEntrySoon(parent: dir.id, name: found.name)
        if found.index > 0 {
            let conflictName = ivs.shownName(plain: found.name, index: found.index, taken: [found.name])
            fs.kernel.forgetEntrySoon(parent: dir.id, name: conflictName)
        }
    }

    /// The node of the backing entry `name` of `dir`, if the kernel knows it.
    private func node(of name: String, in dir: Node) -> Node? {
        var st = stat()
        guard fstatat(dir.fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 else { return nil }
        return fs.table.node(dev: UInt64(st.st_dev), ino: UInt64(st.st_ino))
    }

    /// A file whose header another writer rewrote while no event told of it (a class change,
    /// a new version): its node's header and key are stale, so it is superseded and looked
    /// up again as a new node, as for a file rewritten underneath.
    private func supersedeIfHeaderChanged(_ n: Node) {
        guard let file = n.file, let cached = file.io.read({ $0.header }) else { return }
        let fd = n.open(O_RDONLY)
        guard fd >= 0 else { return }
        defer { close(fd) }
        guard (try? HeaderSlots.current(fd: fd)) != cached else { return }
        file.io.write { $0.supersede() }
        fs.table.retire(n)
        fs.kernel.dropPagesSoon(n.id, pass: "a file rewritten underneath while events were lost")
    }

    /// After a lost event (queue overflow) or the first change of another writer: every
    /// directory is watched again, its metadata read again, the kernel drops the attributes
    /// and pages of every inode it has and looks up again every name that exists now. A name
    /// removed, or a file rewritten in place, while events were lost may show as before up to
    /// the entry timeout.
    private func forgetEverything(because reason: String) {
        log(reason + ": dropping every cached entry")
        fs.underneath.namesChanged()
        watchTree(dup(dataFD))
        fs.classes.changed()
        fs.attributes.xattrs.recount()
        for n in fs.table.allNodes() {
            if n.isRegular { supersedeIfHeaderChanged(n) }
            if n.isDirectory {
                n.directory?.forget()
                for e in (try? fs.namespace.listing(n)) ?? [] where e.name != "." && e.name != ".." {
                    fs.kernel.forgetEntrySoon(parent: n.id, name: e.name)
                }
            }
            fs.kernel.dropPagesSoon(n.id, pass: "a lost change underneath")
        }
    }
}
