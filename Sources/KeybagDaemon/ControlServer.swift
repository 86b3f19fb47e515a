import CFuse
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

/// The control socket: one thread per client (bounded), JSON lines each way, peers
/// identified by SO_PEERCRED. A silent client times out; a slow one only holds its thread.
final class ControlServer: Sendable {
    let path: String
    let listenFD: Int32
    let controller: Controller
    /// Uid allowed to lock, unlock and passwd besides root.
    let ownerUID: uid_t
    private let clients = Atomic<Int>(0)
    static let maxClients = 64
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
        guard listen(fd, 64) == 0 else { let e = errno; close(fd); throw KeybagError.system("listen", e) }
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

    private func acceptLoop() {
        while true {
            var peer = sockaddr_un()
            var plen = socklen_t(MemoryLayout<sockaddr_un>.size)
            let fd = withUnsafeMutablePointer(to: &peer) { p in
                p.withMemoryRebound(to: sockaddr.self, capacity: 1) { accept(listenFD, $0, &plen) }
            }
            if fd >= 0 { _ = fcntl(fd, F_SETFD, FD_CLOEXEC) }
            if fd < 0 {
                if errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE { usleep(10_000); continue }
                return
            }
            if clients.load(ordering: .relaxed) >= Self.maxClients {
                let c = Connection(fd: fd)
                _ = c.send(ControlProtocol.encode(Controller.refusal("busy", "too many control connections")), blocking: false)
                close(fd)
                continue
            }
            clients.add(1, ordering: .relaxed)
            let t = Thread { [self] in
                serve(Connection(fd: fd))
                clients.subtract(1, ordering: .relaxed)
            }
            t.start()
        }
    }

    private static func setTimeout(_ fd: Int32, _ option: Int32, seconds: Int) {
        var tv = timeval(tv_sec: seconds, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, option, &tv, socklen_t(MemoryLayout<timeval>.size))
    }

    /// Reads request lines until EOF, timeout, or a line over the limit.
    private func serve(_ c: Connection) {
        defer { controller.events.remove(c); close(c.fd) }
        var uid: UInt32 = 0, gid: UInt32 = 0, pid: Int32 = 0
        let privileged = kbfs_peercred(c.fd, &uid, &gid, &pid) == 0 && (uid == 0 || uid == ownerUID)
        Self.setTimeout(c.fd, SO_RCVTIMEO, seconds: Self.idleTimeout)
        Self.setTimeout(c.fd, SO_SNDTIMEO, seconds: 5)
        var pending: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 4096)
        var subscribed = false
        while true {
            let n = recv(c.fd, &chunk, chunk.count, 0)
            if n < 0 && errno == EINTR { continue }
            if n <= 0 {
                if n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && subscribed { continue }
                return
            }
            pending += chunk[0..<n]
            while let nl = pending.firstIndex(of: UInt8(ascii: "\n")) {
                let line = String(decoding: pending[..<nl], as: UTF8.self)
                pending.removeSubrange(...nl)
                if line.utf8.count > ControlProtocol.maxLine {
                    _ = c.send(ControlProtocol.encode(Controller.refusal("badRequest", "line longer than 64 KiB")), blocking: true)
                    return
                }
                if line.allSatisfy({ $0 == " " || $0 == "\r" || $0 == "\t" }) { continue }
                let reply = handle(line, privileged: privileged, connection: c, subscribed: &subscribed)
                guard c.send(ControlProtocol.encode(reply), blocking: true) else { return }
                if subscribed {
                    controller.events.add(c)
                    Self.setTimeout(c.fd, SO_RCVTIMEO, seconds: 0)
                }
            }
            if pending.count > ControlProtocol.maxLine {
                _ = c.send(ControlProtocol.encode(Controller.refusal("badRequest", "line longer than 64 KiB")), blocking: true)
                return
            }
        }
    }

    /// Copies a passcode field into guarded memory.
    private static func secret(_ request: [String: Any], _ field: String) -> SecureKey? {
        guard let s = request[field] as? String, !s.isEmpty else { return nil }
        let bytes = Array(s.utf8)
        return SecureKey(count: bytes.count) { out in out.copyBytes(from: bytes) }
    }

    /// Answers one request line.
    private func handle(_ line: String, privileged: Bool, connection: Connection, subscribed: inout Bool) -> [String: Any] {
        guard let req = ControlProtocol.decode(line) else { return Controller.refusal("badRequest", "not a JSON object") }
        guard let op = req["op"] as? String else { return Controller.refusal("badRequest", "missing \"op\"") }
        switch op {
        case "status":
            return controller.status()
        case "subscribe":
            subscribed = true
            return ["ok": true, "state": controller.state.rawValue]
        case "unlock", "lock", "passwd":
            guard privileged else { return Controller.refusal("forbidden", "only root and the mounting user may \(op)") }
            if op == "unlock" {
                guard let p = Self.secret(req, "passcode") else { return Controller.refusal("badRequest", "unlock needs a non-empty \"passcode\"") }
                defer { p.wipe() }
                return controller.unlock(passcode: p)
            }
            if op == "passwd" {
                guard let o = Self.secret(req, "old"), let n = Self.secret(req, "new") else {
                    return Controller.refusal("badRequest", "passwd needs non-empty \"old\" and \"new\"")
                }
                defer { o.wipe(); n.wipe() }
                return controller.passwd(old: o, new: n)
            }
            var grace: Double? = nil
            if let g = req["grace"] {
                guard let d = (g as? NSNumber)?.doubleValue, d >= 0, d.isFinite, d < 86_400 else {
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
