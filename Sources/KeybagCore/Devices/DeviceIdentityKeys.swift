import Foundation

/// A device's own key pairs: X25519 to receive key sets sealed to it, Ed25519 to sign what it
/// writes for the other devices (removals, key sets, approvals). The private halves are kept
/// in its keybag under a key from class A of key set 0 and its device key, so they open only
/// with the passcode (through the TPM where one is enrolled) on this device, or after a
/// recovery; the public halves are in its keybag (settings MAC) and its certificate.
public struct DeviceIdentityKeys: Sendable {
    /// X25519 secret (receives sealed key sets).
    public let boxSecret: SecureKey
    /// Ed25519 seed (signs).
    public let signSeed: SecureKey

    /// Keybag slots of the private halves.
    static let boxSlot = "idBox", signSlot = "idSign"

    /// A fresh pair of key pairs.
    public static func generate() -> DeviceIdentityKeys {
        DeviceIdentityKeys(boxSecret: SecureKey(random: 32), signSeed: SecureKey(random: 32))
    }

    /// The X25519 public key.
    public func boxPublic() throws -> [UInt8] { try SealedBox.publicKey(of: boxSecret) }
    /// The Ed25519 public key.
    public func signPublic() throws -> [UInt8] { try Ed25519.publicKey(seed: signSeed) }

    /// Zeroes both secrets.
    public func wipe() {
        boxSecret.wipe()
        signSeed.wipe()
    }

    /// The key that wraps the private halves: BLAKE2b keyed by class A of key set 0 over the
    /// device wrap key, the store and the device (other devices hold class A, not the device key).
    static func wrapKey(classA0: SecureKey, deviceKey: SecureKey, storeID: String, deviceID: String) throws
        -> SecureKey
    {
        let dwk = try KeybagMACs.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        return try classA0.withBytes { a in
            try dwk.withBytes { d in
                KeyWrap.keyedHash(
                    key: a,
                    parts: [
                        Array("keybagfs-identity-kek-v1".utf8), Array(storeID.utf8), Array(deviceID.utf8), Array(d),
                    ])
            }
        }
    }

    /// Associated data of a private half's wrap.
    static func ad(_ storeID: String, _ deviceID: String, _ slot: String) -> [UInt8] {
        Array("keybagfs-identity-v1|\(storeID)|\(deviceID)|\(slot)".utf8)
    }

    /// Writes both private halves (wrapped) and both public halves into `f`, for device
    /// `f.deviceID`.
    func store(into f: inout KeybagFile, classA0: SecureKey, deviceKey: SecureKey) throws {
        guard let id = f.deviceID else { throw KeybagError.invalid("a keybag without a device id has no identity") }
        let k = try Self.wrapKey(classA0: classA0, deviceKey: deviceKey, storeID: f.storeID, deviceID: id)
        defer { k.wipe() }
        for (slot, secret) in [(Self.boxSlot, boxSecret), (Self.signSlot, signSeed)] {
            f.wrapped[slot] = Data(try KeyWrap.wrap(secret, with: k, ad: Self.ad(f.storeID, id, slot)))
                .base64EncodedString()
        }
        f.identityBox = Data(try boxPublic()).base64EncodedString()
        f.identitySign = Data(try signPublic()).base64EncodedString()
    }

    /// The private halves kept in `kb`; `corrupt` when they do not open or do not match the
    /// public halves the keybag names.
    static func open(from kb: Keybag, classA0: SecureKey, deviceKey: SecureKey) throws -> DeviceIdentityKeys {
        guard let id = kb.file.deviceID, kb.file.identitySign != nil else {
            throw KeybagError.invalid("this device has no identity keys yet (`keybagfs recover` makes them)")
        }
        let k = try wrapKey(classA0: classA0, deviceKey: deviceKey, storeID: kb.file.storeID, deviceID: id)
        defer { k.wipe() }
        let box = try KeyWrap.unwrap(try kb.file.blob(boxSlot), with: k, ad: ad(kb.file.storeID, id, boxSlot))
        let sign: SecureKey
        do {
            sign = try KeyWrap.unwrap(try kb.file.blob(signSlot), with: k, ad: ad(kb.file.storeID, id, signSlot))
        } catch {
            box.wipe()
            throw error
        }
        let keys = DeviceIdentityKeys(boxSecret: box, signSeed: sign)
        guard Data(try keys.boxPublic()).base64EncodedString() == kb.file.identityBox,
            Data(try keys.signPublic()).base64EncodedString() == kb.file.identitySign
        else {
            keys.wipe()
            throw KeybagError.corrupt("this device's identity keys do not match its keybag")
        }
        return keys
    }
}
