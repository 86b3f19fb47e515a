import CSodium
import Foundation

/// A device's identity in its keybag: its key pairs, the store certification key it trusts,
/// and that key's escrow under the recovery key (docs/FORMAT.md, "Device identities").
extension Keybag {
    /// Escrow slot (`r` + name) of the store certification key's seed.
    static let certifySlot = "certify"

    /// Checks the identity fields: both public halves and both wrapped private halves, or
    /// none; a certification key and its escrow of the right sizes.
    static func validateIdentity(_ f: KeybagFile) throws {
        func bad(_ field: String, _ why: String) -> KeybagError { .corrupt("keybag field \(field): \(why)") }
        func bytes(_ s: String?) -> Int? { s.flatMap { Data(base64Encoded: $0) }?.count }
        let parts = [
            f.identityBox, f.identitySign, f.wrapped[DeviceIdentityKeys.boxSlot],
            f.wrapped[DeviceIdentityKeys.signSlot],
        ]
        guard parts.allSatisfy({ $0 == nil }) || parts.allSatisfy({ $0 != nil }) else {
            throw bad("identity", "some of the device's identity keys are missing")
        }
        if f.identitySign != nil {
            guard f.deviceID != nil else { throw bad("identity", "identity keys without a device id") }
            guard bytes(f.identityBox) == 32 else { throw bad("identityBox", "not a public key") }
            guard bytes(f.identitySign) == 32 else { throw bad("identitySign", "not a public key") }
            for slot in [DeviceIdentityKeys.boxSlot, DeviceIdentityKeys.signSlot]
            where bytes(f.wrapped[slot]) != 32 + KeyWrap.overhead {
                throw bad("wrapped.\(slot)", "not a wrapped key")
            }
        }
        if f.storeCertify != nil, bytes(f.storeCertify) != 32 { throw bad("storeCertify", "not a public key") }
        if let w = f.wrapped["r" + certifySlot], bytes(w) != 32 + KeyWrap.overhead {
            throw bad("wrapped.r\(certifySlot)", "not a wrapped key")
        }
    }

    /// The store certification key this device trusts (nil: a device from before identities).
    public var certificationRoot: [UInt8]? {
        file.storeCertify.flatMap { Data(base64Encoded: $0) }.map([UInt8].init)
    }

    /// Whether this device has identity keys and a certification root.
    public var hasIdentity: Bool { file.identitySign != nil && certificationRoot != nil }

    /// The store's devices, certificates and records as this device judges them (nil: a
    /// device without identity, which goes by every removal record as before).
    public func deviceTrust() -> DeviceTrust? {
        guard hasIdentity, let root = certificationRoot else { return nil }
        return DeviceTrust.evaluate(storePath: storePath, storeID: file.storeID, root: root, holding: currentKeySet)
    }

    /// The newest key set this device must know of: the newest set a record it trusts made,
    /// or (a device without identity) the newest set any removal record claims.
    public func newestKeySetInStore() -> Int {
        if let trust = deviceTrust() { return trust.newestSet }
        return StoreDevices.newestKeySet(storePath: storePath)
    }

    /// The store certification key's seed escrowed in this keybag (nil: none escrowed here).
    func escrowedCertifySeed(recovery: RecoveryKey) throws -> SecureKey? {
        guard file.wrapped["r" + Keybag.certifySlot] != nil else { return nil }
        let rwk = try recovery.wrapKey(storeID: file.storeID)
        defer { rwk.wipe() }
        return try openEscrow(Keybag.certifySlot, rwk: rwk)
    }

    /// The store certification key's seed: the one escrowed in any keybag of the store that
    /// the recovery key opens (only its holders can have written one), else a new one (a
    /// store made before identities gets its key with its first identity).
    static func certifySeed(storePath: String, recovery: RecoveryKey, preferring first: Keybag?) -> SecureKey {
        let others = StoreDevices.list(storePath: storePath).compactMap { d in
            d.keybag.flatMap { try? Keybag.load(storePath: storePath, relativePath: $0) }
        }
        for kb in [first].compactMap({ $0 }) + others {
            if let seed = try? kb.escrowedCertifySeed(recovery: recovery) { return seed }
        }
        return SecureKey(random: 32)
    }

    /// Gives `f` (a keybag being written with the recovery key at hand) fresh identity keys,
    /// the certification key's public half and its escrow; returns the certificate, signed
    /// with the certification key, that the caller writes once the keybag is saved.
    static func makeIdentity(
        _ f: inout KeybagFile, classA0: SecureKey, deviceKey: SecureKey, certifySeed: SecureKey,
        recovery: RecoveryKey, now: Double = Date().timeIntervalSince1970
    ) throws -> DeviceCertificate {
        guard let id = f.deviceID else { throw KeybagError.invalid("a keybag without a device id has no identity") }
        let keys = DeviceIdentityKeys.generate()
        defer { keys.wipe() }
        try keys.store(into: &f, classA0: classA0, deviceKey: deviceKey)
        f.storeCertify = Data(try Ed25519.publicKey(seed: certifySeed)).base64EncodedString()
        try writeEscrow(&f, keys: [(certifySlot, certifySeed)], recovery: recovery)
        return try DeviceCertificate.issue(
            storeID: f.storeID, deviceID: id, keys: keys, name: f.deviceName, keySet: f.keySet ?? 0,
            by: DeviceCertificate.byStore, signer: certifySeed, now: now)
    }

    /// This device's identity keys, opened with class A of key set 0.
    func identityKeys(classA0: SecureKey, deviceKey: SecureKey) throws -> DeviceIdentityKeys {
        try DeviceIdentityKeys.open(from: self, classA0: classA0, deviceKey: deviceKey)
    }
}
