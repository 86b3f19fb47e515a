import CSodium
import CSystem
import Foundation
import Glibc
import KeybagCore
import Synchronization

/// One client connection of the control socket. Writes are serialised, and the descriptor
/// is closed under the same lock, so a late event never reaches a reused descriptor number.
/// Events never wait for the lock: they queue, and whoever holds the lock sends them.
final class Connection: Sendable {
    let fd: Int32
    /// Held by each write and by `close`; the value says whether the descriptor is closed.
    private let writeLock = Locked(false)
    /// Event lines waiting for the write lock (a reply being sent holds it).
    private let pending = Locked<[String]>([])
    /// Set when events could not be delivered; the reader stops after its current reply.
    private let dropped = Atomic<Bool>(false)
    /// Most event lines that may wait for one connection before it is dropped.
    static let maxPending = 32
    init(fd: Int32) { self.fd = fd }

    /// Writes one line with the write lock held; false on an error or, when not blocking,
    /// a full buffer (a line cut off there would corrupt the stream: the caller drops it).
    private func write(_ line: String, blocking: Bool, closed: Bool) -> Bool {
        if closed { return false }
        let bytes = Array((line + "\n").utf8)
        var off = 0
        while off < bytes.count {
            let n = bytes.withUnsafeBytes { b in
                Glibc.send(
                    fd, b.baseAddress! + off, b.count - off, Int32(MSG_NOSIGNAL) | (blocking ? 0 : Int32(MSG_DONTWAIT)))
            }
            if n < 0 { if errno == EINTR { continue }; return false }
            off += n
        }
        return true
    }

    /// Sends a reply, waiting for buffer space up to the socket's send timeout, then any
    /// events that queued meanwhile.
    func send(_ line: String) -> Bool {
        let ok = writeLock.withLock { closed in write(line, blocking: true, closed: closed) }
        return drain() && ok
    }

    /// Queues an event and sends what is queued if no write is under way (else the writer
    /// sends it when it is done). False when the connection cannot take events: too many
    /// queued, or its buffer is full.
    func sendEvent(_ line: String) -> Bool { enqueue(line) && drain() }

    /// Queues a line behind those already waiting; false when the queue is full.
    func enqueue(_ line: String) -> Bool {
        pending.withLock { q -> Bool in
            guard q.count < Self.maxPending else { return false }
            q.append(line)
            return true
        }
    }

    /// Sends queued events while the write lock is free. Every holder drains after it lets
    /// go, so an event queued while the lock was taken is never left behind.
    func drain() -> Bool {
        while true {
            let done = writeLock.withLockIfAvailable { closed -> Bool in
                let lines = pending.withLock { q in
                    defer { q.removeAll() }; return q
                }
                for l in lines where !write(l, blocking: false, closed: closed) {
                    dropped.store(true, ordering: .releasing)
                    if !closed { shutdown(fd, Int32(SHUT_RDWR)) }
                    return false
                }
                return true
            }
            guard let done else { return true }
            if !done { return false }
            if pending.withLock({ $0.isEmpty }) { return true }
        }
    }

    /// Whether events could not be delivered; the reader then ends the connection.
    var isDropped: Bool { dropped.load(ordering: .acquiring) }

    /// Drops a subscriber: its reader stops; if no write is under way the socket is shut
    /// down now so the reader sees EOF (a write under way ends by its own timeout).
    func hangUp() {
        dropped.store(true, ordering: .releasing)
        _ = writeLock.withLockIfAvailable { closed in if !closed { shutdown(fd, Int32(SHUT_RDWR)) } }
    }

    /// Closes the descriptor once no write is using it.
    func close() {
        writeLock.withLock { closed in
            if !closed { Glibc.close(fd) }
            closed = true
        }
    }
}

/// Who is at the other end of a connection (SO_PEERCRED).
struct Peer: Sendable {
    let uid: uid_t
    /// Root or the mounting uid: may lock, unlock and passwd, and is never refused a slot
    /// because of what other users do.
    let privileged: Bool
}

/// Connection slots: root and the mounting uid have their own generous pool; every other
/// uid gets a small share of a separate pool, so no other user can ever use up what root
/// or the owner need, nor crowd out the other users.
final class ConnectionSlots: Sendable {
    /// Connections one unprivileged uid may hold (subscribers included).
    static let perUID = 8
    /// Connections all unprivileged uids together may hold.
    static let unprivilegedTotal = 64
    /// Connections root and the owner together may hold.
    static let privilegedTotal = 512
    private struct Counts { var byUID: [uid_t: Int] = [:]; var unprivileged = 0; var privileged = 0 }
    private let counts = Locked(Counts())

