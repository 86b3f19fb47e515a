import ArgumentParser
import CLogind
import Foundation
import Glibc
import KeybagCore

/// `keybagctl follow`: locks the mount when the machine locks — before sleep (holding a
/// logind delay inhibitor until the keys are gone), on a session's Lock signal and when a
/// session's LockedHint becomes true.
struct Follow: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Lock with logind: before sleep, on session Lock, on LockedHint.",
        discussion: """
            Runs until stopped (a systemd unit: keybagfs-follow@.service). Before sleep it holds a logind \
            'delay' inhibitor, locks with grace 0 and releases the inhibitor only once the daemon answers \
            'locked', so the machine never sleeps with class complete keys in memory. Session locks use \
            --grace (default: the mount's). Signals not sent by logind itself are ignored. Unlocking stays \
            with `keybagctl unlock` or PAM.
            """)

    @OptionGroup var target: Target

    /// Which sessions' locks count.
    enum Sessions: String, ExpressibleByArgument, CaseIterable { case owner, all }

    @Option(
        help: ArgumentHelp(
            "Sessions whose Lock/LockedHint lock the mount: owner (the mount owner's; all when the owner is root) or "
                + "all.")
    )
    var sessions: Sessions = .owner

    @Option(
        help:
            "Grace seconds for a lock after a session locks (default: the mount's --grace). Sleep always locks at once."
    )
    var grace: Double?

    @Flag(help: "Do not lock before sleep (no inhibitor is taken).")
    var noSleep = false

    @Option(help: .hidden)
    var busAddress: String?

    func validate() throws {
        if let grace, !(grace >= 0 && grace < 86_400) {
            throw ValidationError("--grace must be from 0 to 86400 seconds")
        }
    }

    /// One line for the journal: sent to its native socket when stdout is the journal (the
    /// line's timestamp is then when it was said, which the suspend order is checked by),
    /// else written to stdout. A leading "<N>" is the line's syslog priority.
    func say(_ s: String) {
        var priority: Int32 = 6, text = Substring(s)
        let level = s.hasPrefix("<") && s.dropFirst(2).hasPrefix(">") ? Int32(String(s.dropFirst().prefix(1))) : nil
        if let level { (priority, text) = (level, s.dropFirst(3)) }
        if kbfs_journal_line(priority, String(text)) == 0 { return }
        FileHandle.standardOutput.write(Data((s + "\n").utf8))
    }

    func run() throws {
        let status = try control().checked(.status, StatusReply.self)
        let owner = status.owner >= 0 ? uid_t(clamping: status.owner) : getuid()
        let mount = status.mountpoint.isEmpty ? "the mount" : status.mountpoint
        var bus: OpaquePointer?
        let rc = busAddress.map { kbfs_logind_open($0, &bus) } ?? kbfs_logind_open(nil, &bus)
        guard rc == 0, let bus else {
            throw CtlFailure(
                code: 3, message: "cannot watch logind on the system bus: \(String(cString: strerror(-rc)))")
        }
        defer { kbfs_logind_close(bus) }
        var inhibitor: Int32 = -1
        func inhibit() {
            guard !noSleep, inhibitor < 0 else { return }
            inhibitor = kbfs_logind_inhibit(
                bus, "sleep", "keybagfs", "evict class keys of \(mount) before sleep")
            if inhibitor < 0 {
                say(
                    "warning: no sleep inhibitor (\(String(cString: strerror(-inhibitor)))): the mount locks on "
                        + "PrepareForSleep but sleep may not wait"
                )
            }
        }
        inhibit()
        say(
            "following logind for \(mount) (owner uid \(owner), sessions: "
                + "\(sessions.rawValue)\(noSleep ? ", not sleep" : ""))"
        )
        var forged: UInt64 = 0
        var ev = kbfs_logind_event()
        while true {
            let r = kbfs_logind_next(bus, UInt64.max, &ev)
            guard r >= 0 else {
                throw CtlFailure(code: 3, message: "lost the system bus: \(String(cString: strerror(-r)))")
            }
            let nowForged = kbfs_logind_forged(bus)
            if nowForged > forged {
                say("ignored \(nowForged - forged) signal(s) that logind did not send"); forged = nowForged
            }
            guard r == 1 else { continue }
            let session = withUnsafeBytes(of: ev.session) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            switch ev.kind {
            case KBFS_LOGIND_PREPARE_FOR_SLEEP where ev.flag != 0:
                guard !noSleep else { continue }
                say(lockBeforeSleep())  // said before the release, so the journal shows it first
                if inhibitor >= 0 { close(inhibitor); inhibitor = -1 }  // sleep may go on now
            case KBFS_LOGIND_PREPARE_FOR_SLEEP:
                inhibit()
                say("resumed: inhibitor taken again")
            case KBFS_LOGIND_SESSION_LOCK, KBFS_LOGIND_LOCKED_HINT:
                if ev.kind == KBFS_LOGIND_LOCKED_HINT && ev.flag == 0 { continue }
                sessionLocked(session, bus: bus, owner: owner, hint: ev.kind == KBFS_LOGIND_LOCKED_HINT)
            case KBFS_LOGIND_SESSION_UNLOCK:
                say("Unlock of \(session): unlock with keybagctl unlock or at login (PAM)")
            default:
                continue
            }
        }
    }

    /// PrepareForSleep: locks with no grace; the line that says whether sleep proceeds locked.
    func lockBeforeSleep() -> String {
        let t0 = Date()
        let state = lock(grace: 0)
        let ms = Date().timeIntervalSince(t0) * 1000
        if state == "locked" { return String(format: "PrepareForSleep: %@ in %.1f ms; sleep may proceed", state, ms) }
        // Priority err in the journal: this sleep keeps class keys in RAM.
        return String(format: "<3>PrepareForSleep: %@ after %.1f ms; sleep proceeds with the mount unlocked", state, ms)
    }

    /// A session's Lock signal or LockedHint: locks with the grace period when the session
    /// is one this follower watches.
    func sessionLocked(_ session: String, bus: OpaquePointer, owner: uid_t, hint: Bool) {
        var uid: uid_t = 0, lockedHint: Int32 = 0
        let known = kbfs_logind_session(bus, session, &uid, &lockedHint) == 0
        guard sessions == .all || owner == 0 || (known && uid == owner) else { return }
        let t0 = Date()
        let state = lock(grace: grace)
        say(
            String(
                format: "%@ of %@: %@ in %.1f ms", hint ? "LockedHint" : "Lock", session, state,
                Date().timeIntervalSince(t0) * 1000))
    }

    /// Asks the daemon to lock (grace nil: the mount's) and returns the state it answers,
    /// or why it could not.
    func lock(grace: Double?) -> String {
        for attempt in 0..<2 {
            do {
                return try control(fresh: attempt > 0).checked(.lock(grace: grace), StateReply.self).state.rawValue
            } catch let f as CtlFailure where f.code == 1 {
                return "not locked (\(f.message))"  // refused: asking again changes nothing
            } catch {
                if attempt == 1 { return "not locked (\((error as? CtlFailure)?.message ?? "\(error)"))" }
            }
        }
        return "not locked"
    }

    /// The connection to the daemon, kept open from the start so that a lock before sleep
    /// never waits for (or is refused) a new connection slot; reopened when it broke.
    func control(fresh: Bool = false) throws -> Session {
        if !fresh, let s = Self.connection.withLock({ $0 }) { return s }
        let s = try target.connect()
        Self.connection.withLock { $0 = s }
        return s
    }

    /// The follower's one daemon connection.
    private static let connection = Locked<Session?>(nil)
}

