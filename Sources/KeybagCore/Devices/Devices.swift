import CSodium
import Foundation

/// A device's name for itself inside a store: BLAKE2b-128 keyed by its device key over the
/// store id, in hex. It says nothing about the key, and differs from store to store.
public enum DeviceIdentity {
    /// The id of the device holding `deviceKey` in store `storeID`.
    public static func id(deviceKey: SecureKey, storeID: String) throws -> String {
        var out = [UInt8](repeating: 0, count: 16)
        let msg = Array("keybagfs-device-id-v1|\(storeID)".utf8)
        try deviceKey.withBytes { k in
            _ = crypto_generichash(
                &out, 16, msg, UInt64(msg.count), k.baseAddress!.assumingMemoryBound(to: UInt8.self), k.count)
        }
        return out.map { String(format: "%02x", $0) }.joined()
    }

    /// Whether `s` has the shape of a device id (32 lowercase hex digits).
    public static func isWellFormed(_ s: String) -> Bool {
        s.utf8.count == 32 && s.utf8.allSatisfy { (0x30...0x39).contains($0) || (0x61...0x66).contains($0) }
    }
}

/// One device of a store, as `keybagfs device list` shows it.
public struct StoreDevice: Sendable, Equatable {
    /// Its id (nil: the device that made the store, before it mounted with devices support).
    public var id: String?
    /// Its name, as it gave it.
    public var name: String?
    /// Its keybag inside the store (nil once removed).
    public var keybag: String?
    /// When it was removed (Unix time), or nil.
    public var removedAt: Double?
    /// The key set its removal started (files of this set and later are closed to it).
    public var removedBeforeKeySet: Int?
}

/// The devices of a store: one keybag per device (`keybag` for the device that made the
/// store, `devices/ID.keybag` for each added one), each written only by its own device, and
/// a record per removed device. Nothing here is shared state that two devices rewrite.
public enum StoreDevices {
    /// Folder inside the store for added devices' keybags and removal records.
    public static let dirName = "devices"

    /// A device keybag's path inside the store.
    public static func keybagPath(_ id: String) -> String { "\(dirName)/\(id).keybag" }

    /// A removal record's path inside the store.
    static func removalPath(_ id: String) -> String { "\(dirName)/\(id).removed" }

    /// The removal record of `id`, or nil when it was never removed.
    static func removal(storePath: String, id: String) -> DeviceRemoval? {
        guard let data = try? StoreFileOpen.contents(storePath + "/" + removalPath(id)) else { return nil }
        return try? JSONDecoder().decode(DeviceRemoval.self, from: data)
    }

    /// File names in the devices folder (none when it does not exist or is not a real folder).
    static func entries(_ storePath: String) -> [String] {
        var st = stat()
        guard lstat(storePath + "/" + dirName, &st) == 0, st.st_mode & S_IFMT == S_IFDIR else { return [] }
        return ((try? FileManager.default.contentsOfDirectory(atPath: storePath + "/" + dirName)) ?? []).sorted()
    }

    /// Makes the devices folder; refuses one that is a symlink or no folder (the tools run as root).
    static func makeFolder(_ storePath: String) throws {
        let path = storePath + "/" + dirName
        if mkdir(path, 0o700) != 0 && errno != EEXIST { throw KeybagError.system("cannot make \(path)", errno) }
        var st = stat()
        guard lstat(path, &st) == 0, st.st_mode & S_IFMT == S_IFDIR else {
            throw KeybagError.invalid("\(path) is not a folder (a symlink?)")
        }
    }

    /// The newest key set a removal started (0 when no device was removed). A device whose
    /// keybag is older writes files that removed devices can still open, until it takes up
    /// the newer set (`keybagfs recover`).
    public static func newestKeySet(storePath: String) -> Int {
        entries(storePath).filter { $0.hasSuffix(".removed") }
            .compactMap { removal(storePath: storePath, id: String($0.dropLast(8)))?.keySet }.max() ?? 0
    }

    /// Every device of the store, present and removed.
    public static func list(storePath: String) -> [StoreDevice] {
        var out: [StoreDevice] = []
        if let kb = try? Keybag.load(storePath: storePath, relativePath: Keybag.fileName) {
            out.append(StoreDevice(id: kb.file.deviceID, name: kb.file.deviceName, keybag: Keybag.fileName))
        }
        for e in entries(storePath) {
            let rel = dirName + "/" + e
            if e.hasSuffix(".keybag"), let kb = try? Keybag.load(storePath: storePath, relativePath: rel) {
                out.append(StoreDevice(id: kb.file.deviceID, name: kb.file.deviceName, keybag: dirName + "/" + e))
            } else if e.hasSuffix(".removed"), let r = removal(storePath: storePath, id: String(e.dropLast(8))) {
                out.append(StoreDevice(id: r.deviceID, removedAt: r.removedAt, removedBeforeKeySet: r.keySet))
            }
        }
        return out
    }
}