    /// Takes a slot for `peer`; false when its share is used up.
    func take(_ peer: Peer) -> Bool {
        counts.withLock { c in
            if peer.privileged {
                guard c.privileged < Self.privilegedTotal else { return false }
                c.privileged += 1
                return true
            }
            guard c.unprivileged < Self.unprivilegedTotal, c.byUID[peer.uid, default: 0] < Self.perUID else {
                return false
            }
            c.unprivileged += 1
            c.byUID[peer.uid, default: 0] += 1
            return true
        }
    }

    /// Takes a privileged slot past the limit: room was just made by closing another
    /// privileged connection, which gives its slot back when its thread ends.
    func takeOverLimit() {
        counts.withLock { $0.privileged += 1 }
    }

    /// Gives a slot back.
    func give(_ peer: Peer) {
        counts.withLock { c in
            if peer.privileged { c.privileged -= 1; return }
            c.unprivileged -= 1
            let left = c.byUID[peer.uid, default: 1] - 1
            c.byUID[peer.uid] = left > 0 ? left : nil
        }
    }
}

/// Root's and the owner's open connections, so that room can be made for a new one: a lock
/// only takes access away, and is never refused to them, even when a leaking agent of
/// theirs holds every privileged slot. A newcomer closes only a connection of its own uid
/// (root: of any privileged uid), never one serving a request; one younger than
/// `graceSeconds` (that may not have sent its request yet) only when no other is left, and a
/// subscriber only after every idle non-subscriber: the newest one (a leak is the latest
/// subscriptions; the oldest is an app's long-lived feed). Lock order: taken alone, never
/// with `ConnectionSlots.counts`.
final class PrivilegedConnections: Sendable {
    /// Seconds in which a new connection is closed for room only when no older one is left.
    static let graceSeconds = 2.0
    private struct Entry {
        let fd: Int32, uid: uid_t, connected: Double
        var lastRequest: Double, busy = false, subscribed = false
    }
    private struct Registry { var next: UInt64 = 0; var entries: [UInt64: Entry] = [:] }
    private let registry = Locked(Registry())

    /// Seconds on the monotonic clock.
    private static func now() -> Double { Double(DispatchTime.now().uptimeNanoseconds) / 1e9 }

    /// Registers a connection of `uid`; returns its id.
    func add(_ fd: Int32, uid: uid_t) -> UInt64 {
        let t = Self.now()
        return registry.withLock { r in
            r.next += 1
            r.entries[r.next] = Entry(fd: fd, uid: uid, connected: t, lastRequest: t)
            return r.next
        }
    }

    /// Connection `id` is serving a request (`true`), or has answered it.
    func serving(_ id: UInt64, _ busy: Bool, subscribed: Bool) {
        let t = Self.now()
        registry.withLock { r in
            r.entries[id]?.busy = busy
            r.entries[id]?.lastRequest = t
            if subscribed { r.entries[id]?.subscribed = true }
        }
    }

    /// Forgets connection `id`; called before its descriptor is closed, so `makeRoom`
    /// never shuts down a reused descriptor.
    func remove(_ id: UInt64) { registry.withLock { _ = $0.entries.removeValue(forKey: id) } }

    /// Shuts down one connection a newcomer of `uid` may take the place of; its thread
    /// then ends and gives its slot back. False when there is none.
    func makeRoom(for uid: uid_t) -> Bool {
        let t = Self.now()
        return registry.withLock { r in
            // Preference: older than the grace first, then idle non-subscribers (idle the
            // longest first), then subscribers (newest first).
            func rank(_ e: Entry) -> (Int, Int, Double) {
                (
                    t - e.connected < Self.graceSeconds ? 1 : 0, e.subscribed ? 1 : 0,
                    e.subscribed ? -e.connected : e.lastRequest
                )
            }
            let candidates = r.entries.filter { _, e in !e.busy && (e.uid == uid || uid == 0) }
            guard let (id, e) = candidates.min(by: { rank($0.value) < rank($1.value) }) else { return false }
            r.entries[id] = nil
            shutdown(e.fd, Int32(SHUT_RDWR))
            return true
        }
    }
}

