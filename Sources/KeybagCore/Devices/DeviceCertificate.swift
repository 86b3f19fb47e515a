import Foundation

/// A device's public keys, certified: `devices/ID.identity` (JSON), written once by the device
/// itself when it joins. Signed by the store's certification key (`by` = "store": the device
/// was made or added with the recovery key) or by an existing device that approved it (`by` =
/// that device's id). `DeviceTrust` decides which certificates hold.
public struct DeviceCertificate: Codable, Sendable, Equatable {
    /// The store.
    public var storeID: String
    /// The device (its id names the file).
    public var deviceID: String
    /// X25519 public key, base64: key sets are sealed to it.
    public var box: String
    /// Ed25519 public key, base64: the device's records are signed with it.
    public var sign: String
    /// A name for people.
    public var name: String?
    /// The key set that was current when it was certified.
    public var keySet: Int
    /// "store", or the id of the device that approved it.
    public var by: String
    /// When (Unix time).
    public var issuedAt: Double
    /// Ed25519 signature of `message`, base64.
    public var signature: String
    /// The device's own signature of `message` (base64), with its own key: required where a
    /// device approved it, so that no other device can claim to have approved it.
    public var selfSignature: String? = nil

    /// What `by` says of a certificate signed with the store's certification key.
    public static let byStore = "store"

    /// The file name of device `id`'s certificate in the devices folder.
    public static func fileName(_ id: String) -> String { "\(id).identity" }

    /// The signed bytes.
    public var message: [UInt8] {
        var m = SignedMessage("keybagfs-device-certificate-v1")
        m.add("storeID", storeID)
        m.add("deviceID", deviceID)
        m.add("box", box)
        m.add("sign", sign)
        m.add("name", name ?? "")
        m.add("keySet", String(keySet))
        m.add("by", by)
        m.add("issuedAt", String(issuedAt))
        return m.bytes
    }

    /// The device's X25519 public key (empty when malformed).
    public var boxKey: [UInt8] { Data(base64Encoded: box).map([UInt8].init) ?? [] }
    /// The device's Ed25519 public key (empty when malformed).
    public var signKey: [UInt8] { Data(base64Encoded: sign).map([UInt8].init) ?? [] }

    /// A certificate for `keys`' public halves, signed with `signer` (the store's
    /// certification seed, or the approving device's signing seed).
    public static func issue(
        storeID: String, deviceID: String, keys: DeviceIdentityKeys, name: String?, keySet: Int, by: String,
        signer: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> DeviceCertificate {
        var c = DeviceCertificate(
            storeID: storeID, deviceID: deviceID, box: Data(try keys.boxPublic()).base64EncodedString(),
            sign: Data(try keys.signPublic()).base64EncodedString(), name: name, keySet: keySet, by: by,
            issuedAt: now.rounded(), signature: "")
        c.signature = Data(try Ed25519.sign(c.message, seed: signer)).base64EncodedString()
        return c
    }

    /// Whether the device signed it itself, with the key it certifies.
    public var isSelfSigned: Bool {
        guard let sig = selfSignature.flatMap({ Data(base64Encoded: $0) }) else { return false }
        return Ed25519.verify([UInt8](sig), of: message, publicKey: signKey)
    }

    /// Whether the signature is `signer`'s.
    public func isSigned(by signer: [UInt8]) -> Bool {
        guard let sig = Data(base64Encoded: signature) else { return false }
        return Ed25519.verify([UInt8](sig), of: message, publicKey: signer)
    }

    /// The certificates in the store's devices folder that decode (unverified: for naming).
    public static func all(storePath: String) -> [DeviceCertificate] {
        StoreDevices.entries(storePath).filter { $0.hasSuffix(".identity") }.compactMap { name in
            (try? StoreFileOpen.contents(storePath + "/" + StoreDevices.dirName + "/" + name))?.flatMap {
                try? JSONDecoder().decode(DeviceCertificate.self, from: $0)
            }
        }
    }

    /// Writes it as `devices/ID.identity` in the store (atomically).
    public func write(storePath: String) throws {
        try StoreDevices.makeFolder(storePath)
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        try AtomicFile.write(
            try enc.encode(self), to: storePath + "/" + StoreDevices.dirName + "/" + Self.fileName(deviceID))
    }
}
