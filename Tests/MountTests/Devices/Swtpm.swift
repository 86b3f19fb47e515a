import Foundation
import Glibc
import XCTest

/// A TPM 2.0 for one test: Debian's swtpm on loopback with its own state folder, started by
/// the test and stopped by PID in teardown. The test reads what the TPM says with tpm2-tools
/// (the product never uses them).
final class Swtpm {
    /// The state folder.
    let state: String
    /// The data port (the control port is the next one).
    private(set) var port = 0
    private var process: Process?

    /// How the product reaches it.
    var tcti: String { "swtpm:host=127.0.0.1,port=\(port)" }

    /// Starts a simulator with state in `root/name` on a pair of free loopback ports, and
    /// sets its dictionary-attack limits (`maxTries` failures, one forgiven every
    /// `recoveryTime` s) from a cleared counter.
    init(
        root: String, name: String = "tpm", maxTries: Int = 3, recoveryTime: Int = 600, lockoutRecovery: Int? = nil
    ) throws {
        state = root + "/" + name
        try FileManager.default.createDirectory(atPath: state, withIntermediateDirectories: true)
        for _ in 0..<20 {
            let p = 10_000 + Int.random(in: 0..<2_200) * 10  // below the ephemeral range (32768+), where clients bind
            guard !Self.listening(p), !Self.listening(p + 1) else { continue }
            let proc = Process()
            proc.executableURL = URL(fileURLWithPath: "/usr/bin/swtpm")
            proc.arguments = [
                "socket", "--tpm2", "--tpmstate", "dir=\(state)", "--server", "type=tcp,port=\(p),bindaddr=127.0.0.1",
                "--ctrl", "type=tcp,port=\(p + 1),bindaddr=127.0.0.1", "--flags", "startup-clear",
            ]
            proc.standardOutput = FileHandle.nullDevice
            proc.standardError = FileHandle(forWritingAtPath: "/dev/null")
            try proc.run()
            let deadline = Date().addingTimeInterval(5)
            while proc.isRunning && !Self.listening(p) && Date() < deadline { usleep(20_000) }
            if proc.isRunning && Self.listening(p) {
                process = proc
                port = p
                break
            }
            proc.terminate()
            proc.waitUntilExit()
        }
        guard process != nil else {
            throw NSError(domain: "swtpm did not start (is Debian's swtpm installed?)", code: 1)
        }
        try setLockout(maxTries: maxTries, recoveryTime: recoveryTime, lockoutRecovery: lockoutRecovery)
    }

    deinit { stop() }

    /// Stops the simulator (its state stays for a restart).
    func stop() {
        guard let p = process else { return }
        kill(p.processIdentifier, SIGTERM)
        let deadline = Date().addingTimeInterval(5)
        while p.isRunning && Date() < deadline { usleep(20_000) }
        if p.isRunning { kill(p.processIdentifier, SIGKILL) }
        p.waitUntilExit()
        process = nil
    }

    /// Whether something accepts connections on 127.0.0.1:`port`.
    static func listening(_ port: Int) -> Bool {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        var a = sockaddr_in()
        a.sin_family = sa_family_t(AF_INET)
        a.sin_port = in_port_t(UInt16(port).bigEndian)
        a.sin_addr.s_addr = inet_addr("127.0.0.1")
        return withUnsafePointer(to: &a) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) == 0
            }
        }
    }

    /// Runs a tpm2-tools command against this simulator.
    @discardableResult
    func tool(_ name: String, _ args: [String]) -> ToolResult {
        MountFixture.run("/usr/bin/" + name, args, environment: ["TPM2TOOLS_TCTI": tcti, "TSS2_LOG": "all+NONE"])
    }

    /// Clears the lockout counter, then sets the dictionary-attack limits (with the empty
    /// lockout authorization: before keybagfs takes it). `lockoutRecovery` (default
    /// `recoveryTime`): seconds the lockout authorization is refused after a wrong one.
    func setLockout(maxTries: Int, recoveryTime: Int, lockoutRecovery: Int? = nil) throws {
        let clear = tool("tpm2_dictionarylockout", ["-c"])
        let set = tool(
            "tpm2_dictionarylockout",
            ["-s", "-n", "\(maxTries)", "-t", "\(recoveryTime)", "-l", "\(lockoutRecovery ?? recoveryTime)"])
        guard clear.code == 0, set.code == 0 else {
            throw NSError(domain: "tpm2_dictionarylockout: \(clear.stderr) \(set.stderr)", code: 1)
        }
    }

    /// A variable TPM property as the TPM reports it (`tpm2_getcap properties-variable`),
    /// e.g. `TPM2_PT_LOCKOUT_COUNTER`.
    func property(_ name: String) -> Int? {
        let r = tool("tpm2_getcap", ["properties-variable"])
        let lines = r.stdout.split(separator: "\n").map(String.init)
        guard let i = lines.firstIndex(where: { $0.hasPrefix(name + ":") }) else { return nil }
        // Either "NAME: 0x3" on one line or "NAME:\n  raw: 0x3".
        let tail = lines[i].dropFirst(name.count + 1).trimmingCharacters(in: .whitespaces)
        let text =
            tail.isEmpty && i + 1 < lines.count
            ? lines[i + 1].replacingOccurrences(of: "raw:", with: "").trimmingCharacters(in: .whitespaces) : tail
        return text.hasPrefix("0x") ? Int(text.dropFirst(2), radix: 16) : Int(text)
    }

    /// Whether the TPM's lockout authorization is set (TPMA_PERMANENT lockoutAuthSet).
    var lockoutAuthSet: Bool {
        let out = tool("tpm2_getcap", ["properties-variable"]).stdout
        return out.split(separator: "\n").contains { $0.contains("lockoutAuthSet") && $0.hasSuffix("1") }
    }

    /// The TPM's own lockout counter.
    var lockoutCounter: Int? { property("TPM2_PT_LOCKOUT_COUNTER") }
}
