import Dispatch
import Foundation
import KeybagCore
import Synchronization

/// The lock-state controller: runs unlock, lock (with its grace period), passwd and
/// status against the keybag, the keyring and the filesystem, and publishes events.
/// Transitions are serialised by one lock that no FUSE request handler ever takes.
final class Controller: Sendable {
    private let machine = Locked(LockStateMachine())
    /// One lock, unlock or passcode change at a time. Lock order (docs/ARCHITECTURE.md):
    /// first; then a node's `io`, `ClassKeyring`'s keys, `SecureKey`'s lock.
    private let transitions = Locked(0)
    private let keybag: Locked<Keybag>
    private let deviceKey: SecureKey
    let keyring: ClassKeyring
    let fs: Filesystem
    let events = EventHub()
    /// Grace period used when a lock request names none.
    let defaultGrace: Double
    /// Page-cache drops (the FUSE session); the same notifier as `fs.kernel`.
    let kernel: KernelNotifier
    /// The mount point, for `status`.
    let mountpoint: String
    /// Where notes go: the mount's.
    private var log: EventLog { fs.log }

    /// Seconds locked (suspend included) after which class C goes too; nil: never.
    let inactivityRelock: Double?
    /// CLOCK_BOOTTIME second at which a `locked` device returns to `beforeFirstUnlock`.
    private let relockDeadline = Locked<Double?>(nil)
    /// Called after every state change (systemd STATUS=).
    let stateChanged: @Sendable (LockState) -> Void

    /// Uid allowed to lock, unlock and passwd besides root (for `status`).
    let owner: uid_t

    init(
        keybag: Keybag, deviceKey: SecureKey, keyring: ClassKeyring, fs: Filesystem, grace: Double, mountpoint: String,
        owner: uid_t, inactivityRelock: Double? = nil, stateChanged: @escaping @Sendable (LockState) -> Void = { _ in }
    ) {
        self.owner = owner
        self.inactivityRelock = inactivityRelock
        self.stateChanged = stateChanged
        self.keybag = Locked(keybag)
        self.deviceKey = deviceKey
        self.keyring = keyring
        self.fs = fs
        self.kernel = fs.kernel
        self.defaultGrace = grace
        self.mountpoint = mountpoint
    }

    /// Current state.
    var state: LockState { machine.withLock { $0.state } }

    /// The `status` reply.
    func status() -> StatusReply {
        let st = state
        let (failures, retry, device, keySet) = keybag.withLock {
            (
                $0.file.failedAttempts, PasscodeAttempts.retryAfter($0, now: Date().timeIntervalSince1970), $0.deviceID,
                $0.currentKeySet
            )
        }
        var r = StatusReply(
            state: st, mountpoint: mountpoint, pid: Int(getpid()), owner: Int(owner), grace: defaultGrace,
            defaultClass: fs.classes.mountDefault.name)
        r.openFiles = fs.io.openFiles.load(ordering: .relaxed)
        r.failedAttempts = failures
        r.retryAfter = Self.seconds(retry)
        r.classADirectIO = kernel.negotiated.directIOMappable
        r.writebackCache = kernel.negotiated.writeback
        r.posixACLs = fs.attributes.acls.enabled.load(ordering: .relaxed)
        r.subscribers = events.count
        r.aesMemoryLocked = HardwareAES.ownsMemory && HardwareAES.unlockedAllocations == 0
        r.inactivityRelock = inactivityRelock.map { $0 / 3600 }
        r.relockIn = relockDeadline.withLock { $0 }.map { Self.seconds($0 - Self.bootTime()) }
        r.deviceID = device
        r.keySet = keySet
        r.keySetBehind = keyring.refusesNewWraps
        r.refusedRecords = refusedDeviceRecords()
        r.tpm2 = tpmStatus()
        return r
    }

