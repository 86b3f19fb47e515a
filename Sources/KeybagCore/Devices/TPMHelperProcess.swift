import CTPM
import Foundation
import Glibc

/// Seal and unseal in a short-lived child process (`keybagfs tpm2 helper`). tpm2-tss keeps
/// copies of the authorization value and of the unsealed secret in memory it frees without
/// wiping (its session and resource records), and a daemon's memory must hold neither after
/// a lock; so the daemon hands each such operation to a process whose memory ends with it.
/// The authorization goes to the child and the secret comes back through a pipe, written
/// from and read into guarded memory, never through the daemon's heap.
///
/// Frames (little-endian; each part a u32 length and its bytes): request `op(1) ‖ tcti ‖ pin ‖
/// a ‖ b ‖ auth ‖ nvAuth ‖ epoch(u32) ‖ bound(u64) ‖ pcrs(u32)` (`unseal`: a, b the public and private
/// blobs; `seal`: a the secret, b empty; pin: the TPM's primary name, or empty); reply
/// `i32 code ‖ message ‖ p ‖ q` (`unseal`: p the secret; `seal`: p, q the blobs).
public struct TPMHelperProcess: Sendable {
    /// The keybagfs binary that answers `tpm2 helper`.
    public let executable: String

    public init(executable: String) { self.executable = executable }

    /// Operation bytes.
    static let opUnseal: UInt8 = 1, opSeal: UInt8 = 2

    /// Where the TPM is and which object's epoch applies.
    struct Target {
        let tcti: String, pin: [UInt8], epoch: UInt32, bound: UInt64, nvAuth: SecureKey
        /// The PCRs the object is bound to (bit i: PCR i; 0: none).
        var pcrs: UInt32 = 0
    }

    /// The secret the TPM of `target` releases for `auth`.
    func unseal(_ target: Target, public pub: [UInt8], private priv: [UInt8], auth: SecureKey) throws -> SecureKey {
        try exchange(op: Self.opUnseal, target, a: .plain(pub), b: .plain(priv), auth: auth) { fd in
            let n = try Self.readLength(fd)
            guard n == 32 else { throw TPMError.failed("the helper returned \(n) bytes, not a 32-byte secret") }
            return try SecureKey(count: 32) { out in try Self.readExactly(fd, out.baseAddress!, 32) }
        }
    }

    /// `secret` sealed under `auth` in the TPM of `target`: the blobs.
    func seal(_ target: Target, secret: SecureKey, auth: SecureKey) throws -> (public: [UInt8], private: [UInt8]) {
        try exchange(op: Self.opSeal, target, a: .secret(secret), b: .plain([]), auth: auth) { fd in
            (try Self.readBlob(fd), try Self.readBlob(fd))
        }
    }

    /// A request part: plain bytes, or bytes in guarded memory.
    private enum Part { case plain([UInt8]), secret(SecureKey) }

    /// Writes one request to the helper: op, TCTI, pin, the two parts, the authorizations,
    /// the epoch and its bound.
    private static func writeRequest(_ fd: Int32, op: UInt8, _ target: Target, a: Part, b: Part, auth: SecureKey)
        throws
    {
        var head: [UInt8] = [op]
        appendBlob(&head, Array(target.tcti.utf8))
        appendBlob(&head, target.pin)
        try writeAll(fd, head)
        for part in [a, b] {
            switch part {
            case .plain(let bytes): try writeAll(fd, length(bytes.count) + bytes)
            case .secret(let key): try writeSecret(fd, key)
            }
        }
        try writeSecret(fd, auth)
        try writeSecret(fd, target.nvAuth)
        var tail: [UInt8] = []
        withUnsafeBytes(of: target.epoch.littleEndian) { tail += $0 }
        withUnsafeBytes(of: target.bound.littleEndian) { tail += $0 }
        withUnsafeBytes(of: target.pcrs.littleEndian) { tail += $0 }
        try writeAll(fd, tail)
    }

    /// Starts the helper, writes the request, reads the reply with `payload` after the
    /// code and message, and reaps the child.
    private func exchange<R>(
        op: UInt8, _ target: Target, a: Part, b: Part, auth: SecureKey, payload: (Int32) throws -> R
    ) throws -> R {
        // A helper that ends early must give this process EPIPE, not SIGPIPE (its default kills).
        signal(SIGPIPE, SIG_IGN)
        var toChild: [Int32] = [0, 0], fromChild: [Int32] = [0, 0]
        guard pipe(&toChild) == 0 else { throw KeybagError.system("pipe", errno) }
        guard pipe(&fromChild) == 0 else {
            close(toChild[0]); close(toChild[1]); throw KeybagError.system("pipe", errno)
        }
        // Not inherited by anything else this process starts (dup2 in the child clears it).
        for fd in toChild + fromChild { _ = fcntl(fd, F_SETFD, FD_CLOEXEC) }
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_adddup2(&actions, toChild[0], 0)
        posix_spawn_file_actions_adddup2(&actions, fromChild[1], 1)
        let words: [String] = [executable, "tpm2", "helper"]
        let argv: [UnsafeMutablePointer<CChar>?] = words.map { strdup($0) } + [nil]
        defer { argv.forEach { free($0) } }
        var pid: pid_t = 0
        let rc = posix_spawn(&pid, executable, &actions, nil, argv, environ)
        close(toChild[0])
        close(fromChild[1])
        defer {
            close(fromChild[0])
            if rc == 0 { var status: Int32 = 0; while waitpid(pid, &status, 0) < 0 && errno == EINTR {} }
        }
        guard rc == 0 else {
            close(toChild[1]);
            throw TPMError.failed("cannot start \(executable) tpm2 helper: \(String(cString: strerror(rc)))")
        }
        let sent: Bool
        do {
            defer { close(toChild[1]) }
            try Self.writeRequest(toChild[1], op: op, target, a: a, b: b, auth: auth)
            sent = true
        } catch { sent = false }
        let fd = fromChild[0]
        guard let code = try? Self.readInt32(fd) else {
            throw TPMError.failed(
                sent ? "the TPM helper ended without an answer" : "the TPM helper did not take the request")
        }
        let message = String(decoding: try Self.readBlob(fd), as: UTF8.self)
        guard code == 0 else { throw TPMError(code: code, message: message) }
        return try payload(fd)
    }

