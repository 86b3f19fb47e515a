import CFuse
import CSystem
import Dispatch
import Foundation
import KeybagCore
import Synchronization

/// The lock-state controller: runs unlock, lock (with its grace period), passwd and
/// status against the keybag, the keyring and the filesystem, and publishes events.
/// Transitions are serialised by one lock that no FUSE request handler ever takes.
final class Controller: Sendable {
    private let machine = Locked(LockStateMachine())
    private let transitions = Locked(0)
    private let keybag: Locked<Keybag>
    private let deviceKey: SecureKey
    let keyring: ClassKeyring
    let fs: Filesystem
    let events = EventHub()
    /// Grace period used when a lock request names none.
    let defaultGrace: Double
    /// The FUSE session (bit pattern), for page-cache invalidation.
    let session = Atomic<UInt>(0)
    /// Serial queue for invalidations asked by request handlers (`dropPagesSoon`).
    private let pageDrops = DispatchQueue(label: "keybagfs.page-drops")
    /// The mount point, for `status`.
    let mountpoint: String

    /// Seconds locked (suspend included) after which class C goes too; nil: never.
    let inactivityRelock: Double?
    /// CLOCK_BOOTTIME second at which a `locked` device returns to `beforeFirstUnlock`.
    private let relockDeadline = Locked<Double?>(nil)
    /// Called after every state change (systemd STATUS=).
    let stateChanged: @Sendable (LockState) -> Void

    /// Uid allowed to lock, unlock and passwd besides root (for `status`).
    let owner: uid_t

    init(keybag: Keybag, deviceKey: SecureKey, keyring: ClassKeyring, fs: Filesystem, grace: Double, mountpoint: String,
         owner: uid_t, inactivityRelock: Double? = nil, stateChanged: @escaping @Sendable (LockState) -> Void = { _ in }) {
        self.owner = owner
        self.inactivityRelock = inactivityRelock
        self.stateChanged = stateChanged
        self.keybag = Locked(keybag)
        self.deviceKey = deviceKey
        self.keyring = keyring
        self.fs = fs
        self.defaultGrace = grace
        self.mountpoint = mountpoint
    }

    /// Current state.
    var state: LockState { machine.withLock { $0.state } }

    /// The `status` reply.
    func status() -> [String: Any] {
        let st = state
        let (failures, retry) = keybag.withLock { ($0.file.failedAttempts, $0.retryAfter(now: Date().timeIntervalSince1970)) }
        return ["ok": true, "state": st.rawValue, "protectedDataAvailable": st == .unlocked, "grace": defaultGrace,
                "openFiles": fs.openFiles.load(ordering: .relaxed), "pid": Int(getpid()), "mountpoint": mountpoint,
                "failedAttempts": failures, "retryAfter": Self.seconds(retry),
                "classADirectIO": FuseChannel.directIOMappable, "writebackCache": FuseChannel.writebackInEffect, "posixACLs": fs.posixACLs.load(ordering: .relaxed), "subscribers": events.count,
                "owner": Int(owner), "defaultClass": fs.defaultClass.name,
                "aesMemoryLocked": HardwareAES.ownsMemory && HardwareAES.unlockedAllocations == 0, "inactivityRelock": inactivityRelock.map { $0 / 3600 } ?? NSNull(),
                "relockIn": relockDeadline.withLock { $0 }.map { Self.seconds($0 - Self.bootTime()) } ?? NSNull()]
    }

    /// Seconds since boot, suspend included (CLOCK_BOOTTIME).
    static func bootTime() -> Double {
        var ts = timespec()
        clock_gettime(CLOCK_BOOTTIME, &ts)
        return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
    }

    /// Starts the inactivity clock of the lock with `ticket` (just reached `locked`).
    private func armInactivityRelock(ticket: UInt64) {
        guard let limit = inactivityRelock else { return }
        let deadline = Self.bootTime() + limit
        relockDeadline.withLock { $0 = deadline }
        checkInactivity(ticket: ticket, deadline: deadline)
    }

    /// Returns to `beforeFirstUnlock` once `deadline` has passed, unless the lock with
    /// `ticket` was ended first. Wakes at least once a minute, so time spent suspended
    /// (which the dispatch clock does not count) is noticed within a minute of resume.
    private func checkInactivity(ticket: UInt64, deadline: Double) {
        let left = deadline - Self.bootTime()
        if left > 0 {
            DispatchQueue.global().asyncAfter(deadline: .now() + min(left, 60)) { [self] in
                guard machine.withLock({ $0.state == .locked && $0.ticket == ticket }) else { return }
                checkInactivity(ticket: ticket, deadline: deadline)
            }
            return
        }
        transitions.withLock { _ in
            guard machine.withLock({ $0.state == .locked && $0.ticket == ticket }) else { return }
            // Refuse class B and C at once, write back what the page cache holds while the
            // keys exist, then drop every key but class D's and what was cached in between.
            keyring.beginReturnToBeforeFirstUnlock()
            invalidatePageCache(fs.inodesHoldingKeysButNone(), pass: "inactivity write-back")
            keyring.returnToBeforeFirstUnlock()
            let evicted = fs.evictAllFileKeysButNone()
            HardwareAES.forgetKeySchedules()
            invalidatePageCache(evicted, pass: "inactivity")
            relockDeadline.withLock { $0 = nil }
            let evs = machine.withLock { $0.returnToBeforeFirstUnlock(ticket: ticket) }
            for e in evs { events.publish(e, state: .beforeFirstUnlock) }
            MountDaemon.log("locked for \(Int(inactivityRelock ?? 0)) s: back to beforeFirstUnlock, only class none stays readable")
            stateChanged(.beforeFirstUnlock)
        }
    }