    /// Whether a TPM holds part of the passcode key, and its own lockout counter and limits.
    private func tpmStatus() -> StatusReply.TPMStatus {
        guard let sealer = keybag.withLock({ $0.sealer }) else { return .notInUse }
        do {
            let s = try sealer.lockoutState()
            var r = StatusReply.TPMStatus(
                inUse: true, lockoutCounter: s.counter, maxTries: s.maxTries, recoveryTime: s.recoveryTime,
                lockoutRecovery: s.lockoutRecovery, inLockout: s.inLockout, lockoutAuthSet: s.lockoutAuthSet)
            if let tpm = sealer as? TPMSealer {
                r.lockoutAuthority = tpm.lockoutHolder?.rawValue
                r.pcrs = tpm.pcrs
                r.rewrapPending = tpm.pendingRewrap
            }
            return r
        } catch {
            return StatusReply.TPMStatus(inUse: true, error: "\(error)")
        }
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
            Eviction(.returnToBeforeFirstUnlock).run(keyring: keyring, target: fs)
            relockDeadline.withLock { $0 = nil }
            let evs = machine.withLock { $0.returnToBeforeFirstUnlock(ticket: ticket) }
            for e in evs { events.publish(e, state: .beforeFirstUnlock) }
            log(
                "locked for \(Int(inactivityRelock ?? 0)) s: back to beforeFirstUnlock, only class none stays readable")
            stateChanged(.beforeFirstUnlock)
        }
    }

    /// The `policy` reply: the mount's directory rules in order (the last match wins).
    func policy() -> PolicyReply {
        PolicyReply(
            rules: fs.classes.policy.rules.map { .init(pattern: $0.pattern, protectionClass: $0.protectionClass.name) })
    }

    /// Outcome of a passcode check.
    private enum Verification { case accepted([UnlockedClassKeys]), refused(ControlRefusal) }

    /// Checks the throttle, then the passcode, counting failures in the keybag. The KDF
    /// runs on a copy of the keybag, so `status` (which reads it) never waits for a KDF;
    /// unlock and passwd are serialised by the transition lock, so the copy stays current.
    private func verify(_ passcode: SecureKey) -> Verification {
        let now = Date().timeIntervalSince1970
        let snapshot = keybag.withLock { $0 }
        let wait = PasscodeAttempts.retryAfter(snapshot, now: now)
        if wait > 0 {
            let s = Self.seconds(wait)
            return .refused(ControlRefusal(.throttled, "too many failed attempts; retry in \(s) s", retryAfter: s))
        }
        do {
            let keys = try snapshot.unlockAll(passcode: passcode, deviceKey: deviceKey)
            keybag.withLock { try? PasscodeAttempts.recordSuccess(&$0) }
            return .accepted(keys)
        } catch KeybagError.badPasscode {
            return keybag.withLock { kb in
                do { try PasscodeAttempts.recordFailure(&kb, now: now) } catch {
                    return .refused(
                        ControlRefusal(.internal, "wrong passcode; the failure could not be recorded: \(error)"))
                }
                let retry = Self.seconds(PasscodeAttempts.retryAfter(kb, now: now))
                return .refused(
                    ControlRefusal(
                        .badPasscode, retry > 0 ? "wrong passcode; retry in \(retry) s" : "wrong passcode",
                        retryAfter: retry > 0 ? retry : nil, failedAttempts: kb.file.failedAttempts))
            }
        } catch KeybagError.throttled(let wait) {
            // The TPM's own dictionary-attack lockout (the software delays come first, above).
            let s = Self.seconds(wait)
            return .refused(
                ControlRefusal(.throttled, "the TPM is in dictionary-attack lockout; retry in \(s) s", retryAfter: s))
        } catch let e as KeybagError {
            return .refused(ControlRefusal(.internal, e.description))
        } catch {
            return .refused(ControlRefusal(.internal, "\(error)"))
        }
    }

    /// Whole seconds of a delay, rounded up; never traps (the keybag may hold anything).
    static func seconds(_ d: Double) -> Int {
        guard d.isFinite, d > 0 else { return 0 }
        return Int(min(d.rounded(.up), 1e9))
    }

    /// unlock: installs the class keys, cancels a pending lock, sends `didBecomeAvailable`.
    func unlock(passcode: SecureKey) -> Result<StateReply, ControlRefusal> {
        transitions.withLock { _ in
            switch verify(passcode) {
            case .refused(let refusal): return .failure(refusal)
            case .accepted(let keys):
                adoptRecordOfHeldSet(keys)
                keyring.install(keys)
                takeUpGrantedKeySets(passcode)
                rememberCertified()
                let evs = machine.withLock { $0.unlocked() }
                relockDeadline.withLock { $0 = nil }
                for e in evs { events.publish(e, state: .unlocked) }
                stateChanged(.unlocked)
                return .success(StateReply(.unlocked))
            }
        }
    }

    /// After an unlock: a device that trusts nobody but itself yet takes the list of the record
    /// of its newest set, once that record is there (`DeviceTrust.adoptRecordOfHeldSet`); logged.
    private func adoptRecordOfHeldSet(_ keys: [UnlockedClassKeys]) {
        var kb = keybag.withLock { $0 }
        guard let newest = keys.last, Int(newest.keySet) == kb.currentKeySet else { return }
        do {
            guard try DeviceTrust.adoptRecordOfHeldSet(&kb, classA: newest.classA) else { return }
            keybag.withLock { $0 = kb }
            log("took the device list of key set \(kb.currentKeySet) from its record")
        } catch {
            log("could not take the device list of key set \(kb.currentKeySet): \(error)")
        }
    }

    /// After an unlock: takes up the key sets that records this device trusts handed to it
    /// (another device removed one, `KeySetRecord`), so new files are wrapped again; logged.
    private func takeUpGrantedKeySets(_ passcode: SecureKey) {
        var kb = keybag.withLock { $0 }
        guard let trust = DeviceTrust.of(kb), trust.newestSet > kb.currentKeySet else { return }
        let held = kb.currentKeySet
        do {
            let keys = try KeySets.takeUp(&kb, passcode: passcode, deviceKey: deviceKey, trust: trust)
            keybag.withLock { $0 = kb }
            for s in keys.sets[...held] { s.wipe() }  // the keyring holds these already
            for d in keys.classD[...held] { d.wipe() }
            keys.volume.wipe()
            keyring.install(Array(keys.sets[(held + 1)...]))
            var d: [UInt8: SecureKey] = [:]
            for n in (held + 1)...keys.current { d[UInt8(n)] = keys.classD[n] }
            keyring.takeUp(classD: d, current: UInt8(keys.current))
            let made = ((held + 1)...keys.current).compactMap { trust.records[$0] }
                .map {
                    "set \($0.keySet) by \($0.madeBy)"
                        + ($0.removed.isEmpty ? "" : ", removing \($0.removed.joined(separator: ", "))")
                }
            log(
                "took up key set \(keys.current) (\(made.joined(separator: "; "))): new files are wrapped again")
        } catch {
            log("could not take up key set \(trust.newestSet): \(error)")
        }
    }

    /// After an unlock: keeps the devices certified at this device's set that it did not know
    /// yet (`DeviceTrust.rememberCertified`), so a certificate replaced later gives nothing.
    private func rememberCertified() {
        var kb = keybag.withLock { $0 }
        do {
            try DeviceTrust.rememberCertified(&kb)
            keybag.withLock { $0 = kb }
        } catch {
            log("could not keep the devices this device trusts: \(error)")
        }
    }

    /// The newest key set this device must know of, and the one it holds.
    func keySetStanding() -> (newest: Int, holding: Int) {
        let kb = keybag.withLock { $0 }
        return (DeviceTrust.newestKeySet(kb), kb.currentKeySet)
    }

    /// Records of the devices folder this device refused (forged, damaged, or not signed by a
    /// device it trusts), each with why.
    func refusedDeviceRecords() -> [String] {
        DeviceTrust.of(keybag.withLock { $0 })?.refused ?? []
    }

    /// passwd: rewraps the passcode-protected class keys under a new passcode.
    func passwd(old: SecureKey, new: SecureKey) -> Result<DoneReply, ControlRefusal> {
        transitions.withLock { _ in
            switch verify(old) {
            case .refused(let refusal): return .failure(refusal)
            case .accepted(let keys):
                for k in keys { k.wipe() }
                do {
                    var next = keybag.withLock { $0 }
                    try PasscodeKey.change(&next, old: old, new: new, deviceKey: deviceKey)  // two KDFs, off the lock
                    keybag.withLock { $0 = next }
                    return .success(DoneReply())
                } catch {
                    return .failure(ControlRefusal(.internal, "passcode not changed: \(error)"))
                }
            }
        }
    }

    /// lock: `locking` and `willBecomeUnavailable` now; after the grace period the keys go.
    func lock(grace: Double?) -> StateReply {
        let g = max(0, grace ?? defaultGrace)
        return transitions.withLock { _ -> StateReply in
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
            return StateReply(state)
        }
    }

    /// Evicts class A and B keys (`Eviction`'s phases), then reports `locked`. Called with
    /// the transition lock held, from a thread that is not a FUSE worker.
    private func evict(ticket: UInt64) {
        guard machine.withLock({ $0.shouldEvict(ticket: ticket) }) else { return }
        Eviction(.lock).run(keyring: keyring, target: fs)
        Failpoint.evictionBeforeLocked.hit()
        let evs = machine.withLock { $0.evicted(ticket: ticket) }
        for e in evs { events.publish(e, state: .locked) }
        if !evs.isEmpty {
            stateChanged(.locked)
            armInactivityRelock(ticket: ticket)
        }
    }

    /// Daemon exit: every key zeroed (after the queued page drops: the caller detached
    /// the notifier first, which waits for them).
    func shutdown() {
        kernel.detach()
        transitions.withLock { _ in keyring.wipeAll() }
        fs.wipeFileKeys()
        HardwareAES.forgetKeySchedules()
        deviceKey.wipe()
        fs.directories.names.wipe()
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
        let line = ControlProtocol.encode(EventLine(event: event, state: state, time: ControlProtocol.timestamp()))
        let all = subscribers.withLock { Array($0.values) }
        for c in all where !c.sendEvent(line) {
            remove(c)
            c.hangUp()
        }
    }
}
