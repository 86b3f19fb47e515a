import ArgumentParser
import CSystem
import Foundation
import Glibc
import KeybagCLI
import KeybagCore

/// Failures of keybagctl carry the contract's exit code.
typealias CtlFailure = ToolFailure

/// `keybagctl`: talk to a keybagfs daemon over its control socket.
@main
struct Keybagctl: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "keybagctl",
        abstract: "Lock, unlock and watch a keybagfs mount.",
        discussion: """
            Exit codes: 0 done, 1 refused (wrong passcode, locked, throttled), 2 usage, 3 cannot reach the daemon.
            Without --socket or --mount, the only keybagfs mount in /proc/self/mountinfo is used.
            """,
        subcommands: [
            Status.self, Unlock.self, Lock.self, Watch.self, Passwd.self, Protect.self, Report.self,
            Follow.self, PamUnlock.self,
        ])

    /// Runs the command with the contract's exit codes.
    static func main() {
        _ = kbfs_set_nondumpable()  // passcodes pass through this process
        runWithContractExitCodes(
            tool: "keybagctl", arguments: hoistingTargetOptions(Array(CommandLine.arguments.dropFirst())))
    }
}

/// Moves `--socket`/`--mount` given before the subcommand behind it, so both
/// `keybagctl --socket S status` and `keybagctl status --socket S` work.
func hoistingTargetOptions(_ args: [String]) -> [String] {
    var leading: [String] = []
    var i = 0
    while i < args.count {
        let a = args[i]
        if a == "--socket" || a == "--mount", i + 1 < args.count {
            leading += [a, args[i + 1]]; i += 2
        } else if a.hasPrefix("--socket=") || a.hasPrefix("--mount=") {
            leading.append(a); i += 1
        } else {
            break
        }
    }
    guard !leading.isEmpty, i < args.count else { return args }
    return [args[i]] + leading + Array(args[(i + 1)...])
}

/// Where to find the daemon.
struct Target: ParsableArguments {
    @Option(help: "Control socket path.")
    var socket: String?

    @Option(help: "Mount point of the keybagfs mount (its default socket is used).")
    var mount: String?

    /// The socket path to use.
    func socketPath() throws -> String {
        if let socket { return socket }
        if let mount { return ControlPaths.defaultSocket(forMountpoint: mount) }
        let mounts = ControlPaths.keybagfsMounts()
        if mounts.count == 1 { return ControlPaths.defaultSocket(forMountpoint: mounts[0]) }
        if mounts.isEmpty { throw CtlFailure(code: 3, message: "no keybagfs mount found; use --socket or --mount") }
        throw CtlFailure(
            code: 2, message: "several keybagfs mounts (\(mounts.joined(separator: ", "))); choose one with --mount")
    }

    /// Opens a connection.
    func connect() throws -> Session {
        let path = try socketPath()
        do { return Session(fd: try ControlClient.connect(path: path)) } catch {
            throw CtlFailure(code: 3, message: "cannot reach the daemon at \(path): \(error)")
        }
    }
}

/// One connection: request/reply.
final class Session {
    let fd: Int32
    var buffer: [UInt8] = []
    init(fd: Int32) { self.fd = fd }
    deinit { close(fd) }

    /// Sends a request and returns the reply line.
    func line(_ call: ControlCall) throws -> String {
        do { try ControlClient.sendLine(fd, call.line) } catch {
            throw CtlFailure(code: 3, message: "lost the daemon: \(error)")
        }
        guard let line = ControlClient.readLine(fd, buffer: &buffer) else {
            throw CtlFailure(code: 3, message: "the daemon closed the connection")
        }
        return line
    }

    /// Sends a request and returns its reply or the daemon's refusal, and the line it came in.
    func call<T: Decodable>(_ call: ControlCall, _ type: T.Type) throws -> (Result<T, ControlRefusal>, line: String) {
        let line = try line(call)
        guard let reply = ControlProtocol.reply(type, from: line) else {
            throw CtlFailure(code: 3, message: "unreadable reply from the daemon")
        }
        return (reply, line)
    }

    /// Sends a request; a refusal becomes exit 1 with the daemon's message and any retry delay.
    func checked<T: Decodable>(_ call: ControlCall, _ type: T.Type) throws -> T {
        try checkedLine(call, type).reply
    }

    /// `checked`, with the reply's line as it came.
    func checkedLine<T: Decodable>(_ call: ControlCall, _ type: T.Type) throws -> (reply: T, line: String) {
        switch try self.call(call, type) {
        case (.success(let reply), let line): return (reply, line)
        case (.failure(let refusal), _):
            var msg = refusal.message
            if let r = refusal.retryAfter, !msg.contains("retry") { msg += " (retry in \(r) s)" }
            throw CtlFailure(code: 1, message: "\(refusal.error): \(msg)")
        }
    }
}

/// A number of seconds as JSON shows it: no ".0" on whole numbers.
func seconds(_ d: Double) -> String {
    d.rounded() == d && abs(d) < 1e15 ? String(Int(d)) : String(d)
}

/// A passcode as a JSON string (the protocol carries text).
func passcodeString(_ k: SecureKey) throws -> String {
    try k.withBytes { b in
        guard let s = String(validating: b.bindMemory(to: UInt8.self), as: UTF8.self) else {
            throw CtlFailure(code: 2, message: "the passcode must be valid UTF-8")
        }
        return s
    }
}

struct Status: ParsableCommand {
    static let configuration = CommandConfiguration(abstract: "Show the lock state.")
    @OptionGroup var target: Target
    @Flag(help: "Print the daemon's status object as one JSON line.")
    var json = false