    /// The `policy` reply: the mount's directory rules in order (the last match wins).
    func policy() -> [String: Any] {
        ["ok": true, "rules": fs.policy.rules.map { ["pattern": $0.pattern, "class": $0.protectionClass.name] }]
    }

    /// An error reply.
    static func refusal(_ code: String, _ message: String, _ extra: [String: Any] = [:]) -> [String: Any] {
        var r: [String: Any] = ["ok": false, "error": code, "message": message]
        for (k, v) in extra { r[k] = v }
        return r
    }

    /// Outcome of a passcode check.
    private enum Verification { case accepted(UnlockedClassKeys), refused([String: Any]) }

    /// Checks the throttle, then the passcode, counting failures in the keybag. The KDF
    /// runs on a copy of the keybag, so `status` (which reads it) never waits for a KDF;
    /// unlock and passwd are serialised by the transition lock, so the copy stays current.
    private func verify(_ passcode: SecureKey) -> Verification {
        let now = Date().timeIntervalSince1970
        let snapshot = keybag.withLock { $0 }
        let wait = snapshot.retryAfter(now: now)
        if wait > 0 {
            let s = Self.seconds(wait)
            return .refused(Self.refusal("throttled", "too many failed attempts; retry in \(s) s", ["retryAfter": s]))
        }
        do {
            let keys = try snapshot.unlock(passcode: passcode, deviceKey: deviceKey)
            keybag.withLock { try? $0.recordSuccess() }
            return .accepted(keys)
        } catch KeybagError.badPasscode {
            return keybag.withLock { kb in
                do { try kb.recordFailure(now: now) } catch {
                    return .refused(Self.refusal("internal", "wrong passcode; the failure could not be recorded: \(error)"))
                }
                let retry = Self.seconds(kb.retryAfter(now: now))
                var extra: [String: Any] = ["failedAttempts": kb.file.failedAttempts]
                if retry > 0 { extra["retryAfter"] = retry }
                return .refused(Self.refusal("badPasscode", retry > 0 ? "wrong passcode; retry in \(retry) s" : "wrong passcode", extra))
            }
        } catch {
            return .refused(Self.refusal("internal", "\(error)"))
        }
    }

    /// Whole seconds of a delay, rounded up; never traps (the keybag may hold anything).
    static func seconds(_ d: Double) -> Int {
        guard d.isFinite, d > 0 else { return 0 }
        return Int(min(d.rounded(.up), 1e9))
    }

    /// unlock: installs the class keys, cancels a pending lock, sends `didBecomeAvailable`.
    func unlock(passcode: SecureKey) -> [String: Any] {
        transitions.withLock { _ in
            switch verify(passcode) {
            case .refused(let reply): return reply
            case .accepted(let keys):
                keyring.install(keys)
                let evs = machine.withLock { $0.unlocked() }
                relockDeadline.withLock { $0 = nil }
                for e in evs { events.publish(e, state: .unlocked) }
                stateChanged(.unlocked)
                return ["ok": true, "state": LockState.unlocked.rawValue]
            }
        }
    }

    /// passwd: rewraps the passcode-protected class keys under a new passcode.
    func passwd(old: SecureKey, new: SecureKey) -> [String: Any] {
        transitions.withLock { _ in
            switch verify(old) {
            case .refused(let reply): return reply
            case .accepted(let keys):
                keys.wipe()
                do {
                    var next = keybag.withLock { $0 }
                    try next.changePasscode(old: old, new: new, deviceKey: deviceKey)   // two KDFs, off the lock
                    keybag.withLock { $0 = next }
                    return ["ok": true]
                } catch {
                    return Self.refusal("internal", "passcode not changed: \(error)")
                }
            }
        }
    }

    /// lock: `locking` and `willBecomeUnavailable` now; after the grace period the keys go.
    func lock(grace: Double?) -> [String: Any] {
        let g = max(0, grace ?? defaultGrace)
        return transitions.withLock { _ -> [String: Any] in
            let action = machine.withLock { $0.requestLock(grace: g) }
            switch action {
            case .nothing:
                break
            case .startGrace(let ticket):
                events.publish(.willBecomeUnavailable, state: .locking)
                stateChanged(.locking)
                DispatchQueue.global().asyncAfter(deadline: .now() + g) { [self] in
                    transitions.withLock { _ in evict(ticket: ticket) }
                }
            case .evictNow(let ticket, let sendWill):
                if sendWill { events.publish(.willBecomeUnavailable, state: .locking) }
                evict(ticket: ticket)
            }
            return ["ok": true, "state": state.rawValue]
        }
    }