/// The control socket: one thread per accepted client, peers identified by SO_PEERCRED
/// before any limit applies, JSON lines each way. Each connection receives into guarded
/// memory and parses requests in place (`ControlRequest`), so a passcode never exists as
/// a Swift string or Foundation object, and consumed bytes are zeroed. A silent
/// unprivileged client times out; a slow one only holds its own uid's share.
final class ControlServer: Sendable {
    let path: String
    let listenFD: Int32
    let controller: Controller
    /// Uid allowed to lock, unlock and passwd besides root.
    let ownerUID: uid_t
    private let slots = ConnectionSlots()
    private let privileged = PrivilegedConnections()
    /// Whether `start` ran, and the signal the accept thread gives when it returns.
    private let acceptRunning = Locked(false)
    private let acceptEnded = DispatchSemaphore(value: 0)
    /// Seconds a client may stay silent before it is disconnected (not subscribers).
    static let idleTimeout = 30

    /// Binds the socket (mode 0666: everyone may ask status; rights are checked per request).
    init(path: String, controller: Controller, owner: uid_t) throws {
        self.path = path
        self.controller = controller
        self.ownerUID = owner
        let dir = PathText.parent(path)
        if !dir.isEmpty {
            try? FileManager.default.createDirectory(
                atPath: dir, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o755])
        }
        if ControlServer.isLive(path) {
            throw KeybagError.invalid("control socket \(path) is in use by another daemon")
        }
        unlink(path)
        let fd = try UnixSocket.make(path: path) { bind($0, $1, $2) }
        chmod(path, 0o666)
        guard listen(fd, 512) == 0 else { let e = errno; close(fd); throw KeybagError.system("listen", e) }
        listenFD = fd
    }

    /// Whether a daemon answers on `path`.
    static func isLive(_ path: String) -> Bool {
        guard let fd = try? ControlClient.connect(path: path) else { return false }
        close(fd)
        return true
    }

    /// Starts the accept thread.
    func start() {
        acceptRunning.withLock { $0 = true }
        NamedThread.start("kbfs-control") { [self] in
            acceptLoop()
            acceptEnded.signal()
        }
    }

    /// Removes the socket file and ends the accept thread: `shutdown` makes its blocked
    /// `accept` fail (a bare `close` would leave it blocked, and the descriptor's number free
    /// for the next `open` under it); the socket is closed once the thread has returned.
    func stop() {
        unlink(path)
        shutdown(listenFD, Int32(SHUT_RDWR))
        if acceptRunning.withLock({ $0 }) { acceptEnded.wait() }
        close(listenFD)
    }

    /// Accepts clients: credentials first, then a slot from the peer's own pool, or (root
    /// and the owner) room made by closing an idle connection (`PrivilegedConnections`),
    /// or a `busy` line and an immediate close.
    private func acceptLoop() {
        while true {
            let fd = accept(listenFD, nil, nil)
            if fd >= 0 { _ = fcntl(fd, F_SETFD, FD_CLOEXEC) }
            if fd < 0 {
                if errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE {
                    usleep(10_000); continue
                }
                return
            }
            var uid: UInt32 = 0, gid: UInt32 = 0, pid: Int32 = 0
            guard kbfs_peercred(fd, &uid, &gid, &pid) == 0 else { close(fd); continue }
            let peer = Peer(uid: uid, privileged: uid == 0 || uid == ownerUID)
            if !slots.take(peer) {
                // Root and the owner are never refused: their connection idle the longest makes room.
                guard peer.privileged, privileged.makeRoom(for: peer.uid) else {
                    let refused = Connection(fd: fd)
                    // sendEvent never waits.
                    _ = refused.sendEvent(
                        ControlProtocol.encode(ControlRefusal(.busy, "too many control connections for uid \(uid)")))
                    refused.close()
                    continue
                }
                slots.takeOverLimit()
            }
            let id = peer.privileged ? privileged.add(fd, uid: peer.uid) : nil
            NamedThread.start("kbfs-client") { [self] in
                serve(Connection(fd: fd), peer, registered: id)
                slots.give(peer)
            }
        }
    }

    private static func setTimeout(_ fd: Int32, _ option: Int32, seconds: Int) {
        var tv = timeval(tv_sec: seconds, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, option, &tv, socklen_t(MemoryLayout<timeval>.size))
    }

    /// Reads request lines into guarded memory until EOF, timeout, or a line over the limit.
    /// `registered`: the connection's id among the privileged ones.
    private func serve(_ c: Connection, _ peer: Peer, registered: UInt64?) {
        defer {
            if let registered { privileged.remove(registered) }  // before the descriptor closes
            controller.events.remove(c)
            c.close()
        }
        Self.setTimeout(c.fd, SO_RCVTIMEO, seconds: Self.idleTimeout)
        Self.setTimeout(c.fd, SO_SNDTIMEO, seconds: 5)
        let capacity = ControlProtocol.maxLine + 1
        let buffer = SecureKey(zeroed: capacity)
        defer { buffer.wipe() }
        var used = 0
        var subscribed = false
        while true {
            let n: Int =
                (try? buffer.withBytes { b in
                    recv(c.fd, UnsafeMutableRawPointer(mutating: b.baseAddress!) + used, capacity - used, 0)
                }) ?? -1
            if n < 0 && errno == EINTR { continue }
            if n <= 0 {
                if n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && subscribed { continue }
                return
            }
            used += n
            while true {
                // The reply line to send; nil when nothing is sent now (a blank line, or a
                // subscribe whose reply is already queued).
                let line: (reply: String?, length: Int)?? = try? buffer.withBytes {
                    b -> (reply: String?, length: Int)? in
                    guard let nl = UnsafeRawBufferPointer(rebasing: b[0..<used]).firstIndex(of: UInt8(ascii: "\n"))
                    else { return nil }
                    let raw = UnsafeRawBufferPointer(rebasing: b[0..<nl])
                    if raw.allSatisfy({ $0 == 0x20 || $0 == 0x0D || $0 == 0x09 }) { return (nil, nl) }
                    if let registered { privileged.serving(registered, true, subscribed: false) }
                    return (handle(raw, peer: peer, connection: c, subscribed: &subscribed), nl)
                }
                guard case .some(.some(let (reply, length))) = line else { break }
                // Drop the line: move the rest to the front, zero what is left behind.
                try? buffer.withBytes { b in
                    let base = UnsafeMutableRawPointer(mutating: b.baseAddress!)
                    let rest = used - length - 1
                    if rest > 0 { memmove(base, base + length + 1, rest) }
                    sodium_memzero(base + rest, length + 1)
                    used = rest
                }
                if subscribed { Failpoint.subscribeBeforeReply.hit() }
                if let reply {
                    guard c.send(reply), !c.isDropped else { return }
                } else if subscribed {
                    // A subscribe: its reply is queued; send it (and what followed) now.
                    guard c.drain(), !c.isDropped else { return }
                }
                if let registered { privileged.serving(registered, false, subscribed: subscribed) }
            }
            if used == capacity {
                _ = c.send(ControlProtocol.encode(ControlRefusal(.badRequest, "line longer than 64 KiB")))
                return
            }
        }
    }

    /// Answers one request line: the reply line, or nil for a subscribe (its reply is queued).
    private func handle(
        _ raw: UnsafeRawBufferPointer, peer: Peer, connection: Connection, subscribed: inout Bool
    ) -> String? {
        let req: ControlRequest
        switch ControlRequest.parsed(raw) {
        case .failure(let refusal): return ControlProtocol.encode(refusal)
        case .success(let r): req = r
        }
        defer { req.wipe() }
        let command: ControlCommand
        switch req.operation() {
        case .failure(let refusal): return ControlProtocol.encode(refusal)
        case .success(let op):
            if let refusal = op.refusalForOthers, !peer.privileged { return ControlProtocol.encode(refusal) }
            switch req.command(op) {
            case .failure(let refusal): return ControlProtocol.encode(refusal)
            case .success(let c): command = c
            }
        }
        switch command {
        case .status:
            return ControlProtocol.encode(controller.status())
        case .subscribe:
            // Joining the hub, reading the state and queueing the reply happen in one step:
            // every event published after the state was read follows the reply.
            subscribed = true
            Self.setTimeout(connection.fd, SO_RCVTIMEO, seconds: 0)
            controller.events.subscribe(connection) { ControlProtocol.encode(StateReply(controller.state)) }
            return nil
        case .policy:
            return ControlProtocol.encode(controller.policy())
        case .unlock(let passcode):
            return Self.encode(controller.unlock(passcode: passcode))
        case .passwd(let old, let new):
            return Self.encode(controller.passwd(old: old, new: new))
        case .lock(let grace):
            return ControlProtocol.encode(controller.lock(grace: grace))
        }
    }

    /// A reply or refusal as its line.
    private static func encode<T: Encodable>(_ result: Result<T, ControlRefusal>) -> String {
        switch result {
        case .success(let reply): return ControlProtocol.encode(reply)
        case .failure(let refusal): return ControlProtocol.encode(refusal)
        }
    }
}
