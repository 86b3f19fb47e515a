import CSodium
import Foundation

/// Joining a store (a keybag of its own from the recovery key) and removing a device from it
/// (a new key set the removed device never gets).
extension StoreDevices {
    /// The keybag whose recovery slots open with `recovery` and hold the most key sets, with
    /// its keys. Escrow slots are sealed under the recovery key itself, so only its holders
    /// can have written them; a keybag that claims more sets without such slots is passed over.
    public static func escrowSource(storePath: String, recovery: RecoveryKey) throws -> (Keybag, StoreKeys) {
        let keybags = StoreDevices.list(storePath: storePath).compactMap { d in
            d.keybag.flatMap { try? Keybag.load(storePath: storePath, relativePath: $0) }
        }
        var failure: Error = KeybagError.invalid("this store has no keybag with recovery slots")
        let storeID = try Keybag.load(storePath: storePath).file.storeID
        for kb in keybags.sorted(by: { $0.currentKeySet > $1.currentKeySet })
        where kb.hasRecoveryKey && kb.file.storeID == storeID {
            do { return (kb, try RecoveryEscrow.keys(in: kb.file, recovery: recovery)) } catch { failure = error }
        }
        throw failure
    }

    /// The device of the store that `deviceKey` already is (its id), or nil: the key opens the
    /// first device's keybag, or a device keybag carries the key's id.
    public static func deviceOwning(key deviceKey: SecureKey, storePath: String) throws -> String? {
        let storeID = try Keybag.load(storePath: storePath).file.storeID
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID)
        if let first = try? Keybag.load(storePath: storePath, relativePath: Keybag.fileName),
            let d = try? first.unwrapDeviceKeySlot("D", deviceKey: deviceKey)
        {
            d.wipe()
            return first.file.deviceID ?? id
        }
        return StoreDevices.list(storePath: storePath).contains { $0.id == id && $0.keybag != nil } ? id : nil
    }

    /// Adds the device holding `deviceKey` to the store with the recovery key: a keybag of
    /// its own (`devices/ID.keybag`) with every key set the recovery key covers, under its
    /// own passcode and device key, with its own counter. No key leaves either device; the
    /// keys come from the store's escrow slots.
    /// With `sealer` (this machine's TPM) the keybag is bound to it from its first write, so
    /// no copy of it can be guessed off the TPM; `withKeys` gets the keys before they are wiped.
    public static func add(
        storePath: String, recovery: RecoveryKey, passcode: SecureKey, deviceKey: SecureKey, name: String?,
        strength: KDFStrength, sealer: (any PasscodeSealer)? = nil, withKeys: (StoreKeys) throws -> Void = { _ in }
    ) throws -> Keybag {
        let any = try Keybag.load(storePath: storePath)
        guard any.hasRecoveryKey else {
            throw KeybagError.invalid("this store has no recovery key: a device can only be added with one")
        }
        let storeID = any.file.storeID
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID)
        guard StoreDevices.removal(storePath: storePath, id: id) == nil else {
            throw KeybagError.invalid("this device key was removed from the store: make a new device key")
        }
        guard try deviceOwning(key: deviceKey, storePath: storePath) == nil else {
            throw KeybagError.invalid(
                "this device key is already a device of the store (\(id)); `keybagfs recover` gives it key sets "
                    + "made since it was added")
        }
        let (source, keys) = try escrowSource(storePath: storePath, recovery: recovery)
        defer { keys.wipe() }
        var file = KeybagFile(
            format: Keybag.currentFormat, storeID: storeID, cipher: source.file.cipher,
            kdfOpsLimit: strength.opsLimit, kdfMemLimit: strength.memLimit,
            kdfSalt: Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString(),
            wrapped: [:], classBPublic: "", failedAttempts: 0, lockoutUntil: 0, counterMAC: nil)
        file.deviceID = id
        file.deviceName = name
        if sealer != nil { file.tpm2 = true }
        try KeySets.wrapAll(keys, into: &file, passcode: passcode, deviceKey: deviceKey, sealer: sealer)
        try RecoveryEscrow.write(&file, keys: keys.escrowEntries(), recovery: recovery)
        let certify = try DeviceIdentityKeys.certifySeed(storePath: storePath, recovery: recovery, preferring: source)
        defer { certify.wipe() }
        let certificate = try DeviceIdentityKeys.make(
            &file, keys: keys, storePath: storePath, deviceKey: deviceKey, certifySeed: certify, recovery: recovery)
        try StoreDevices.makeFolder(storePath)
        var kb = Keybag(
            storePath: storePath, file: file, counterKey: try KeybagMACs.counterKey(deviceKey),
            relativePath: StoreDevices.keybagPath(id))
        kb.sealer = sealer
        try kb.save()
        try sealer?.keepOnly(salt: file.kdfSalt)
        try certificate.write(storePath: storePath)
        try KeySetFloor.record(kb, deviceID: id)
        try withKeys(keys)
        return kb
    }

    /// The store path of the keybag of device `id` ("first": the device that made the
    /// store), refusing this device itself (`own`) and ids the store does not hold.
    private static func keybagOfDevice(_ kb: Keybag, _ id: String, own: String) throws -> String {
        if id == "first" {
            guard kb.relativePath != Keybag.fileName else {
                throw KeybagError.invalid("a device cannot remove itself; remove it from another one")
            }
            return Keybag.fileName
        }
        guard DeviceIdentity.isWellFormed(id) else {
            throw KeybagError.invalid("not a device id: \(id.prefix(40))")
        }
        guard id != own else {
            throw KeybagError.invalid("a device cannot remove itself; remove it from another one")
        }
        if FileManager.default.fileExists(atPath: kb.storePath + "/" + StoreDevices.keybagPath(id)) {
            return StoreDevices.keybagPath(id)
        }
        if (try? Keybag.load(storePath: kb.storePath, relativePath: Keybag.fileName))?.file.deviceID == id {
            return Keybag.fileName
        }
        // A device this one trusts is removed by its id, whatever became of its keybag (a thief
        // may delete or spoil it in the store): its keybag's path, which may hold nothing.
        if DeviceTrust.of(kb)?.trusted[id] != nil { return StoreDevices.keybagPath(id) }
        throw KeybagError.invalid("no device \(id) in this store (`keybagfs device list` shows them)")
    }

    /// The newest key set any device made. With the recovery key only keybags whose escrow
    /// opens count (a forged claim of a newer set cannot block a removal); without one every
    /// keybag and record counts.
    private static func newestKeySetMade(_ kb: Keybag, recovery: RecoveryKey?) throws -> Int {
        if let recovery {
            let (source, keys) = try escrowSource(storePath: kb.storePath, recovery: recovery)
            keys.wipe()
            return source.currentKeySet
        }
        let keybagSets = StoreDevices.list(storePath: kb.storePath).compactMap { d in
            d.keybag.flatMap { try? Keybag.load(storePath: kb.storePath, relativePath: $0) }?.currentKeySet
        }
        return max(StoreDevices.newestKeySet(storePath: kb.storePath), keybagSets.max() ?? 0)
    }

    /// The last steps of removing `removedID`, which a record already removed: its signed
    /// removal record where none is, and its keybag deleted (a wrong passcode is counted).
    private static func finishRemoval(
        _ kb: inout Keybag, _ removedID: String, keybag: String, trust: DeviceTrust, passcode: SecureKey,
        deviceKey: SecureKey, now: Double
    ) throws {
        if StoreDevices.removal(storePath: kb.storePath, id: removedID) == nil {
            let keys = try PasscodeAttempts.openAllCounted(&kb, passcode: passcode, deviceKey: deviceKey, now: now)
            defer { keys.wipe() }
            let identity = try DeviceIdentityKeys.open(from: kb, classA0: keys.sets[0].classA, deviceKey: deviceKey)
            defer { identity.wipe() }
            let set = trust.records.values.first { $0.removed.contains(removedID) }?.keySet ?? kb.currentKeySet
            var removal = DeviceRemoval(deviceID: removedID, removedAt: now, keySet: set, by: kb.file.deviceID)
            removal.signature = Data(try Ed25519.sign(removal.message, seed: identity.signSeed)).base64EncodedString()
            try StoreDevices.makeFolder(kb.storePath)
            try AtomicFile.write(
                try JSONEncoder().encode(removal), to: kb.storePath + "/" + StoreDevices.removalPath(removedID))
        }
        if unlink(kb.storePath + "/" + keybag) != 0 && errno != ENOENT {
            throw KeybagError.system("cannot delete \(keybag)", errno)
        }
        DeviceKeyFile.syncFolder(of: kb.storePath + "/" + keybag)
    }

    /// A removal on a device with an identity: a new set handed, in a record this device signs,
    /// to the devices that stay; the removed device and what it approved (but `keep`) go.
    private static func removeWithRecord(
        _ kb: inout Keybag, _ removedID: String, trust: DeviceTrust, keep: Set<String>,
        knownBefore: [String: DevicePublicKeys],
        passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?, now: Double
    ) throws -> Int {
        // Kept devices must be ones this device knew before (a keybag in the store can lie about keys).
        for k in keep where knownBefore[k] == nil {
            throw KeybagError.invalid(
                "--keep \(k.prefix(40)): not a device this device knew before this removal; check it on its own "
                    + "machine, or let it go and add it again")
        }
        try KeySets.refuseWhileBehind(kb, trust)
        let keys = try KeySets.keysWithFreshSet(
            &kb, passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
        defer { keys.wipe() }
        var next = kb.file
        if let recovery { try RecoveryEscrow.write(&next, keys: keys.escrowEntries(), recovery: recovery) }
        let root = try recovery.map {
            try DeviceIdentityKeys.certifySeed(storePath: kb.storePath, recovery: $0, preferring: kb)
        }
        defer { root?.wipe() }
        // The devices it approved go with it (and those they approved), but those kept.
        let removed = [removedID] + DeviceTrust.approvalChain(kb, of: removedID, trust: trust, keep: keep)
        try KeySets.publish(
            &kb,
            keys, removed: removed, trust: trust, next: next, root: root, certify: nil,
            removals: removed.map { DeviceRemoval(deviceID: $0, removedAt: now, keySet: keys.current) },
            passcode: passcode, deviceKey: deviceKey, now: now)
        for other in removed.dropFirst() { unlink(kb.storePath + "/" + StoreDevices.keybagPath(other)) }
        return keys.current
    }

    /// The id a removal records for `id` (`first`: the id the first keybag names, else "first"),
    /// whose keybag is `keybag`; refuses a keybag that names another device.
    private static func removedID(_ id: String, keybag: String, storePath: String) throws -> String {
        // The record's name comes from the argument, never from the (store-written) keybag; the
        // keybag is read only to learn the first device's id, or to refuse one that names another.
        let target = try? Keybag.load(storePath: storePath, relativePath: keybag)
        if id == "first" && target == nil { _ = try Keybag.load(storePath: storePath, relativePath: keybag) }
        let removedID = id == "first" ? (target?.file.deviceID ?? "first") : id
        guard id == "first" || target == nil || target?.file.deviceID == id else {
            throw KeybagError.corrupt("keybag \(keybag) names another device than its file name")
        }
        // The store's first keybag can be replaced by a store writer: it must not name a device
        // that has a keybag of its own (it would turn `remove first` against that device).
        guard
            id != "first"
                || !FileManager.default.fileExists(atPath: storePath + "/" + StoreDevices.keybagPath(removedID))
        else {
            throw KeybagError.corrupt(
                "the store's first keybag names device \(removedID), which has a keybag of its own (the first keybag "
                    + "was replaced?): remove devices by their id")
        }
        return removedID
    }

    /// Removes device `id` (a lost laptop; `first` names the store's first device): starts a
    /// new key set, so that nothing written from now on opens with the keys that device holds,
    /// records the removal and deletes its keybag from the store. Files written before stay
    /// readable to it. Needs this device's passcode (a wrong one is counted) and, when the
    /// store has one, the recovery key. Refused while this device lacks a newer key set
    /// another device made (two sets of one number would split the store). Returns the new set.
    public static func remove(
        _ kb: inout Keybag, _ id: String, passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?,
        keep: Set<String> = [],
        now: Double = Date().timeIntervalSince1970
    ) throws -> Int {
        let own = try DeviceIdentity.id(deviceKey: deviceKey, storeID: kb.file.storeID)
        let keybag = try keybagOfDevice(kb, id, own: own)
        let removedID = try removedID(id, keybag: keybag, storePath: kb.storePath)
        guard removedID != own else { throw KeybagError.invalid("a device cannot remove itself") }
        if let trust = DeviceTrust.of(kb), trust.removed.contains(removedID) {
            // A record already removed it: finish what a cut run of this command left (the
            // removal record, the keybag's deletion); nothing more.
            try finishRemoval(
                &kb,
                removedID, keybag: keybag, trust: trust, passcode: passcode, deviceKey: deviceKey, now: now)
            return kb.currentKeySet
        } else if !DeviceTrust.hasIdentity(kb) && StoreDevices.removal(storePath: kb.storePath, id: removedID) != nil {
            throw KeybagError.invalid("device \(removedID) was already removed")
        }
        let newest = try newestKeySetMade(kb, recovery: recovery)
        guard newest <= kb.currentKeySet else {
            throw KeybagError.invalid(
                "another device made key set \(newest) and this device holds \(kb.currentKeySet): take it up with "
                    + "`keybagfs recover` first")
        }
        if let recovery {
            try DeviceIdentityKeys.ensure(&kb, passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
        }
        let set: Int
        let knownBefore = kb.file.trustedDevices ?? [:]
        if let trust = try DeviceTrust.rememberCertified(&kb, deviceKey: deviceKey) {
            set = try removeWithRecord(
                &kb,
                removedID, trust: trust, keep: keep, knownBefore: knownBefore, passcode: passcode, deviceKey: deviceKey,
                recovery: recovery, now: now)
        } else {  // a store without a recovery key, whose devices have no identities
            set = try KeySets.start(&kb, passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
            try StoreDevices.makeFolder(kb.storePath)
            try AtomicFile.write(
                try JSONEncoder().encode(DeviceRemoval(deviceID: removedID, removedAt: now, keySet: set)),
                to: kb.storePath + "/" + StoreDevices.removalPath(removedID))
        }
        if unlink(kb.storePath + "/" + keybag) != 0 && errno != ENOENT {
            throw KeybagError.system("cannot delete \(keybag)", errno)
        }
        DeviceKeyFile.syncFolder(of: kb.storePath + "/" + keybag)
        return set
    }
}
