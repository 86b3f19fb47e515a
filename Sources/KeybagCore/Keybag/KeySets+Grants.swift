import Foundation

/// Handing a new key set to the devices that stay (`KeySetRecord`), taking one up, and the
/// recovery key's rotation for every device.
extension KeySets {
    /// The record of key set `keys.current`, just made by this device (`maker`), for every
    /// device `trust` holds but `removed`: the set sealed to each, unsigned (see `publish`).
    static func keySetRecord(
        _ keys: StoreKeys, maker: DevicePublicKeys, makerID: String, storeID: String, removed: [String],
        trust: DeviceTrust, now: Double
    ) throws -> KeySetRecord {
        let n = keys.current
        var members = trust.trusted.filter { !removed.contains($0.key) }
        members[makerID] = maker
        let payload = try KeySetRecord.grantPayload(keys.sets[n], classD: keys.classD[n], n: n)
        defer { payload.wipe() }
        var grants: [String: String] = [:]
        for (id, k) in members {  // the maker too: cut before its own save, it takes the set up from here
            grants[id] = Data(try SealedBox.seal(payload, to: k.boxKey)).base64EncodedString()
        }
        return KeySetRecord(
            storeID: storeID, keySet: n, madeBy: makerID, madeAt: now.rounded(), removed: removed, members: members,
            classBPublic: Data(keys.sets[n].classBPublic).base64EncodedString(), grants: grants, escrow: [:],
            signature: "")
    }

    /// Makes key set `keys.current` (fresh keys, appended) known and saves it: its record for
    /// every device `trust` holds but `removed`, with the escrow slots of `next`, its keys MAC,
    /// signed by this device, by `root` (the certification key of the set before, which the
    /// other devices require) and by `certify` (a rotation's new certification key), written
    /// before this keybag's save (a cut in between: the maker's own grant gives the set back at
    /// its next unlock); then this keybag with the set and whom it trusts now. The `removals`
    /// records are signed and written after. Returns the record.
    @discardableResult
    static func publish(
        _ kb: inout Keybag, _ keys: StoreKeys, removed: [String], trust: DeviceTrust, next: KeybagFile,
        root: SecureKey?,
        certify: SecureKey?, removals: [DeviceRemoval], passcode: SecureKey, deviceKey: SecureKey, now: Double
    ) throws -> KeySetRecord {
        guard let me = kb.file.deviceID, let mine = ownDeviceKeys(kb) else {
            throw KeybagError.invalid("this device has no identity")
        }
        let identity = try DeviceIdentityKeys.open(from: kb, classA0: keys.sets[0].classA, deviceKey: deviceKey)
        defer { identity.wipe() }
        var record = try keySetRecord(
            keys, maker: mine, makerID: me, storeID: kb.file.storeID, removed: removed, trust: trust, now: now)
        if let certify { record.certify = Data(try Ed25519.publicKey(seed: certify)).base64EncodedString() }
        let approvals = DeviceTrust.knownApprovals(kb, trust).filter { record.members[$0.key] != nil }
        record.approvals = approvals.isEmpty ? nil : approvals
        record.escrow = next.wrapped.filter { $0.key.hasPrefix("r") }
        record.keysMAC = try record.keysMAC(classA: keys.sets[keys.current].classA)
        try record.sign(with: identity.signSeed)
        if let root { record.rootSignature = Data(try Ed25519.sign(record.message, seed: root)).base64EncodedString() }
        if let certify {
            record.certifySignature = Data(try Ed25519.sign(record.message, seed: certify)).base64EncodedString()
        }
        try record.write(storePath: kb.storePath)
        var next = next
        next.approvals = approvals
        DeviceTrust.remember(
            trusted: record.members, removed: trust.removed.union(removed), root: record.certifyKey ?? trust.root,
            in: &next)
        try save(
            &kb, keys, into: next, passcode: passcode, deviceKey: deviceKey, recovery: nil, sealer: kb.sealer)
        for var removal in removals {
            removal.by = me
            removal.signature = Data(try Ed25519.sign(removal.message, seed: identity.signSeed)).base64EncodedString()
            try StoreDevices.makeFolder(kb.storePath)
            try AtomicFile.write(
                try JSONEncoder().encode(removal), to: kb.storePath + "/" + StoreDevices.removalPath(removal.deviceID))
        }
        return record
    }

    /// This device's public keys as a record lists them (nil: no identity).
    static func ownDeviceKeys(_ kb: Keybag) -> DevicePublicKeys? {
        guard let box = kb.file.identityBox, let sign = kb.file.identitySign else { return nil }
        return DevicePublicKeys(box: box, sign: sign)
    }

    /// Every escrow slot this keybag holds (`r` + slot name → wrapped key, base64).
    static func escrowSlots(_ kb: Keybag) -> [String: String] { kb.file.wrapped.filter { $0.key.hasPrefix("r") } }

