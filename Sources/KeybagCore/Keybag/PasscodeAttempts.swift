import Foundation

/// Failed passcode attempts: the count and lockout a keybag carries (under its counter MAC),
/// the wait they impose (the delays are `UnlockThrottle`'s), a wrong passcode counted and a
/// right one clearing the count, for the daemon's unlock and the offline commands alike.
public enum PasscodeAttempts {
    /// Seconds until the next attempt is allowed (0 when allowed now).
    /// Never longer than the longest delay: a lockout further ahead (a clock set back since)
    /// is cut here, not in the stored value, whose counter MAC must still verify.
    public static func retryAfter(_ kb: Keybag, now: Double) -> Double {
        max(0, min(kb.file.lockoutUntil - now, UnlockThrottle.delay(afterFailures: Int.max)))
    }

    /// Seconds until the next recovery attempt is allowed.
    public static func recoveryRetryAfter(_ kb: Keybag, now: Double) -> Double {
        max(0, min((kb.file.recoveryLockoutUntil ?? 0) - now, UnlockThrottle.delay(afterFailures: Int.max)))
    }

    /// Records a failed attempt and persists the counter and the resulting lockout.
    public static func recordFailure(_ kb: inout Keybag, now: Double) throws {
        kb.file.failedAttempts += 1
        let d = UnlockThrottle.delay(afterFailures: kb.file.failedAttempts)
        kb.file.lockoutUntil = d > 0 ? now + d : 0
        try kb.save()
    }

    /// Clears the counter after a success (persisted only when it changes).
    public static func recordSuccess(_ kb: inout Keybag) throws {
        guard kb.file.failedAttempts != 0 || kb.file.lockoutUntil != 0 else { return }
        kb.file.failedAttempts = 0
        kb.file.lockoutUntil = 0
        try kb.save()
    }

    /// `Keybag.unlockAll` for the offline commands: the keybag authenticated, the throttle
    /// honoured, a wrong passcode counted in the keybag (and, with a TPM, in the TPM's
    /// lockout), a right one clearing the count, as the daemon's unlock does.
    public static func unlockCounting(
        _ kb: inout Keybag, passcode: SecureKey, deviceKey: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> [UnlockedClassKeys] {
        try counted(&kb, deviceKey: deviceKey, now: now) { kb in
            let sets = try kb.unlockAll(passcode: passcode, deviceKey: deviceKey)
            do { try recordSuccess(&kb) } catch { for k in sets { k.wipe() }; throw error }
            return sets
        }
    }

    /// Every key of the keybag from the passcode (a wrong one counted, the throttle applied),
    /// for a command that rewraps files or reads the TPM's lockout record.
    public static func openAllCounted(
        _ kb: inout Keybag, passcode: SecureKey, deviceKey: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> StoreKeys {
        try counted(&kb, deviceKey: deviceKey, now: now) { kb in
            try kb.openAll(passcode: passcode, deviceKey: deviceKey)
        }
    }

    /// Runs `open` once the keybag is authenticated and no lockout holds; a wrong passcode is
    /// recorded before `badPasscode` goes on.
    private static func counted<R>(
        _ kb: inout Keybag, deviceKey: SecureKey, now: Double, _ open: (inout Keybag) throws -> R
    ) throws -> R {
        if kb.counterKey == nil { _ = try kb.authenticate(deviceKey: deviceKey, now: now) }
        let wait = retryAfter(kb, now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        do { return try open(&kb) } catch KeybagError.badPasscode {
            try recordFailure(&kb, now: now)
            throw KeybagError.badPasscode
        }
    }
}
