import Foundation

/// Giving a keybag its identity: fresh key pairs, the store certification key it trusts and
/// that key's escrow under the recovery key, and its certificate.
extension DeviceIdentityKeys {
    /// Escrow slot (`r` + name) of the store certification key's seed.
    static let certifySlot = "certify"

    /// The store certification key's seed escrowed in this keybag (nil: none escrowed here).
    static func escrowedCertifySeed(_ kb: Keybag, recovery: RecoveryKey) throws -> SecureKey? {
        guard kb.file.wrapped["r" + certifySlot] != nil else { return nil }
        let rwk = try recovery.wrapKey(storeID: kb.file.storeID)
        defer { rwk.wipe() }
        return try RecoveryEscrow.open(certifySlot, in: kb.file, rwk: rwk)
    }

    /// The store certification key's seed: the one escrowed in the keybag of the store that
    /// the recovery key opens and that holds the newest set (only its holders can have written
    /// one), else a new one when no keybag has one at all (a store made before identities gets
    /// its key with its first identity); refused when some have one and none opens.
    static func certifySeed(storePath: String, recovery: RecoveryKey, preferring first: Keybag?) throws -> SecureKey {
        let others = StoreDevices.list(storePath: storePath).compactMap { d in
            d.keybag.flatMap { try? Keybag.load(storePath: storePath, relativePath: $0) }
        }
        let all = ([first].compactMap { $0 } + others).sorted { $0.currentKeySet > $1.currentKeySet }
        for kb in all {
            if let seed = try? escrowedCertifySeed(kb, recovery: recovery) { return seed }
        }
        guard !all.contains(where: { $0.file.wrapped["r" + certifySlot] != nil }) else {
            throw KeybagError.corrupt(
                "no keybag's escrow of the store's certification key opens with this recovery key (damaged or "
                    + "replaced); nothing was changed")
        }
        return SecureKey(random: 32)
    }

    /// Gives `f` (a keybag being written with the recovery key at hand) fresh identity keys,
    /// the certification key's public half and its escrow; returns the certificate, signed
    /// with the certification key, that the caller writes once the keybag is saved.
    /// Whom it trusts comes from the store's records, as far as `keys` (the store's keys, from
    /// the recovery key) vouch for them (`DeviceTrust.bootstrap`).
    static func make(
        _ f: inout KeybagFile, keys storeKeys: StoreKeys, storePath: String, deviceKey: SecureKey,
        certifySeed: SecureKey, recovery: RecoveryKey, now: Double = Date().timeIntervalSince1970
    ) throws -> DeviceCertificate {
        guard let id = f.deviceID else { throw KeybagError.invalid("a keybag without a device id has no identity") }
        let keys = DeviceIdentityKeys.generate()
        defer { keys.wipe() }
        try keys.store(into: &f, classA0: storeKeys.sets[0].classA, deviceKey: deviceKey)
        let snapshot = DeviceTrust.bootstrap(
            storePath: storePath, storeID: f.storeID, root: try Ed25519.publicKey(seed: certifySeed), keys: storeKeys)
        var trusted = snapshot.trusted
        trusted[id] = DevicePublicKeys(box: f.identityBox!, sign: f.identitySign!)
        f.approvals = DeviceTrust.wellFormed(snapshot.approvals)
        DeviceTrust.remember(trusted: trusted, removed: snapshot.removed, root: snapshot.root, in: &f)
        try RecoveryEscrow.write(&f, keys: [(certifySlot, certifySeed)], recovery: recovery)
        return try DeviceCertificate.issue(
            storeID: f.storeID, deviceID: id, keys: keys, name: f.deviceName, keySet: f.keySet ?? 0,
            by: DeviceCertificate.byStore, signer: certifySeed, now: now)
    }

    /// Gives this device identity keys and a certificate from the recovery key, where it has
    /// none yet (a device from before identities); a wrong passcode is counted.
    public static func ensure(
        _ kb: inout Keybag, passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey,
        now: Double = Date().timeIntervalSince1970
    ) throws {
        guard !DeviceTrust.hasIdentity(kb) else { return }
        let keys = try PasscodeAttempts.openAllCounted(&kb, passcode: passcode, deviceKey: deviceKey, now: now)
        defer { keys.wipe() }
        let escrowed = try RecoveryEscrow.keys(in: kb.file, recovery: recovery)
        defer { escrowed.wipe() }
        guard try escrowed.sameKeys(as: keys) else {
            throw KeybagError.corrupt("the recovery slots do not match this keybag (damaged or replaced)")
        }
        if kb.file.deviceID == nil {
            kb.file.deviceID = try DeviceIdentity.id(deviceKey: deviceKey, storeID: kb.file.storeID)
        }
        let certify = try certifySeed(storePath: kb.storePath, recovery: recovery, preferring: kb)
        defer { certify.wipe() }
        var next = kb.file
        let certificate = try make(
            &next, keys: keys, storePath: kb.storePath, deviceKey: deviceKey, certifySeed: certify, recovery: recovery,
            now: now)
        kb.file = next
        try kb.save()
        try certificate.write(storePath: kb.storePath)
    }
}