extension Keybag {
    /// Reads one keybag file of a store (`keybag` or `devices/ID.keybag`).
    public static func load(
        storePath: String, relativePath: String, now: Double = Date().timeIntervalSince1970
    ) throws -> Keybag {
        let p = storePath + "/" + relativePath
        guard let data = try StoreFileOpen.contents(p) else {
            throw KeybagError.invalid("no keybag at \(p): not a keybagfs store (run `keybagfs init` first)")
        }
        do {
            let file = try JSONDecoder().decode(KeybagFile.self, from: data)
            try file.validate()
            return Keybag(storePath: storePath, file: file, relativePath: relativePath)
        } catch let e as KeybagError {
            throw e
        } catch {
            throw KeybagError.corrupt("keybag \(p) is not valid JSON")
        }
    }

    /// Some keybag of the store (the first device's, else an added device's): its store id
    /// and settings, before the device key is known.
    public static func load(storePath: String, now: Double = Date().timeIntervalSince1970) throws -> Keybag {
        if FileManager.default.fileExists(atPath: storePath + "/" + fileName) {
            return try load(storePath: storePath, relativePath: fileName, now: now)
        }
        if let e = StoreDevices.entries(storePath).first(where: { $0.hasSuffix(".keybag") }) {
            return try load(storePath: storePath, relativePath: StoreDevices.dirName + "/" + e, now: now)
        }
        return try load(storePath: storePath, relativePath: fileName, now: now)  // the "no keybag" error
    }

    /// The keybag of the device holding `deviceKey`: its own `devices/ID.keybag`, else the
    /// store's first keybag. A removed device is told so (its keys stay what they were).
    public static func load(
        storePath: String, deviceKey: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> Keybag {
        let any = try load(storePath: storePath, now: now)
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: any.file.storeID)
        // A device with an identity goes only by a removal record it can verify (a forged one
        // is named by `DeviceTrust`); one without, by any record, as before identities.
        func refuseIfRemoved(_ kb: Keybag?) throws {
            guard let r = StoreDevices.removal(storePath: storePath, id: id) else { return }
            if let kb, let trust = kb.deviceTrust(), !trust.removed.contains(id) { return }
            let when = Date(timeIntervalSince1970: r.removedAt)
            throw KeybagError.invalid(
                "this device (\(id)) was removed from the store on \(when); it can open only files written before "
                    + "that. Add it again with `keybagfs device add` and a new device key")
        }
        let own = StoreDevices.keybagPath(id)
        if FileManager.default.fileExists(atPath: storePath + "/" + own) {
            let kb = try load(storePath: storePath, relativePath: own, now: now)
            guard kb.file.storeID == any.file.storeID, kb.file.deviceID == id else {
                throw KeybagError.corrupt("keybag \(own) belongs to another store or device")
            }
            try refuseIfRemoved(kb)
            return kb
        }
        guard var first = try? load(storePath: storePath, relativePath: fileName, now: now),
            (first.file.deviceID ?? id) == id
        else {
            try refuseIfRemoved(nil)
            _ = try load(storePath: storePath, relativePath: fileName, now: now)  // its error, if it has one
            throw KeybagError.badDeviceKey
        }
        try refuseIfRemoved(first)
        if first.file.deviceID == nil {
            first.file.deviceID = id  // saved by `authenticate` at the next mount
            first.pendingDeviceID = true
        }
        return first
    }

    /// The keybag whose recovery slots open with `recovery` and hold the most key sets, with
    /// its keys. Escrow slots are sealed under the recovery key itself, so only its holders
    /// can have written them; a keybag that claims more sets without such slots is passed over.
    public static func escrowSource(storePath: String, recovery: RecoveryKey) throws -> (Keybag, StoreKeys) {
        let keybags = StoreDevices.list(storePath: storePath).compactMap { d in
            d.keybag.flatMap { try? load(storePath: storePath, relativePath: $0) }
        }
        var failure: Error = KeybagError.invalid("this store has no keybag with recovery slots")
        let storeID = try load(storePath: storePath).file.storeID
        for kb in keybags.sorted(by: { $0.currentKeySet > $1.currentKeySet })
        where kb.hasRecoveryKey && kb.file.storeID == storeID {
            do { return (kb, try RecoveryEscrow.keys(in: kb.file, recovery: recovery)) } catch { failure = error }
        }
        throw failure
    }