    func run() throws {
        let (reply, line) = try target.connect().checkedLine(.status, StatusReply.self)
        if json { print(line); return }  // the daemon's line as it came
        print("state: \(reply.state.rawValue)")
        print("protected data available: \(reply.protectedDataAvailable ? "yes" : "no")")
        print("open files: \(reply.openFiles)")
        print("grace: \(seconds(reply.grace)) s")
        if reply.retryAfter > 0 { print("unlock throttled: retry in \(reply.retryAfter) s") }
        if reply.keySetBehind {
            print(
                "key set: behind (another device made a newer one): new files and class changes are refused until this "
                    + "device takes it up (lock and unlock) or runs `keybagfs recover`")
        }
        for r in reply.refusedRecords { print("refused in devices/: \(r)") }
        let tpm = reply.tpm2
        if tpm.inUse {
            if let e = tpm.error { print("TPM: in use; \(e)"); return }
            func shown(_ n: Int?) -> String { n.map(String.init) ?? "?" }
            print(
                "TPM: in use; lockout counter \(shown(tpm.lockoutCounter)) of \(shown(tpm.maxTries)) tries, one "
                    + "forgiven every \(shown(tpm.recoveryTime)) s" + (tpm.inLockout == true ? " (in lockout)" : ""))
            if let pcrs = tpm.pcrs, !pcrs.isEmpty {
                print("TPM: bound to PCRs \(pcrs.map(String.init).joined(separator: ",")) (SHA-256)")
            }
            switch (tpm.lockoutAuthority, tpm.lockoutAuthSet) {
            case ("keybagfs", true?), ("given", true?):
                print(
                    "TPM: lockout authorization kept by keybagfs: only the recovery key clears a lockout "
                        + "(keybagfs tpm2 clear-lockout)")
            case ("accepted", _):
                print(
                    "TPM: lockout clearable by whoever holds the TPM's lockout authorization (accepted at enrollment"
                        + (tpm.lockoutAuthSet == false ? "; it is empty: any root user" : "") + ")")
            case (_, false?):
                print(
                    "TPM: its lockout authorization is not set: any root user can clear the lockout (run `keybagfs "
                        + "tpm2 enroll` again on the unmounted store to take it)")
            default:
                break
            }
            if let n = tpm.rewrapPending {
                print("TPM: files not yet all moved to key set \(n) (an enrollment was cut short): `keybagfs rewrap`")
            }
        } else {
            print("TPM: not in use")
        }
    }
}

struct Unlock: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Unlock with the passcode (asked without echo, or one line on stdin).")
    @OptionGroup var target: Target
    @Flag(help: "Read the passcode as one line from standard input.")
    var passcodeStdin = false

    func run() throws {
        let session = try target.connect()
        let k = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Passcode: ")
        defer { k.wipe() }
        let reply = try session.checked(.unlock(passcode: try passcodeString(k)), StateReply.self)
        if !passcodeStdin { print("state: \(reply.state.rawValue)") }
    }
}

struct Lock: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Lock: state locking, then locked after the grace period.")
    @OptionGroup var target: Target
    @Option(help: "Seconds of grace before the keys are evicted (default: the mount's --grace).")
    var grace: Double?
    @Flag(help: "Wait until the state is locked.")
    var wait = false

    func validate() throws {
        if let grace, !(grace >= 0 && grace < 86_400) {
            throw ValidationError("--grace must be from 0 to 86400 seconds")
        }
    }

    func run() throws {
        let session = try target.connect()
        var state = try session.checked(.lock(grace: grace), StateReply.self).state
        while wait, state == .locking {
            usleep(50_000)
            state = try session.checked(.status, StatusReply.self).state
        }
        print("state: \(state.rawValue)")
    }
}

struct Watch: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Print one line per protected-data event until interrupted.")
    @OptionGroup var target: Target
    @Flag(help: "Print each event object as one JSON line.")
    var json = false

    func run() throws {
        let session = try target.connect()
        _ = try session.checked(.subscribe, StateReply.self)
        while let line = ControlClient.readLine(session.fd, buffer: &session.buffer) {
            var out = line
            if !json, let e = ControlProtocol.decode(EventLine.self, from: line) {
                out = "\(e.time) \(e.event.rawValue) (state \(e.state.rawValue))"
            }
            FileHandle.standardOutput.write(Data((out + "\n").utf8))  // unbuffered: one line as it arrives
        }
        throw CtlFailure(code: 3, message: "the daemon closed the connection")
    }
}

struct Passwd: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Change the passcode (old, then new). No data is re-encrypted.",
        discussion: "With --passcode-stdin, the first line of stdin is the old passcode and the second the new one.")
    @OptionGroup var target: Target
    @Flag(help: "Read old and new passcode as two lines from standard input.")
    var passcodeStdin = false

    func run() throws {
        let session = try target.connect()
        let old = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Current passcode: ")
        defer { old.wipe() }
        let new = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "New passcode: ")
        defer { new.wipe() }
        if !passcodeStdin {
            let again = try PasscodeInput.prompt("Repeat new passcode: ")
            defer { again.wipe() }
            guard PasscodeInput.equal(new, again) else {
                throw CtlFailure(code: 2, message: "the new passcodes differ")
            }
        }
        _ = try session.checked(.passwd(old: try passcodeString(old), new: try passcodeString(new)), DoneReply.self)
        if !passcodeStdin { print("passcode changed") }
    }
}
