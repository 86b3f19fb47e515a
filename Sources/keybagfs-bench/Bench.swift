import CSodium
import CSystem
import Foundation
import Glibc
import KeybagCore
import KeybagProtocol

/// `keybagfs-bench`: micro-benchmarks of the block crypto path and the lock latency of a
/// live mount. A release executable for people, not run in CI.
@main
enum Bench {
    static func main() {
        let args = Array(CommandLine.arguments.dropFirst())
        switch args.first {
        case "crypto": crypto()
        case "lock-latency" where args.count >= 3:
            lockLatency(mount: args[1], socket: args[2], files: args.count > 3 ? Int(args[3]) ?? 10_000 : 10_000)
        default:
            print(
                """
                usage: keybagfs-bench crypto
                       keybagfs-bench lock-latency MOUNTPOINT SOCKET [FILES]   (mount unlocked, grace irrelevant)
                """)
            exit(2)
        }
    }

    /// libsodium's AES-256-GCM with a precomputed state, as keybagfs used it before OpenSSL:
    /// the comparison row of the cipher table.
    static func sodiumAESGCM(mib: Int, plain: [UInt8]) {
        guard crypto_aead_aes256gcm_is_available() == 1 else { return }
        var state = crypto_aead_aes256gcm_state()
        let key = Sodium.randomArray(32), nonce = Sodium.randomArray(12), ad = Sodium.randomArray(24)
        _ = crypto_aead_aes256gcm_beforenm(&state, key)
        var sealed = [UInt8](repeating: 0, count: 4096 + 16), out = [UInt8](repeating: 0, count: 4096)
        var len: UInt64 = 0
        let blocks = mib * 256
        let tSeal = best(3) {
            for _ in 0..<blocks {
                _ = crypto_aead_aes256gcm_encrypt_afternm(&sealed, &len, plain, 4096, ad, 24, nil, nonce, &state)
            }
        }
        let tOpen = best(3) {
            for _ in 0..<blocks {
                _ = crypto_aead_aes256gcm_decrypt_afternm(&out, &len, nil, sealed, 4096 + 16, ad, 24, nonce, &state)
            }
        }
        print(
            String(
                format:
                    "%-18@ seal %7.0f MB/s   open %7.0f MB/s   (libsodium 1.0.18, precomputed state: before OpenSSL)",
                "aes256gcm-sodium" as NSString, Double(mib) * 1.048576 / tSeal, Double(mib) * 1.048576 / tOpen))
        sodium_memzero(&state, MemoryLayout<crypto_aead_aes256gcm_state>.size)
    }

    /// Seconds of a closure, best of `rounds`.
    static func best(_ rounds: Int, _ body: () throws -> Void) rethrows -> Double {
        var b = Double.infinity
        for _ in 0..<rounds {
            let t0 = DispatchTime.now().uptimeNanoseconds
            try body()
            b = min(b, Double(DispatchTime.now().uptimeNanoseconds - t0) / 1e9)
        }
        return b
    }

    /// Seal/open throughput of 4 KiB blocks for both ciphers, header creation, the unlock
    /// KDF and name encryption.
    static func crypto() {
        Sodium.ensureInitialized()
        HardwareAES.start()
        let mib = 256
        let plain = [UInt8](repeating: 0x61, count: 4096)
        contentCiphers(mib: mib, plain: plain)
        sodiumAESGCM(mib: mib, plain: plain)
        headers(n: 20_000)
        unlockKDF()
        names(n: 20_000)
    }

    /// Seal and open throughput of each content cipher, 4 KiB blocks.
    static func contentCiphers(mib: Int, plain: [UInt8]) {
        for cipher in ContentCipher.allCases where cipher.isAvailable {
            let key = try! FileContentKey(
                key: SecureKey(random: 32), cipher: cipher, fileID: Sodium.randomArray(16), sealsEnd: true)
            var sealed = [UInt8](repeating: 0, count: 4096 + BlockLayout(cipher: cipher).overhead)
            var out = [UInt8](repeating: 0, count: 4096)
            let blocks = mib * 256
            let tSeal = best(3) {
                plain.withUnsafeBytes { p in
                    sealed.withUnsafeMutableBytes { s in
                        for b in 0..<blocks { try! key.seal(p, block: UInt64(b), last: false, into: s) }
                    }
                }
            }
            plain.withUnsafeBytes { p in
                sealed.withUnsafeMutableBytes { s in try! key.seal(p, block: 0, last: false, into: s) }
            }
            let tOpen = best(3) {
                sealed.withUnsafeBytes { s in
                    out.withUnsafeMutableBytes { o in
                        for _ in 0..<blocks { _ = try! key.open(s, block: 0, last: false, into: o) }
                    }
                }
            }
            print(
                String(
                    format: "%-18@ seal %7.0f MB/s   open %7.0f MB/s   (4 KiB blocks, %d MiB, best of 3)",
                    cipher.name as NSString, Double(mib) * 1.048576 / tSeal, Double(mib) * 1.048576 / tOpen, mib))
        }
    }

