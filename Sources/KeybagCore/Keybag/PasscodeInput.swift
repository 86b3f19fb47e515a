import CSodium
import Glibc

/// Reads passcodes without ever putting them on a command line: one line from stdin
/// (`--passcode-stdin`) or a terminal prompt with echo off. Bytes go straight into
/// guarded memory.
public enum PasscodeInput {
    /// Longest accepted passcode, in bytes.
    public static let maxLength = 1024

    /// Reads one line from `fd` (without its newline; a NUL also ends it) into guarded
    /// memory; nil at EOF.
    public static func readLine(fd: Int32) throws -> SecureKey? {
        let buf = SecureKey(zeroed: maxLength)
        defer { buf.wipe() }
        var count = 0
        var sawAny = false
        try buf.withBytes { b in
            let p = UnsafeMutableRawPointer(mutating: b.baseAddress!).assumingMemoryBound(to: UInt8.self)
            var c: UInt8 = 0
            while true {
                let n = Glibc.read(fd, &c, 1)
                if n < 0 && errno == EINTR { continue }
                if n <= 0 { break }
                sawAny = true
                // NUL: pam_exec's expose_authtok ends the password with one
                if c == UInt8(ascii: "\n") || c == 0 { break }
                guard count < maxLength else { throw KeybagError.invalid("passcode longer than \(maxLength) bytes") }
                p[count] = c
                count += 1
            }
            if count > 0 && p[count - 1] == UInt8(ascii: "\r") { count -= 1 }
        }
        guard sawAny else { return nil }
        guard count > 0 else { throw KeybagError.invalid("empty passcode") }
        return try buf.withBytes { b in
            SecureKey(count: count) { out in out.copyMemory(from: UnsafeRawBufferPointer(rebasing: b[0..<count])) }
        }
    }

    /// Prompts on the terminal with echo off.
    public static func prompt(_ text: String) throws -> SecureKey {
        let tty = open("/dev/tty", O_RDWR | O_CLOEXEC)
        guard tty >= 0 else { throw KeybagError.invalid("no terminal to ask for the passcode: use --passcode-stdin") }
        defer { close(tty) }
        var old = termios()
        let haveTermios = tcgetattr(tty, &old) == 0
        if haveTermios {
            var noEcho = old
            noEcho.c_lflag &= ~tcflag_t(ECHO)
            tcsetattr(tty, TCSAFLUSH, &noEcho)
        }
        defer { if haveTermios { tcsetattr(tty, TCSAFLUSH, &old); _ = Glibc.write(tty, "\n", 1) } }
        _ = Glibc.write(tty, text, text.utf8.count)
        guard let k = try readLine(fd: tty) else { throw KeybagError.invalid("no passcode given") }
        return k
    }

    /// One passcode: from stdin with `fromStdin`, else prompted.
    public static func read(fromStdin: Bool, prompt text: String) throws -> SecureKey {
        if fromStdin {
            guard let k = try readLine(fd: 0) else { throw KeybagError.invalid("no passcode on stdin") }
            return k
        }
        return try prompt(text)
    }

    /// A new passcode: one line of stdin with `fromStdin`, else prompted twice; `invalid`
    /// with `mismatch` when the two differ.
    public static func readNew(fromStdin: Bool, prompt text: String, mismatch: String) throws -> SecureKey {
        let passcode = try read(fromStdin: fromStdin, prompt: text)
        guard !fromStdin else { return passcode }
        let again: SecureKey
        do { again = try prompt("Repeat passcode: ") } catch { passcode.wipe(); throw error }
        defer { again.wipe() }
        guard equal(passcode, again) else {
            passcode.wipe()
            throw KeybagError.invalid(mismatch)
        }
        return passcode
    }

    /// Whether two secrets are equal (constant time).
    public static func equal(_ a: SecureKey, _ b: SecureKey) -> Bool {
        guard a.count == b.count else { return false }
        return
            (try? a.withBytes { x in
                try b.withBytes { y in sodium_memcmp(x.baseAddress!, y.baseAddress!, x.count) == 0 }
            }) ?? false
    }
}