    /// This keybag's device id (nil: the first device's keybag, before it learnt its id).
    public var deviceID: String? { file.deviceID }

    /// The device of the store that `deviceKey` already is (its id), or nil: the key opens the
    /// first device's keybag, or a device keybag carries the key's id.
    public static func deviceOwning(key deviceKey: SecureKey, storePath: String) throws -> String? {
        let storeID = try load(storePath: storePath).file.storeID
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID)
        if let first = try? load(storePath: storePath, relativePath: fileName),
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
    public static func addDevice(
        storePath: String, recovery: RecoveryKey, passcode: SecureKey, deviceKey: SecureKey, name: String?,
        strength: KDFStrength, sealer: (any PasscodeSealer)? = nil, withKeys: (StoreKeys) throws -> Void = { _ in }
    ) throws -> Keybag {
        let any = try load(storePath: storePath)
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
        try wrapAll(keys, into: &file, passcode: passcode, deviceKey: deviceKey, sealer: sealer)
        try RecoveryEscrow.write(&file, keys: keys.escrowEntries(), recovery: recovery)
        let certify = try certifySeed(storePath: storePath, recovery: recovery, preferring: source)
        defer { certify.wipe() }
        let certificate = try makeIdentity(
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
    private func keybagOfDevice(_ id: String, own: String) throws -> String {
        if id == "first" {
            guard relativePath != Keybag.fileName else {
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
        if FileManager.default.fileExists(atPath: storePath + "/" + StoreDevices.keybagPath(id)) {
            return StoreDevices.keybagPath(id)
        }
        if (try? Keybag.load(storePath: storePath, relativePath: Keybag.fileName))?.file.deviceID == id {
            return Keybag.fileName
        }
        // A device this one trusts is removed by its id, whatever became of its keybag (a thief
        // may delete or spoil it in the store): its keybag's path, which may hold nothing.
        if deviceTrust()?.trusted[id] != nil { return StoreDevices.keybagPath(id) }
        throw KeybagError.invalid("no device \(id) in this store (`keybagfs device list` shows them)")
    }

    /// The newest key set any device made. With the recovery key only keybags whose escrow
    /// opens count (a forged claim of a newer set cannot block a removal); without one every
    /// keybag and record counts.
    private func newestKeySet(recovery: RecoveryKey?) throws -> Int {
        if let recovery {
            let (source, keys) = try Keybag.escrowSource(storePath: storePath, recovery: recovery)
            keys.wipe()
            return source.currentKeySet
        }
        let keybagSets = StoreDevices.list(storePath: storePath).compactMap { d in
            d.keybag.flatMap { try? Keybag.load(storePath: storePath, relativePath: $0) }?.currentKeySet
        }
        return max(StoreDevices.newestKeySet(storePath: storePath), keybagSets.max() ?? 0)
    }

    /// The last steps of removing `removedID`, which a record already removed: its signed
    /// removal record where none is, and its keybag deleted (a wrong passcode is counted).
    private mutating func finishRemoval(
        _ removedID: String, keybag: String, trust: DeviceTrust, passcode: SecureKey, deviceKey: SecureKey, now: Double
    ) throws {
        if StoreDevices.removal(storePath: storePath, id: removedID) == nil {
            let keys = try openAllCounted(passcode: passcode, deviceKey: deviceKey, now: now)
            defer { keys.wipe() }
            let identity = try identityKeys(classA0: keys.sets[0].classA, deviceKey: deviceKey)
            defer { identity.wipe() }
            let set = trust.records.values.first { $0.removed.contains(removedID) }?.keySet ?? currentKeySet
            var removal = DeviceRemoval(deviceID: removedID, removedAt: now, keySet: set, by: file.deviceID)
            removal.signature = Data(try Ed25519.sign(removal.message, seed: identity.signSeed)).base64EncodedString()
            try StoreDevices.makeFolder(storePath)
            try Keybag.writeAtomically(
                try JSONEncoder().encode(removal), to: storePath + "/" + StoreDevices.removalPath(removedID))
        }
        if unlink(storePath + "/" + keybag) != 0 && errno != ENOENT {
            throw KeybagError.system("cannot delete \(keybag)", errno)
        }
        DeviceKeyFile.syncFolder(of: storePath + "/" + keybag)
    }

    /// A removal on a device with an identity: a new set handed, in a record this device signs,
    /// to the devices that stay; the removed device and what it approved (but `keep`) go.
    private mutating func removeWithRecord(
        _ removedID: String, trust: DeviceTrust, keep: Set<String>, knownBefore: [String: DevicePublicKeys],
        passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?, now: Double
    ) throws -> Int {
        // Kept devices must be ones this device knew before (a keybag in the store can lie about keys).
        for k in keep where knownBefore[k] == nil {
            throw KeybagError.invalid(
                "--keep \(k.prefix(40)): not a device this device knew before this removal; check it on its own "
                    + "machine, or let it go and add it again")
        }
        try refuseWhileBehind(trust)
        let keys = try keysWithFreshSet(passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
        defer { keys.wipe() }
        var next = file
        if let recovery { try RecoveryEscrow.write(&next, keys: keys.escrowEntries(), recovery: recovery) }
        let root = try recovery.map { try Keybag.certifySeed(storePath: storePath, recovery: $0, preferring: self) }
        defer { root?.wipe() }
        // The devices it approved go with it (and those they approved), but those kept.
        let removed = [removedID] + approvalChain(of: removedID, trust: trust, keep: keep)
        try publishKeySet(
            keys, removed: removed, trust: trust, next: next, root: root, certify: nil,
            removals: removed.map { DeviceRemoval(deviceID: $0, removedAt: now, keySet: keys.current) },
            passcode: passcode, deviceKey: deviceKey, now: now)
        for other in removed.dropFirst() { unlink(storePath + "/" + StoreDevices.keybagPath(other)) }
        return keys.current
    }

    /// Removes device `id` (a lost laptop; `first` names the store's first device): starts a
    /// new key set, so that nothing written from now on opens with the keys that device holds,
    /// records the removal and deletes its keybag from the store. Files written before stay
    /// readable to it. Needs this device's passcode (a wrong one is counted) and, when the
    /// store has one, the recovery key. Refused while this device lacks a newer key set
    /// another device made (two sets of one number would split the store). Returns the new set.
    public mutating func removeDevice(
        _ id: String, passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey?, keep: Set<String> = [],
        now: Double = Date().timeIntervalSince1970
    ) throws -> Int {
        let own = try DeviceIdentity.id(deviceKey: deviceKey, storeID: file.storeID)
        let keybag = try keybagOfDevice(id, own: own)
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
        guard removedID != own else { throw KeybagError.invalid("a device cannot remove itself") }
        if let trust = deviceTrust(), trust.removed.contains(removedID) {
            // A record already removed it: finish what a cut run of this command left (the
            // removal record, the keybag's deletion); nothing more.
            try finishRemoval(
                removedID, keybag: keybag, trust: trust, passcode: passcode, deviceKey: deviceKey, now: now)
            return currentKeySet
        } else if !hasIdentity && StoreDevices.removal(storePath: storePath, id: removedID) != nil {
            throw KeybagError.invalid("device \(removedID) was already removed")
        }
        let newest = try newestKeySet(recovery: recovery)
        guard newest <= currentKeySet else {
            throw KeybagError.invalid(
                "another device made key set \(newest) and this device holds \(currentKeySet): take it up with "
                    + "`keybagfs recover` first")
        }
        if let recovery { try ensureIdentity(passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now) }
        let set: Int
        let knownBefore = file.trustedDevices ?? [:]
        if let trust = try rememberCertified(deviceKey: deviceKey) {
            set = try removeWithRecord(
                removedID, trust: trust, keep: keep, knownBefore: knownBefore, passcode: passcode, deviceKey: deviceKey,
                recovery: recovery, now: now)
        } else {  // a store without a recovery key, whose devices have no identities
            set = try startKeySet(passcode: passcode, deviceKey: deviceKey, recovery: recovery, now: now)
            try StoreDevices.makeFolder(storePath)
            try Keybag.writeAtomically(
                try JSONEncoder().encode(DeviceRemoval(deviceID: removedID, removedAt: now, keySet: set)),
                to: storePath + "/" + StoreDevices.removalPath(removedID))
        }
        if unlink(storePath + "/" + keybag) != 0 && errno != ENOENT {
            throw KeybagError.system("cannot delete \(keybag)", errno)
        }
        DeviceKeyFile.syncFolder(of: storePath + "/" + keybag)
        return set
    }
}
