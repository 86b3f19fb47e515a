import Glibc

/// A failure of the control socket client: a system call, or a path it cannot use.
public struct ControlSocketError: Error, CustomStringConvertible, Equatable {
    /// What failed.
    public let what: String
    /// The errno, or 0.
    public let code: Int32

    public var description: String { code == 0 ? what : "\(what): \(String(cString: strerror(code)))" }
}

/// A Unix stream socket bound or connected to a path.
public enum UnixSocket {
    /// A new stream socket (close-on-exec) and the address of `path`, passed to `body`
    /// (`bind` or `connect`); the socket is closed again when `body` fails.
    public static func make(path: String, _ body: (Int32, UnsafePointer<sockaddr>, socklen_t) -> Int32) throws -> Int32
    {
        var addr = sockaddr_un()
        addr.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        guard bytes.count < MemoryLayout.size(ofValue: addr.sun_path) else {
            throw ControlSocketError(what: "socket path too long: \(path)", code: 0)
        }
        withUnsafeMutableBytes(of: &addr.sun_path) { p in for (i, b) in bytes.enumerated() { p[i] = b } }
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw ControlSocketError(what: "socket", code: errno) }
        let rc = withUnsafePointer(to: &addr) {
            body(
                fd, UnsafeRawPointer($0).assumingMemoryBound(to: sockaddr.self),
                socklen_t(MemoryLayout<sockaddr_un>.size))
        }
        guard rc == 0 else { let e = errno; close(fd); throw ControlSocketError(what: path, code: e) }
        return fd
    }
}

/// A minimal client of the control socket: connect, send a line, read a line.
public enum ControlClient {
    /// Connects to a Unix socket; throws with errno when nothing listens.
    public static func connect(path: String) throws -> Int32 {
        try UnixSocket.make(path: path) { Glibc.connect($0, $1, $2) }
    }

    /// Writes one line (a newline is appended).
    public static func sendLine(_ fd: Int32, _ line: String) throws {
        let bytes = Array((line + "\n").utf8)
        var off = 0
        while off < bytes.count {
            let n = bytes.withUnsafeBytes { send(fd, $0.baseAddress! + off, bytes.count - off, Int32(MSG_NOSIGNAL)) }
            if n < 0 { if errno == EINTR { continue }; throw ControlSocketError(what: "send", code: errno) }
            off += n
        }
    }

    /// Reads bytes up to a newline; nil at EOF before one.
    public static func readLine(_ fd: Int32, buffer: inout [UInt8]) -> String? {
        var chunk = [UInt8](repeating: 0, count: 4096)
        while true {
            if let nl = buffer.firstIndex(of: UInt8(ascii: "\n")) {
                let line = String(decoding: buffer[..<nl], as: UTF8.self)
                buffer.removeSubrange(...nl)
                return line
            }
            let n = recv(fd, &chunk, chunk.count, 0)
            if n < 0 && errno == EINTR { continue }
            if n <= 0 { return nil }
            buffer += chunk[0..<n]
        }
    }
}
