import Foundation

/// What the user chose for the TPM's lockout authorization (the secret that clears the TPM's
/// dictionary-attack lockout) at enrollment: `--tpm2-lockout-auth-file`,
/// `--tpm2-accept-clearable-lockout`, or neither.
public enum TPMLockoutChoice: Sendable {
    /// keybagfs sets a random authorization where it is empty, and refuses where another holder set one.
    case own
    /// The authorization another tool set, given by the user: keybagfs keeps a copy.
    case given(SecureKey)
    /// The user accepts a lockout that whoever holds the authorization (anyone, where it is empty) can clear.
    case acceptClearable
}

/// Who holds the TPM's lockout authorization, as this device's enrollment records it; for the
/// two holders keybagfs knows, the authorization wrapped under a key only the store's class A
/// key gives (the passcode on this TPM, or the recovery key's escrow).
public struct TPMLockoutAuthority: Codable, Sendable, Equatable {
    /// Who set the authorization.
    public enum Holder: String, Codable, Sendable {
        /// keybagfs set a random one (the TPM's was empty).
        case keybagfs
        /// Another tool set it; the user gave it to keybagfs.
        case given
        /// The user accepted a clearable lockout (`--tpm2-accept-clearable-lockout`).
        case accepted
    }

    /// Who set it.
    public var holder: Holder
    /// The authorization (keybagfs, given): `KeyWrap` under the lockout key, base64.
    public var wrapped: String?
    /// The key set whose class A key the lockout key comes from.
    public var keySet: Int?
    /// The device the wrap is bound to (absent: the enrollment's own); a record carried over from
    /// the device's previous id (`recover --new-device-key`) keeps the id it was made for.
    public var deviceID: String?

    /// The key that wraps the authorization: BLAKE2b keyed by class A of `keySet`, bound to the
    /// store and device.
    static func wrapKey(classA: SecureKey, storeID: String, deviceID: String) throws -> SecureKey {
        try classA.withBytes {
            KeyWrap.keyedHash(
                key: $0, parts: [Array("keybagfs-tpm-lockout-v1".utf8), Array(storeID.utf8), Array(deviceID.utf8)])
        }
    }

    /// Associated data of the wrap.
    static func ad(storeID: String, deviceID: String) -> [UInt8] {
        Array("keybagfs-tpm-lockout-v1|\(storeID)|\(deviceID)".utf8)
    }

    /// `auth` wrapped for `holder` under class A of key set `keySet`.
    static func wrapping(
        _ auth: SecureKey, holder: Holder, sets: [UnlockedClassKeys], storeID: String, deviceID: String
    ) throws -> TPMLockoutAuthority {
        let n = sets.count - 1
        let k = try wrapKey(classA: sets[n].classA, storeID: storeID, deviceID: deviceID)
        defer { k.wipe() }
        let w = try KeyWrap.wrap(auth, with: k, ad: ad(storeID: storeID, deviceID: deviceID))
        return TPMLockoutAuthority(
            holder: holder, wrapped: Data(w).base64EncodedString(), keySet: n, deviceID: deviceID)
    }

    /// The authorization this record keeps, opened with the class A keys of `sets`; nil when it keeps none.
    func open(sets: [UnlockedClassKeys], storeID: String, deviceID own: String) throws -> SecureKey? {
        guard let wrapped, let blob = Data(base64Encoded: wrapped) else { return nil }
        let deviceID = self.deviceID ?? own
        guard let n = keySet, n >= 0, n < sets.count else {
            throw KeybagError.corrupt(
                "the TPM enrollment's lockout record names key set \(keySet ?? -1), which is not here")
        }
        let k = try Self.wrapKey(classA: sets[n].classA, storeID: storeID, deviceID: deviceID)
        defer { k.wipe() }
        do {
            return try KeyWrap.unwrap([UInt8](blob), with: k, ad: Self.ad(storeID: storeID, deviceID: deviceID))
        } catch {
            throw KeybagError.corrupt("the TPM enrollment's lockout record does not open (damaged or edited)")
        }
    }
}

/// The lockout authorization of this device's TPM: taken at enrollment, used to clear a lockout,
/// given back at removal.
extension TPMSealer {
    /// Who holds the lockout authorization, as the enrollment records it.
    public var lockoutHolder: TPMLockoutAuthority.Holder? { enrollment.withLock { $0.lockout?.holder } }