    /// File header creation (class C and class B) and unwrapping, `n` each.
    static func headers(n: Int) {
        let classKey = SecureKey(random: 32)
        let bs = SecureKey(random: 32)
        let bp = try! ClassBAgreement.publicKey(of: bs)
        let tC = best(3) {
            for _ in 0..<n {
                _ = try! FileHeader.create(
                    fileKey: SecureKey(random: 32), class: .completeUntilFirstUserAuthentication, cipher: .default,
                    using: .symmetric(classKey))
            }
        }
        let tB = best(3) {
            for _ in 0..<(n / 10) {
                _ = try! FileHeader.create(
                    fileKey: SecureKey(random: 32), class: .completeUnlessOpen, cipher: .default,
                    using: .classBPublic(bp))
            }
        }
        let h = try! FileHeader.create(
            fileKey: SecureKey(random: 32), class: .complete, cipher: .default, using: .symmetric(classKey))
        let tU = best(3) {
            for _ in 0..<n { _ = try! FileContentKey(key: try! h.unwrap(using: .symmetric(classKey)), header: h) }
        }
        print(
            String(
                format: "header create class C %.1f µs, class B (X25519) %.1f µs; unwrap + cipher key setup %.1f µs",
                tC / Double(n) * 1e6, tB / Double(n / 10) * 1e6, tU / Double(n) * 1e6))
    }

    /// The unlock KDF alone (Argon2id, `--kdf interactive`), to split unlock latency.
    static func unlockKDF() {
        let salt = Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))
        var stretched = [UInt8](repeating: 0, count: 32)
        let tK = best(3) {
            _ = crypto_pwhash(
                &stretched, 32, "benchmark passcode", 18, salt,
                KDFStrength.interactive.opsLimit, Int(KDFStrength.interactive.memLimit), crypto_pwhash_ALG_ARGON2ID13)
        }
        print(String(format: "Argon2id interactive (unlock KDF) %.1f ms", tK * 1e3))
    }

    /// Names: a typical 20-byte source file name and a 200-byte one (hashed long-name path).
    static func names(n: Int) {
        let names = try! NameCipher(volumeKey: SecureKey(random: 32))
        let iv = Sodium.randomArray(16)
        for length in [20, 200] {
            let name = Array(String(repeating: "n", count: length - 2).utf8) + Array(".c".utf8)
            let stored = try! names.encrypt(name, dirIV: iv)
            let tE = best(3) { for _ in 0..<n { _ = try! names.encrypt(name, dirIV: iv) } }
            let tD = best(3) { for _ in 0..<n { _ = try! names.decrypt(stored, dirIV: iv) } }
            print(
                String(
                    format: "name of %d bytes: encrypt %.2f µs, decrypt %.2f µs (stored as %d characters)",
                    length, tE / Double(n) * 1e6, tD / Double(n) * 1e6, stored.utf8.count))
        }
    }

    /// One request on the control socket: its reply line and round-trip time in ms.
    static func request(_ socket: String, _ call: ControlCall) -> (String, Double) {
        let fd = try! ControlClient.connect(path: socket)
        defer { close(fd) }
        let t0 = DispatchTime.now().uptimeNanoseconds
        try! ControlClient.sendLine(fd, call.line)
        var buf: [UInt8] = []
        let line = ControlClient.readLine(fd, buffer: &buf) ?? "{}"
        let ms = Double(DispatchTime.now().uptimeNanoseconds - t0) / 1e6
        return (line, ms)
    }

    /// The state a reply line gives, or the line itself.
    static func stateShown(_ line: String) -> String {
        ControlProtocol.decode(StateReply.self, from: line)?.state.rawValue ?? line
    }

    /// RSS of a process in KiB.
    static func rssKiB(_ pid: Int) -> Int {
        let s = ProcFile.read("/proc/\(pid)/status") ?? ""
        let line = s.split(separator: "\n").first { $0.hasPrefix("VmRSS:") } ?? ""
        return Int(line.split(separator: " ").dropFirst().first ?? "0") ?? 0
    }

    /// Opens `files` class A files (page cache warm), then times lock --grace 0 and unlock.
    static func lockLatency(mount: String, socket: String, files: Int) {
        _ = kbfs_raise_nofile()
        let dir = mount + "/lock-latency-\(getpid())"
        mkdir(dir, 0o755)
        let v = Array("complete".utf8)
        guard setxattr(dir, "user.protection", v, v.count, 0) == 0 else {
            print("setxattr failed: is the mount unlocked?"); exit(1)
        }
        let block = [UInt8](repeating: 0x42, count: 4096)
        var fds: [Int32] = []
        var scratch = [UInt8](repeating: 0, count: 4096)
        for i in 0..<files {
            let fd = open("\(dir)/f\(i)", O_RDWR | O_CREAT, 0o644)
            guard fd >= 0 else { print("open failed at \(i): \(String(cString: strerror(errno)))"); exit(1) }
            _ = pwrite(fd, block, block.count, 0)
            _ = pread(fd, &scratch, 4096, 0)
            fds.append(fd)
        }
        let (st, _) = request(socket, .status)
        let pid = ControlProtocol.decode(StatusReply.self, from: st)?.pid ?? 0
        let rssOpen = rssKiB(pid)
        let (lock, lockMs) = request(socket, .lock(grace: 0))
        let refused = fds.prefix(100).allSatisfy { pread($0, &scratch, 4096, 0) < 0 && errno == EACCES }
        print(
            String(
                format: "files open: %d   daemon RSS: %.1f MiB   lock --grace 0: %.1f ms -> %@   old fds refused: %@",
                files, Double(rssOpen) / 1024, lockMs, stateShown(lock) as NSString,
                refused ? "yes" : "NO"))
        print("unlock: type the passcode on stdin (one line) to time it, or close stdin to skip")
        if let pass = readLine(), !pass.isEmpty {
            let (u, ms) = request(socket, .unlock(passcode: pass))
            print(
                String(
                    format: "unlock: %.1f ms (includes the KDF) -> %@", ms,
                    stateShown(u) as NSString))
        }
        for fd in fds { close(fd) }
    }
}
