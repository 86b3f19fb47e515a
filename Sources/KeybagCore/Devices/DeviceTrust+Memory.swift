import Foundation

/// What a device remembers of whom it trusts (its keybag's identity fields), and how it judges
/// the store's records with that memory.
extension DeviceTrust {
    /// The store certification key this device trusts (nil: a device from before identities).
    public static func certificationRoot(_ kb: Keybag) -> [UInt8]? {
        kb.file.storeCertify.flatMap { Data(base64Encoded: $0) }.map([UInt8].init)
    }

    /// This device's memory of whom it trusts, at its newest set (nil: no identity).
    public static func snapshot(_ kb: Keybag) -> TrustSnapshot? {
        guard kb.file.identitySign != nil, let root = certificationRoot(kb),
            let trusted = kb.file.trustedDevices
        else {
            return nil
        }
        var classB: [Int: String] = [0: kb.file.classBPublic]
        for (k, v) in kb.file.classBPublics ?? [:] { if let n = Int(k) { classB[n] = v } }
        return TrustSnapshot(
            keySet: kb.currentKeySet, root: root, trusted: trusted, removed: Set(kb.file.removedDevices ?? []),
            classBPublics: classB)
    }

    /// Whether this device has identity keys and a memory of whom it trusts.
    public static func hasIdentity(_ kb: Keybag) -> Bool { snapshot(kb) != nil }

    /// The store's devices, certificates and records as this device judges them (nil: a
    /// device without identity, which goes by every removal record as before).
    public static func of(_ kb: Keybag) -> DeviceTrust? {
        snapshot(kb).map {
            DeviceTrust.evaluate(storePath: kb.storePath, storeID: kb.file.storeID, snapshot: $0)
        }
    }

    /// The newest key set this device must know of: the newest set a record it trusts made,
    /// or (a device without identity) the newest set any removal record claims.
    public static func newestKeySet(_ kb: Keybag) -> Int {
        if let trust = DeviceTrust.of(kb) { return trust.newestSet }
        return StoreDevices.newestKeySet(storePath: kb.storePath)
    }

    /// A device that started from nobody but itself (added or recovered before the record of
    /// its newest set reached its replica) takes that record's list once it is there and is
    /// vouched for by its certification key, its maker and the set's keys (`classA`, from an
    /// unlock); the certification key stays its own. Saves. Whether it did.
    public static func adoptRecordOfHeldSet(_ kb: inout Keybag, classA: SecureKey) throws -> Bool {
        guard let snap = snapshot(kb), let me = kb.file.deviceID, kb.currentKeySet > 0,
            snap.trusted.keys.allSatisfy({ $0 == me })
        else { return false }
        let held = snap.classBPublics[kb.currentKeySet]
        let genuine = DeviceTrust.records(storePath: kb.storePath, storeID: kb.file.storeID).filter {
            $0.keySet == kb.currentKeySet && $0.classBPublic == held && $0.isVouched(byRoot: snap.root, classA: classA)
        }
        guard genuine.count == 1, let r = genuine.first else { return false }
        var trusted = r.members
        trusted[me] = snap.trusted[me]
        var next = kb.file
        next.approvals = (next.approvals ?? [:]).merging(wellFormed(r.approvals ?? [:])) { _, new in new }
        remember(trusted: trusted, removed: snap.removed.union(r.removed), root: snap.root, in: &next)
        kb.file = next
        try kb.save()
        return true
    }

    /// Judges the store's records and keeps, for good, the devices certified at this device's
    /// newest set that it did not know yet (with their keys), so that a certificate replaced
    /// later cannot give their ids other keys; saves when it learnt one. Returns the judgement
    /// (nil: no identity).
    @discardableResult
    public static func rememberCertified(_ kb: inout Keybag, deviceKey: SecureKey? = nil) throws -> DeviceTrust? {
        guard let trust = DeviceTrust.of(kb), let known = kb.file.trustedDevices else { return nil }
        let new = trust.trusted.filter { known[$0.key] == nil && !trust.removed.contains($0.key) }
        guard trust.newestSet == kb.currentKeySet, !new.isEmpty else { return trust }
        if kb.counterKey == nil, let deviceKey { _ = try kb.authenticate(deviceKey: deviceKey) }
        guard kb.counterKey != nil else { return trust }  // a command without the device key: next time
        kb.file.trustedDevices = known.merging(new) { old, _ in old }
        kb.file.approvals = (kb.file.approvals ?? [:]).merging(trust.approvedBy.filter { new[$0.key] != nil }) {
            old, _ in old
        }
        try kb.save()
        return DeviceTrust.of(kb)
    }

    /// Who approved whom, as this device knows it: what it remembers and what `trust` says.
    static func knownApprovals(_ kb: Keybag, _ trust: DeviceTrust) -> [String: String] {
        (kb.file.approvals ?? [:]).merging(trust.approvedBy) { old, _ in old }
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
    public static func approvalChain(_ kb: Keybag, of id: String, trust: DeviceTrust, keep: Set<String> = [])
        -> [String]
    {
        let by = knownApprovals(kb, trust)
        var chain: [String] = [], frontier = [id]
        while let a = frontier.popLast() {
            for (d, approver) in by.sorted(by: { $0.key < $1.key })
            where approver == a && d != id && !chain.contains(d) && !keep.contains(d) && d != kb.file.deviceID {
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
}
