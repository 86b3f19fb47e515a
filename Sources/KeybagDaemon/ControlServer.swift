import CFuse
import CSodium
import CSystem
import Foundation
import Glibc
import KeybagCore
import Synchronization

/// One client connection of the control socket; writes are serialised.
final class Connection: Sendable {
    let fd: Int32
    private let writeLock = Locked(0)
    init(fd: Int32) { self.fd = fd }

    /// Sends one line; non-blocking sends give up instead of waiting on a full buffer.
    func send(_ line: String, blocking: Bool) -> Bool {
        let bytes = Array((line + "\n").utf8)
        return writeLock.withLock { _ in
            var off = 0
            while off < bytes.count {
                let n = bytes.withUnsafeBytes { b in
                    Glibc.send(fd, b.baseAddress! + off, b.count - off, Int32(MSG_NOSIGNAL) | (blocking ? 0 : Int32(MSG_DONTWAIT)))
                }
                if n < 0 { if errno == EINTR { continue }; return false }
                off += n
            }
            return true
        }
    }

    /// Shuts the socket down so the reader thread sees EOF and closes it.
    func hangUp() { shutdown(fd, Int32(SHUT_RDWR)) }
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
            guard c.unprivileged < Self.unprivilegedTotal, c.byUID[peer.uid, default: 0] < Self.perUID else { return false }
            c.unprivileged += 1
            c.byUID[peer.uid, default: 0] += 1
            return true
        }
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
    /// Seconds a client may stay silent before it is disconnected (not subscribers).
    static let idleTimeout = 30

    /// Binds the socket (mode 0666: everyone may ask status; rights are checked per request).
    init(path: String, controller: Controller) throws {
        self.path = path
        self.controller = controller
        self.ownerUID = getuid()
        let dir = (path as NSString).deletingLastPathComponent
        if !dir.isEmpty { try? FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o755]) }
        if ControlServer.isLive(path) { throw KeybagError.invalid("control socket \(path) is in use by another daemon") }
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
        let t = Thread { [self] in acceptLoop() }
        t.name = "keybagfs-control"
        t.start()
    }

    /// Removes the socket file.
    func stop() {
        unlink(path)
        close(listenFD)
    }

    /// Accepts clients: credentials first, then a slot from the peer's own pool, or a
    /// `busy` line and an immediate close.
    private func acceptLoop() {
        while true {
            let fd = accept(listenFD, nil, nil)
            if fd >= 0 { _ = fcntl(fd, F_SETFD, FD_CLOEXEC) }
            if fd < 0 {
                if errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE { usleep(10_000); continue }
                return
            }
            var uid: UInt32 = 0, gid: UInt32 = 0, pid: Int32 = 0
            guard kbfs_peercred(fd, &uid, &gid, &pid) == 0 else { close(fd); continue }
            let peer = Peer(uid: uid, privileged: uid == 0 || uid == ownerUID)
            guard slots.take(peer) else {
                _ = Connection(fd: fd).send(ControlProtocol.encode(Controller.refusal("busy", "too many control connections for uid \(uid)")), blocking: false)
                close(fd)
                continue
            }
            let t = Thread { [self] in
                serve(Connection(fd: fd), peer)
                slots.give(peer)
            }
            t.start()
        }
    }

    private static func setTimeout(_ fd: Int32, _ option: Int32, seconds: Int) {
        var tv = timeval(tv_sec: seconds, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, option, &tv, socklen_t(MemoryLayout<timeval>.size))
    }

    /// Reads request lines into guarded memory until EOF, timeout, or a line over the limit.
    private func serve(_ c: Connection, _ peer: Peer) {
        defer { controller.events.remove(c); close(c.fd) }
        Self.setTimeout(c.fd, SO_RCVTIMEO, seconds: Self.idleTimeout)
        Self.setTimeout(c.fd, SO_SNDTIMEO, seconds: 5)
        let capacity = ControlProtocol.maxLine + 1
        let buffer = SecureKey(zeroed: capacity)
        defer { buffer.wipe() }
        var used = 0
        var subscribed = false
        while true {
            let n: Int = (try? buffer.withBytes { b in recv(c.fd, UnsafeMutableRawPointer(mutating: b.baseAddress!) + used, capacity - used, 0) }) ?? -1
            if n < 0 && errno == EINTR { continue }
            if n <= 0 {
                if n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && subscribed { continue }
                return
            }
            used += n
            while true {
                let line: (reply: [String: Any], length: Int)?? = try? buffer.withBytes { b -> (reply: [String: Any], length: Int)? in
                    guard let nl = UnsafeRawBufferPointer(rebasing: b[0..<used]).firstIndex(of: UInt8(ascii: "\n")) else { return nil }
                    let raw = UnsafeRawBufferPointer(rebasing: b[0..<nl])
                    if raw.allSatisfy({ $0 == 0x20 || $0 == 0x0D || $0 == 0x09 }) { return ([:], nl) }
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
                if reply.isEmpty { continue }
                guard c.send(ControlProtocol.encode(reply), blocking: true) else { return }
                if subscribed {
                    controller.events.add(c)
                    Self.setTimeout(c.fd, SO_RCVTIMEO, seconds: 0)
                }
            }
            if used == capacity {
                _ = c.send(ControlProtocol.encode(Controller.refusal("badRequest", "line longer than 64 KiB")), blocking: true)
                return
            }
        }
    }

    /// Answers one request line.
    private func handle(_ raw: UnsafeRawBufferPointer, peer: Peer, connection: Connection, subscribed: inout Bool) -> [String: Any] {
        let req: ControlRequest
        do { req = try ControlRequest.parse(raw) } catch {
            return Controller.refusal("badRequest", "not a flat JSON object: \(error)")
        }
        defer { req.wipe() }
        guard let op = req.op else { return Controller.refusal("badRequest", "missing \"op\"") }
        switch op {
        case "status":
            return controller.status()
        case "subscribe":
            subscribed = true
            return ["ok": true, "state": controller.state.rawValue]
        case "unlock", "lock", "passwd":
            guard peer.privileged else { return Controller.refusal("forbidden", "only root and the mounting user may \(op)") }
            if op == "unlock" {
                guard let p = req.secrets["passcode"] else { return Controller.refusal("badRequest", "unlock needs a non-empty \"passcode\" string") }
                return controller.unlock(passcode: p)
            }
            if op == "passwd" {
                guard let o = req.secrets["old"], let n = req.secrets["new"] else {
                    return Controller.refusal("badRequest", "passwd needs non-empty \"old\" and \"new\" strings")
                }
                return controller.passwd(old: o, new: n)
            }
            var grace: Double? = nil
            if let g = req.fields["grace"] {
                guard case .number(let d) = g, d >= 0, d < 86_400 else {
                    return Controller.refusal("badRequest", "\"grace\" must be a number of seconds from 0 to 86400")
                }
                grace = d
            }
            return controller.lock(grace: grace)
        default:
            return Controller.refusal("badRequest", "unknown op \"\(op)\"")
        }
    }
}