    /// Takes up the key sets newer than this keybag's that records `trust` holds handed to
    /// this device: opens each grant with its identity key, wraps the sets beside the others
    /// (under the passcode) with the maker's escrow slots, and saves. Returns every key, the
    /// new sets last (the caller wipes them). `invalid` when a newer set was not handed to
    /// this device (it needs `keybagfs recover`).
    public static func takeUp(_ kb: inout Keybag, passcode: SecureKey, deviceKey: SecureKey, trust: DeviceTrust) throws
        -> StoreKeys
    {
        guard let me = kb.file.deviceID, trust.newestSet > kb.currentKeySet else {
            throw KeybagError.invalid("no newer key set to take up")
        }
        let sets = (kb.currentKeySet + 1)...trust.newestSet
        for n in sets where trust.records[n]?.grants[me] == nil {
            throw KeybagError.invalid(
                "key set \(n) was not handed to this device (made before it was certified, or by a keybagfs without "
                    + "device identities): take it up with `keybagfs recover`")
        }
        var keys = try kb.openAll(passcode: passcode, deviceKey: deviceKey)
        var next = kb.file
        do {
            let identity = try DeviceIdentityKeys.open(from: kb, classA0: keys.sets[0].classA, deviceKey: deviceKey)
            defer { identity.wipe() }
            for n in sets {
                let record = trust.records[n]!
                let (set, d) = try record.openGrant(for: me, boxSecret: identity.boxSecret)
                keys.sets.append(set)
                keys.classD.append(d)
                guard record.hasKeysMAC(classA: set.classA) else {
                    throw KeybagError.corrupt("the record of key set \(n) was not made with that set's keys")
                }
            }
            // The maker's escrow (under the recovery key, every set) replaces this device's own.
            let escrow = trust.records[trust.newestSet]!.escrow
            if kb.hasRecoveryKey, RecoveryEscrow.isComplete(escrow, sets: trust.newestSet) {
                next.wrapped = next.wrapped.filter { !$0.key.hasPrefix("r") }.merging(escrow) { $1 }
            }
            // What the records say (signed with the certification key) wins, newest last.
            var approvals = DeviceTrust.knownApprovals(kb, trust)
            for n in sets {
                approvals.merge(DeviceTrust.wellFormed(trust.records[n]?.approvals ?? [:])) { _, new in new }
            }
            next.approvals = approvals
            DeviceTrust.remember(trusted: trust.trusted, removed: trust.removed, root: trust.root, in: &next)
            try save(
                &kb, keys, into: next, passcode: passcode, deviceKey: deviceKey, recovery: nil, sealer: kb.sealer)
        } catch {
            keys.wipe()
            throw error
        }
        return keys
    }

    /// `recovery-key rotate` on a device with an identity: a new key set, a new store
    /// certification key and the new recovery key, handed to every device this one trusts in
    /// a record signed by it and by the new certification key. Files written from then on
    /// open with no key the old recovery key reaches, on any device that takes the set up.
    static func rotateForAll(
        _ kb: inout Keybag, _ keys: StoreKeys, trust: DeviceTrust, current: RecoveryKey?, passcode: SecureKey,
        deviceKey: SecureKey,
        now: Double, deliver: (RecoveryKey) throws -> Void
    ) throws -> RecoveryKey {
        guard kb.currentKeySet < Keybag.maxKeySet else {
            throw KeybagError.invalid("this store has \(Keybag.maxKeySet + 1) key sets, the most it can have")
        }
        try refuseWhileBehind(kb, trust)
        // With other devices, the rotation takes over their escrow: only the current key's holder may.
        let alone =
            trust.trusted.keys.allSatisfy { $0 == kb.file.deviceID }
            && StoreDevices.list(storePath: kb.storePath).allSatisfy {
                $0.removedAt != nil || $0.id == kb.file.deviceID
            }
        guard alone || current != nil else {
            throw KeybagError.invalid(
                "this store has other devices: give the current recovery key too (--current-recovery-key-file), so "
                    + "that a device alone cannot take the store's recovery key over")
        }
        var root: SecureKey?
        if let current {
            let escrowed = try RecoveryEscrow.keysCounted(&kb, recovery: current, now: now)
            defer { escrowed.wipe() }
            guard try escrowed.sameKeys(as: keys) else {
                throw KeybagError.corrupt("the recovery slots do not match this keybag (damaged or replaced)")
            }
            root = try DeviceIdentityKeys.certifySeed(storePath: kb.storePath, recovery: current, preferring: kb)
        }
        defer { root?.wipe() }
        var keys = keys
        try keys.addFreshSet()
        defer { keys.sets.last?.wipe(); keys.classD.last?.wipe() }
        let certify = SecureKey(random: 32)
        defer { certify.wipe() }
        let recovery = RecoveryKey.generate()
        var next = kb.file
        try RecoveryEscrow.write(
            &next, keys: [(DeviceIdentityKeys.certifySlot, certify)] + keys.escrowEntries(), recovery: recovery)
        next.recoveryFailedAttempts = nil
        next.recoveryLockoutUntil = nil
        do { try deliver(recovery) } catch { recovery.wipe(); throw error }
        try publish(
            &kb,
            keys, removed: [], trust: trust, next: next, root: root, certify: certify, removals: [], passcode: passcode,
            deviceKey: deviceKey, now: now)
        return recovery
    }

    /// Refuses to make a key set, or to approve a device, while a device this one trusts made
    /// a newer set than it holds (two sets of one number would split the store).
    static func refuseWhileBehind(_ kb: Keybag, _ trust: DeviceTrust) throws {
        guard trust.newestSet <= kb.currentKeySet else {
            throw KeybagError.invalid(
                "another device made key set \(trust.newestSet) and this device holds \(kb.currentKeySet): unlock it once "
                    + "to take the set up (or run `keybagfs recover`), then try again")
        }
    }
}
