/// Pure transition logic of lock and unlock (no keys, no timers): the daemon asks it what
/// to do and performs the side effects. Each lock request gets a ticket; a grace timer
/// whose ticket is stale (the lock was cancelled by an unlock) does nothing.
public struct LockStateMachine: Sendable {
    /// Current state.
    public private(set) var state: LockState = .beforeFirstUnlock
    /// Ticket of the lock in progress.
    public private(set) var ticket: UInt64 = 0

    /// What a lock request asks the caller to do.
    public enum LockAction: Equatable, Sendable {
        /// Nothing to lock (before first unlock, or already locked).
        case nothing
        /// Send `willBecomeUnavailable`, evict after `grace` seconds with this ticket.
        case startGrace(ticket: UInt64)
        /// Already in the grace period; evict now with this ticket (a lock with grace 0 during `locking`).
        case evictNow(ticket: UInt64, sendWill: Bool)
    }

    public init() {}

    /// A correct passcode was presented; returns the events to send.
    public mutating func unlocked() -> [ProtectionEvent] {
        switch state {
        case .unlocked:
            return []
        case .locking:
            ticket &+= 1  // cancels the pending eviction
            state = .unlocked
            return [.didBecomeAvailable]
        case .beforeFirstUnlock, .locked:
            state = .unlocked
            return [.didBecomeAvailable]
        }
    }

    /// A lock was requested with `grace` seconds.
    public mutating func requestLock(grace: Double) -> LockAction {
        switch state {
        case .beforeFirstUnlock, .locked:
            return .nothing
        case .unlocked:
            ticket &+= 1
            state = .locking
            return grace > 0 ? .startGrace(ticket: ticket) : .evictNow(ticket: ticket, sendWill: true)
        case .locking:
            return grace > 0 ? .nothing : .evictNow(ticket: ticket, sendWill: false)
        }
    }

    /// Whether an eviction with `ticket` should still run (no unlock cancelled it).
    public func shouldEvict(ticket t: UInt64) -> Bool { state == .locking && ticket == t }

    /// The inactivity limit passed while `locked` (the lock with `ticket` was the last
    /// change): back to `beforeFirstUnlock`. Returns the events to send (none when an
    /// unlock or another lock came first).
    public mutating func returnToBeforeFirstUnlock(ticket t: UInt64) -> [ProtectionEvent] {
        guard state == .locked, ticket == t else { return [] }
        ticket &+= 1
        state = .beforeFirstUnlock
        return [.didReturnToBeforeFirstUnlock]
    }

    /// Keys are gone; returns the events to send.
    public mutating func evicted(ticket t: UInt64) -> [ProtectionEvent] {
        guard shouldEvict(ticket: t) else { return [] }
        state = .locked
        return [.didBecomeUnavailable]
    }
}