/// `keybagctl pam-unlock`: for `pam_exec.so expose_authtok`: unlocks every keybagfs mount
/// owned by `$PAM_USER` with the login password read from stdin. Always exits 0, so a
/// wrong or different password never blocks a login.
struct PamUnlock: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "pam-unlock",
        abstract: "Unlock the mounts of $PAM_USER with the password on stdin (for pam_exec expose_authtok).",
        discussion: """
            At the end of /etc/pam.d/common-auth (reached only once pam_unix accepted the password):
              auth optional pam_exec.so expose_authtok quiet /usr/local/bin/keybagctl pam-unlock
            A mount belongs to a user when it was mounted by that user or with --owner. Failures are \
            logged to stderr and never fail the login.
            """)

    func run() throws {
        let env = ProcessInfo.processInfo.environment
        guard env["PAM_TYPE"].map({ $0 == "auth" }) ?? true else { return }
        guard let user = env["PAM_USER"], let pw = getpwnam(user) else { return note("no such user in $PAM_USER") }
        let uid = pw.pointee.pw_uid
        guard let password = try? PasscodeInput.readLine(fd: 0) else {
            return note("no password on stdin (expose_authtok missing?)")
        }
        defer { password.wipe() }
        signal(SIGALRM) { _ in _exit(0) }  // a login never waits longer for keybagfs
        alarm(Self.timeLimit)
        var owned = 0
        for mount in ControlPaths.keybagfsMounts() {
            let socket = ControlPaths.defaultSocket(forMountpoint: mount)
            guard let fd = try? ControlClient.connect(path: socket) else {
                note("\(mount): no control socket at \(socket)"); continue
            }
            var tv = timeval(tv_sec: 5, tv_usec: 0)
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
            let session = Session(fd: fd)
            guard let st = try? session.checked(.status, StatusReply.self) else {
                note("\(mount): status failed"); continue
            }
            guard st.owner == Int(uid) else { continue }
            owned += 1
            guard st.state != .unlocked else { continue }
            // A login password that is not this mount's passcode costs at most one failed
            // attempt, never a lockout: after a failure only a deliberate unlock tries again.
            if st.failedAttempts > 0 {
                let failed = st.failedAttempts
                note(
                    "\(mount): \(failed) failed attempt(s) since the last unlock; not tried (unlock with keybagctl "
                        + "unlock)"
                )
                continue
            }
            do {
                _ = try session.checked(.unlock(passcode: try passcodeString(password)), StateReply.self)
                note("unlocked \(mount) for \(user)")
            } catch {
                note("\(mount) not unlocked for \(user) (\(error))")
            }
        }
        if owned == 0 { note("no keybagfs mount belongs to \(user)") }
    }

    /// Seconds pam-unlock may take in all.
    static let timeLimit: UInt32 = 10

    /// One line on stderr (pam_exec's log= file); control characters (a mount point may
    /// hold a newline) are shown as `?`, so no line can be forged.
    private func note(_ line: String) {
        let clean = String(line.unicodeScalars.map { $0.value < 0x20 || $0.value == 0x7f ? "?" : Character($0) })
        FileHandle.standardError.write(Data("keybagctl pam-unlock: \(clean)\n".utf8))
    }
}