    /// The PCRs the enrollment binds to (empty: none).
    public var pcrs: [Int] { enrollment.withLock { $0.pcrs ?? [] } }

    /// The authorization record this enrollment keeps (carried from the enrollment of the same
    /// TPM it replaces), when it keeps one.
    private var keptAuthority: TPMLockoutAuthority? {
        enrollment.withLock { e in e.lockout.flatMap { $0.wrapped != nil ? $0 : nil } }
    }

    /// This device's id (the enrollment file's name).
    private var deviceID: String { ((path as NSString).lastPathComponent as NSString).deletingPathExtension }

    /// Whether the TPM's lockout authorization is empty though the enrollment did not accept that:
    /// an enrollment cut short, or one made before keybagfs took the lockout.
    public func lockoutUnfinished() throws -> Bool {
        guard enrollment.withLock({ $0.lockout?.holder }) != .accepted else { return false }
        return try !lockoutState().lockoutAuthSet
    }

    /// Checks, before anything is written, that the lockout can be taken as `choice` says: the
    /// TPM takes its lockout authorization now (not refusing it after a wrong one), a given one is
    /// the TPM's, and an authorization someone else set is not silently taken over.
    public func checkLockout(_ choice: TPMLockoutChoice) throws {
        try enrollment.withLock { e in
            let tpm = try TPMConnection(tcti: e.tcti, pinned: e.pin)
            do {
                switch choice {
                case .acceptClearable: return
                case .given(let auth): try tpm.changeLockoutAuth(from: auth, to: auth)
                case .own:
                    if try tpm.lockoutState().lockoutAuthSet {
                        guard e.lockout?.wrapped != nil else { throw Self.heldElsewhere }
                    } else {
                        try tpm.changeLockoutAuth(from: nil, to: nil)
                    }
                }
            } catch TPMError.lockout {
                throw Self.lockoutRefused(tpm)
            } catch TPMError.badAuth {
                throw KeybagError.invalid(
                    "the TPM refused the lockout authorization given with --tpm2-lockout-auth-file (it is not the "
                        + "TPM's; the TPM now refuses its lockout authorization for a while); nothing was changed")
            }
        }
    }

    /// The refusal where another holder set the lockout authorization.
    private static var heldElsewhere: KeybagError {
        KeybagError.invalid(
            "the TPM's lockout authorization is already set (by another tool, or by keybagfs for another store), so "
                + "keybagfs cannot keep the lockout for you: give it with --tpm2-lockout-auth-file FILE (keybagfs keeps "
                + "a copy that only the recovery key or your passcode opens), or pass --tpm2-accept-clearable-lockout "
                + "to leave the lockout to whoever holds it; nothing was changed")
    }

    /// The refusal while the TPM refuses its lockout authorization (after a wrong one was tried).
    private static func lockoutRefused(_ tpm: TPMConnection, bound: Bool = false) -> KeybagError {
        let wait = (try? tpm.lockoutState().lockoutRecovery) ?? 0
        return KeybagError.invalid(
            "the TPM refuses its lockout authorization for up to \(wait) s after a wrong one was tried (someone tried "
                + "to clear or change it): "
                + (bound
                    ? "the passcode is bound to the TPM, but its lockout is not taken yet: run `keybagfs tpm2 enroll "
                        + "STORE` again after that to finish"
                    : "run this again after that; nothing was changed"))
    }

