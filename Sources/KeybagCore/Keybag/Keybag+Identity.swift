import Foundation

/// A device's identity in its keybag: its key pairs, the store certification key it trusts,
/// and that key's escrow under the recovery key (docs/FORMAT.md, "Device identities").
extension Keybag {
    /// Escrow slot (`r` + name) of the store certification key's seed.
    static let certifySlot = "certify"

    /// The store certification key this device trusts (nil: a device from before identities).
    public var certificationRoot: [UInt8]? {
        file.storeCertify.flatMap { Data(base64Encoded: $0) }.map([UInt8].init)
    }

    /// This device's memory of whom it trusts, at its newest set (nil: no identity).
    public var trustSnapshot: TrustSnapshot? {
        guard file.identitySign != nil, let root = certificationRoot, let trusted = file.trustedDevices else {
            return nil
        }
        var classB: [Int: String] = [0: file.classBPublic]
        for (k, v) in file.classBPublics ?? [:] { if let n = Int(k) { classB[n] = v } }
        return TrustSnapshot(
            keySet: currentKeySet, root: root, trusted: trusted, removed: Set(file.removedDevices ?? []),
            classBPublics: classB)
    }

    /// Whether this device has identity keys and a memory of whom it trusts.
    public var hasIdentity: Bool { trustSnapshot != nil }

    /// The store's devices, certificates and records as this device judges them (nil: a
    /// device without identity, which goes by every removal record as before).
    public func deviceTrust() -> DeviceTrust? {
        trustSnapshot.map { DeviceTrust.evaluate(storePath: storePath, storeID: file.storeID, snapshot: $0) }
    }

    /// The newest key set this device must know of: the newest set a record it trusts made,
    /// or (a device without identity) the newest set any removal record claims.
    public func newestKeySetInStore() -> Int {
        if let trust = deviceTrust() { return trust.newestSet }
        return StoreDevices.newestKeySet(storePath: storePath)
    }

    /// A device that started from nobody but itself (added or recovered before the record of
    /// its newest set reached its replica) takes that record's list once it is there and is
    /// vouched for by its certification key, its maker and the set's keys (`classA`, from an
    /// unlock); the certification key stays its own. Saves. Whether it did.
    public mutating func adoptRecordOfHeldSet(classA: SecureKey) throws -> Bool {
        guard let snap = trustSnapshot, let me = file.deviceID, currentKeySet > 0,
            snap.trusted.keys.allSatisfy({ $0 == me })
        else { return false }
        let held = snap.classBPublics[currentKeySet]
        let genuine = DeviceTrust.records(storePath: storePath, storeID: file.storeID).filter {
            $0.keySet == currentKeySet && $0.classBPublic == held && $0.isVouched(byRoot: snap.root, classA: classA)
        }
        guard genuine.count == 1, let r = genuine.first else { return false }
        var trusted = r.members
        trusted[me] = snap.trusted[me]
        var next = file
        next.approvals = (next.approvals ?? [:]).merging(Keybag.wellFormed(r.approvals ?? [:])) { _, new in new }
        Keybag.remember(trusted: trusted, removed: snap.removed.union(r.removed), root: snap.root, in: &next)
        file = next
        try save()
        return true
    }

    /// Judges the store's records and keeps, for good, the devices certified at this device's
    /// newest set that it did not know yet (with their keys), so that a certificate replaced
    /// later cannot give their ids other keys; saves when it learnt one. Returns the judgement
    /// (nil: no identity).
    @discardableResult
    public mutating func rememberCertified(deviceKey: SecureKey? = nil) throws -> DeviceTrust? {
        guard let trust = deviceTrust(), let known = file.trustedDevices else { return nil }
        let new = trust.trusted.filter { known[$0.key] == nil && !trust.removed.contains($0.key) }
        guard trust.newestSet == currentKeySet, !new.isEmpty else { return trust }
        if counterKey == nil, let deviceKey { _ = try authenticate(deviceKey: deviceKey) }
        guard counterKey != nil else { return trust }  // a command without the device key: next time
        file.trustedDevices = known.merging(new) { old, _ in old }
        file.approvals = (file.approvals ?? [:]).merging(trust.approvedBy.filter { new[$0.key] != nil }) { old, _ in old
        }
        try save()
        return deviceTrust()
    }

    /// Who approved whom, as this device knows it: what it remembers and what `trust` says.
    func knownApprovals(_ trust: DeviceTrust) -> [String: String] {
        (file.approvals ?? [:]).merging(trust.approvedBy) { old, _ in old }
    }

    /// The entries of `approvals` that are a device id and an approver (a device id, or "store").
    static func wellFormed(_ approvals: [String: String]) -> [String: String] {
        approvals.filter {
            DeviceIdentity.isWellFormed($0.key)
                && (DeviceIdentity.isWellFormed($0.value) || $0.value == DeviceCertificate.byStore)
        }
    }

    /// The devices `id` approved, and those they approved in turn, as this device remembers
    /// them and as the certificates it accepted say (not counting `keep`).
    public func approvalChain(of id: String, trust: DeviceTrust, keep: Set<String> = []) -> [String] {
        let by = knownApprovals(trust)
        var chain: [String] = [], frontier = [id]
        while let a = frontier.popLast() {
            for (d, approver) in by.sorted(by: { $0.key < $1.key })
            where approver == a && d != id && !chain.contains(d) && !keep.contains(d) && d != file.deviceID {
                chain.append(d)
                frontier.append(d)
            }
        }
        return chain
    }

    /// Keeps in `f` whom this device trusts at its newest set (after making or taking it up).
    static func remember(
        trusted: [String: DevicePublicKeys], removed: Set<String>, root: [UInt8], in f: inout KeybagFile
    ) {
        f.trustedDevices = trusted.filter { !removed.contains($0.key) }
        f.removedDevices = removed.sorted()
        f.storeCertify = Data(root).base64EncodedString()
        if let a = f.approvals { f.approvals = a.filter { f.trustedDevices?[$0.key] != nil } }
    }

    /// The store certification key's seed escrowed in this keybag (nil: none escrowed here).
    func escrowedCertifySeed(recovery: RecoveryKey) throws -> SecureKey? {
        guard file.wrapped["r" + Keybag.certifySlot] != nil else { return nil }
        let rwk = try recovery.wrapKey(storeID: file.storeID)
        defer { rwk.wipe() }
        return try RecoveryEscrow.open(Keybag.certifySlot, in: file, rwk: rwk)
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
            if let seed = try? kb.escrowedCertifySeed(recovery: recovery) { return seed }
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
    static func makeIdentity(
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
        f.approvals = wellFormed(snapshot.approvals)
        remember(trusted: trusted, removed: snapshot.removed, root: snapshot.root, in: &f)
        try RecoveryEscrow.write(&f, keys: [(certifySlot, certifySeed)], recovery: recovery)
        return try DeviceCertificate.issue(
            storeID: f.storeID, deviceID: id, keys: keys, name: f.deviceName, keySet: f.keySet ?? 0,
            by: DeviceCertificate.byStore, signer: certifySeed, now: now)
    }

    /// This device's identity keys, opened with class A of key set 0.
    func identityKeys(classA0: SecureKey, deviceKey: SecureKey) throws -> DeviceIdentityKeys {
        try DeviceIdentityKeys.open(from: self, classA0: classA0, deviceKey: deviceKey)
    }
}