    // MARK: the child's side

    /// Answers one request on stdin/stdout with the TPM in this process (`keybagfs tpm2 helper`).
    public static func serve() -> Int32 {
        var reply: [UInt8] = []
        func answer(_ code: Int32, _ message: String, _ parts: [[UInt8]]) {
            withUnsafeBytes(of: code.littleEndian) { reply += $0 }
            appendBlob(&reply, Array(message.utf8))
            for p in parts { appendBlob(&reply, p) }
        }
        do {
            var op: UInt8 = 0
            try readExactly(0, &op, 1)
            let tcti = String(decoding: try readBlob(0), as: UTF8.self), pin = try readBlob(0)
            let a = try readSecret(0), b = try readBlob(0), auth = try readSecret(0), nvAuth = try readSecret(0)
            defer { a.wipe(); auth.wipe(); nvAuth.wipe() }
            var epoch: UInt32 = 0, bound: UInt64 = 0, pcrs: UInt32 = 0
            try readExactly(0, &epoch, 4)
            try readExactly(0, &bound, 8)
            try readExactly(0, &pcrs, 4)
            epoch = UInt32(littleEndian: epoch)
            bound = UInt64(littleEndian: bound)
            pcrs = UInt32(littleEndian: pcrs)
            let tpm = try TPMConnection(tcti: tcti, pinned: pin.isEmpty ? nil : pin)
            switch op {
            case opUnseal:
                let secret = try tpm.unseal(
                    public: try a.withBytes { Array($0) }, private: b, auth: auth, epoch: epoch, nvAuth: nvAuth,
                    bound: bound, pcrs: pcrs)
                defer { secret.wipe() }
                try writeAll(1, [0, 0, 0, 0] + length(0))
                try writeSecret(1, secret)
                return 0
            case opSeal:
                let (pub, priv) = try tpm.seal(a, auth: auth, epoch: epoch, nvAuth: nvAuth, bound: bound, pcrs: pcrs)
                answer(0, "", [pub, priv])
            default:
                answer(Int32(KBFS_TPM_ERROR), "unknown helper operation \(op)", [])
            }
        } catch let e as TPMError {
            answer(e.code, "\(e)", [])
        } catch {
            answer(Int32(KBFS_TPM_ERROR), "\(error)", [])
        }
        return (try? writeAll(1, reply)) == nil ? 1 : 0
    }

    // MARK: frames

    static func length(_ n: Int) -> [UInt8] { withUnsafeBytes(of: UInt32(n).littleEndian) { Array($0) } }

    static func appendBlob(_ out: inout [UInt8], _ b: [UInt8]) { out += length(b.count) + b }

    static func writeAll(_ fd: Int32, _ bytes: [UInt8]) throws {
        try bytes.withUnsafeBytes { try writeAll(fd, $0.baseAddress!, $0.count) }
    }

    static func writeAll(_ fd: Int32, _ p: UnsafeRawPointer, _ n: Int) throws {
        var off = 0
        while off < n {
            let w = write(fd, p + off, n - off)
            if w < 0 && errno == EINTR { continue }
            guard w > 0 else { throw KeybagError.system("TPM helper pipe", errno) }
            off += w
        }
    }

    /// Writes a length and the key's bytes straight from guarded memory.
    static func writeSecret(_ fd: Int32, _ key: SecureKey) throws {
        try writeAll(fd, length(key.count))
        try key.withBytes { try writeAll(fd, $0.baseAddress!, $0.count) }
    }

    static func readExactly(_ fd: Int32, _ p: UnsafeMutableRawPointer, _ n: Int) throws {
        var off = 0
        while off < n {
            let r = read(fd, p + off, n - off)
            if r < 0 && errno == EINTR { continue }
            guard r > 0 else { throw KeybagError.system("TPM helper pipe", r == 0 ? EPIPE : errno) }
            off += r
        }
    }

    static func readLength(_ fd: Int32) throws -> Int {
        var v: UInt32 = 0
        try readExactly(fd, &v, 4)
        let n = Int(UInt32(littleEndian: v))
        guard n <= 1 << 16 else { throw TPMError.failed("TPM helper frame too long") }
        return n
    }

    static func readInt32(_ fd: Int32) throws -> Int32 {
        var v: Int32 = 0
        try readExactly(fd, &v, 4)
        return Int32(littleEndian: v)
    }

    static func readBlob(_ fd: Int32) throws -> [UInt8] {
        let n = try readLength(fd)
        var b = [UInt8](repeating: 0, count: n)
        if n > 0 { try b.withUnsafeMutableBytes { try readExactly(fd, $0.baseAddress!, n) } }
        return b
    }

    /// A length-prefixed part read straight into guarded memory.
    static func readSecret(_ fd: Int32) throws -> SecureKey {
        let n = try readLength(fd)
        return try SecureKey(count: max(n, 0)) { out in if n > 0 { try readExactly(fd, out.baseAddress!, n) } }
    }
}