    /// Takes the lockout as `choice` says (after `checkLockout`), once the enrollment holds its
    /// first object: records the holder (and a wrapped copy of the authorization, under class A
    /// of the newest of `sets`) before the TPM's authorization changes, so a crash leaves a
    /// record, never an authorization nobody has. A kept authorization the TPM lacks (an
    /// enrollment cut short) is set again.
    public func takeLockout(_ choice: TPMLockoutChoice, sets: [UnlockedClassKeys], storeID: String) throws {
        try enrollment.withLock { e in
            let tpm = try TPMConnection(tcti: e.tcti, pinned: e.pin)
            var next = e
            var apply: SecureKey?
            defer { apply?.wipe() }
            switch choice {
            case .acceptClearable:
                next.lockout = TPMLockoutAuthority(holder: .accepted)
            case .given(let auth):
                next.lockout = try .wrapping(auth, holder: .given, sets: sets, storeID: storeID, deviceID: deviceID)
            case .own:
                let isSet = try tpm.lockoutState().lockoutAuthSet
                if let kept = e.lockout, let auth = try kept.open(sets: sets, storeID: storeID, deviceID: deviceID) {
                    apply = auth  // wiped on the way out; applied below only where the TPM lacks it
                    next.lockout = try .wrapping(
                        auth, holder: kept.holder, sets: sets, storeID: storeID, deviceID: deviceID)
                    if isSet { apply = nil; auth.wipe() }
                } else if isSet {
                    throw KeybagError.invalid(
                        "the TPM's lockout authorization was set by someone else while this ran: the passcode is bound "
                            + "to the TPM, its lockout not taken; run `keybagfs tpm2 enroll STORE` again with "
                            + "--tpm2-lockout-auth-file or --tpm2-accept-clearable-lockout to finish")
                } else {
                    let auth = SecureKey(random: 32)
                    apply = auth
                    next.lockout = try .wrapping(
                        auth, holder: .keybagfs, sets: sets, storeID: storeID, deviceID: deviceID)
                }
            }
            try next.save(to: path)
            e = next
            do { if let apply { try tpm.changeLockoutAuth(from: nil, to: apply) } } catch TPMError.lockout {
                throw Self.lockoutRefused(tpm, bound: true)
            }
        }
    }

    /// Ends the TPM's dictionary-attack lockout with the authorization the enrollment keeps,
    /// opened with class A of `sets` (from the recovery key's escrow, or the passcode).
    public func clearLockout(sets: [UnlockedClassKeys], storeID: String) throws {
        try enrollment.withLock { e in
            guard let record = e.lockout, let auth = try record.open(sets: sets, storeID: storeID, deviceID: deviceID)
            else {
                throw KeybagError.invalid(
                    "this device's TPM enrollment keeps no lockout authorization (it was enrolled with "
                        + "--tpm2-accept-clearable-lockout, or before keybagfs kept one): clear the lockout with the "
                        + "TPM's own tools (tpm2_dictionarylockout -c), or wait for it to pass")
            }
            defer { auth.wipe() }
            let tpm = try TPMConnection(tcti: e.tcti, pinned: e.pin)
            do { try tpm.resetLockout(auth: auth) } catch TPMError.lockout { throw Self.lockoutRefused(tpm) }
        }
    }

    /// Sets the lockout authorization back to empty when keybagfs set it and the TPM has it (the
    /// device leaves its TPM); true when it did. Throws, and changes nothing, while the TPM
    /// refuses its lockout authorization: the caller keeps the enrollment, which keeps the record.
    public func releaseLockout(sets: [UnlockedClassKeys], storeID: String) throws -> Bool {
        try enrollment.withLock { e in
            guard let record = e.lockout, record.holder == .keybagfs,
                let auth = try record.open(sets: sets, storeID: storeID, deviceID: deviceID)
            else { return false }
            defer { auth.wipe() }
            let tpm = try TPMConnection(tcti: e.tcti, pinned: e.pin)
            guard try tpm.lockoutState().lockoutAuthSet else { return false }
            do { try tpm.changeLockoutAuth(from: auth, to: nil) } catch TPMError.lockout {
                throw Self.lockoutRefused(tpm)
            }
            return true
        }
    }

    /// Notes, before the enrollment's first save (the first seal, which comes before the keybag's
    /// save), that files are to move to key set `n`: no cut after the keybag's save can lose it.
    public func notePendingRewrap(_ n: Int) { enrollment.withLock { $0.pendingRewrap = n } }

    /// Records that files are still to move to key set `n` (nil: none), so status and a second
    /// `tpm2 enroll` can tell an enrollment cut short.
    public func setPendingRewrap(_ n: Int?) throws {
        try enrollment.withLock { e in
            guard e.pendingRewrap != n else { return }
            var next = e
            next.pendingRewrap = n
            try next.save(to: path)
            e = next
        }
    }

    /// The key set files are still to move to, when an enrollment was cut short.
    public var pendingRewrap: Int? { enrollment.withLock { $0.pendingRewrap } }
}