    /// Evicts class A and B keys in phases, then reports `locked`:
    /// 1. a new lock epoch: class A/B can no longer be opened, read or (A) created, while
    ///    writes are still sealed with the keys in memory;
    /// 2. every inode that may cache class A/B pages is invalidated: the kernel first writes
    ///    dirty mmap pages back through the daemon, which still has their keys;
    /// 3. the class keys, then the file keys (under each inode's lock) are zeroed;
    /// 4. the same inodes are invalidated again, for anything cached in between.
    /// Called with the transition lock held, from a thread that is not a FUSE worker; no
    /// lock a request handler needs is held while the kernel is notified.
    private func evict(ticket: UInt64) {
        guard machine.withLock({ $0.shouldEvict(ticket: ticket) }) else { return }
        keyring.beginEviction()
        let cached = fs.inodesHoldingProtectedPages()
        invalidatePageCache(cached, pass: "write-back")
        keyring.finishEviction()
        let evicted = fs.evictFileKeys()
        HardwareAES.forgetKeySchedules()
        invalidatePageCache(evicted, pass: "after eviction")
        Failpoint.evictionBeforeLocked.hit()
        let evs = machine.withLock { $0.evicted(ticket: ticket) }
        for e in evs { events.publish(e, state: .locked) }
        if !evs.isEmpty {
            stateChanged(.locked)
            armInactivityRelock(ticket: ticket)
        }
    }

    /// Drops the cached pages of an inode whose class B key died with its last close, on a
    /// queue of its own: never from a FUSE thread, which the kernel may need to serve a
    /// write-back while it invalidates.
    func dropPagesSoon(_ id: UInt64) {
        HardwareAES.forgetKeySchedules()
        pageDrops.async { self.invalidatePageCache([id], pass: "last close of a class B file") }
    }

    /// Runs `work` on the queue of page drops (a thread of the daemon's, not a FUSE worker).
    func runSoon(_ work: @escaping @Sendable () -> Void) { pageDrops.async(execute: work) }

    /// Makes the kernel ask again for the attributes of `ids` before it answers from them,
    /// at once: no page is dropped (offset -1), so the kernel writes nothing back and the
    /// call may come from a FUSE thread, with no lock held.
    func invalidateAttributes(_ ids: [UInt64]) {
        guard let se = OpaquePointer(bitPattern: session.load(ordering: .acquiring)) else { return }
        for id in ids { _ = fuse_lowlevel_notify_inval_inode(se, id, -1, 0) }
    }

    /// Asks the kernel to write back and drop the cached pages of `ids`; failures other
    /// than "the kernel no longer knows this inode" are logged.
    private func invalidatePageCache(_ ids: [UInt64], pass: String) {
        guard let se = OpaquePointer(bitPattern: session.load(ordering: .acquiring)) else { return }
        var failed = 0, firstError: Int32 = 0
        for id in ids {
            let rc = fuse_lowlevel_notify_inval_inode(se, id, 0, 0)
            if rc != 0 && rc != -ENOENT {
                failed += 1
                if firstError == 0 { firstError = -rc }
            }
        }
        if failed > 0 {
            MountDaemon.log("lock (\(pass)): page cache of \(failed) of \(ids.count) inodes not dropped: \(String(cString: strerror(firstError)))")
        }
    }

    /// Daemon exit: every key zeroed (after the queued page drops, which may still hold
    /// the session: the caller cleared `session` first).
    func shutdown() {
        pageDrops.sync {}
        transitions.withLock { _ in keyring.wipeAll() }
        fs.wipeFileKeys()
        HardwareAES.forgetKeySchedules()
        deviceKey.wipe()
        fs.names.wipe()
    }
}

/// Subscribers of events: each gets one JSON line per event, written without blocking (a
/// reply being sent to the same connection sends it after itself); a subscriber whose
/// socket buffer is full or whose queue is long is dropped rather than stalling a lock.
final class EventHub: Sendable {
    private let subscribers = Locked<[Int32: Connection]>([:])

    /// Adds a connection and queues its subscribe reply (`reply()` reads the state) in the
    /// same step, so no event published after that read can reach it before the reply.
    func subscribe(_ c: Connection, reply: () -> String) {
        subscribers.withLock { subs in
            subs[c.fd] = c
            if !c.enqueue(reply()) { c.hangUp() }
        }
    }
    /// Removes a connection.
    func remove(_ c: Connection) { subscribers.withLock { if $0[c.fd] === c { $0[c.fd] = nil } } }

    /// How many connections are subscribed.
    var count: Int { subscribers.withLock { $0.count } }

    /// Sends an event to every subscriber.
    func publish(_ event: ProtectionEvent, state: LockState) {
        let line = ControlProtocol.encode(["event": event.rawValue, "state": state.rawValue, "time": ControlProtocol.timestamp()])
        let all = subscribers.withLock { Array($0.values) }
        for c in all where !c.sendEvent(line) {
            remove(c)
            c.hangUp()
        }
    }
}
