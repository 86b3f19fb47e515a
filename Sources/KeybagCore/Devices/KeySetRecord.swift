import CSodium
import Foundation

/// How key set N came to be, for the devices that did not make it: `devices/keyset-N.MAKER.json`,
/// written once by the device that made the set (a removal, or a recovery-key rotation) and
/// signed with its identity key (two records of one set are a fork, which every device
/// refuses). It names the devices the set was made for (the roster) and
/// seals the set's class keys to each of them, so a device that stays takes the set up at
/// its next unlock, without the recovery key. `DeviceTrust` decides which records hold.
public struct KeySetRecord: Codable, Sendable, Equatable {
    /// The store.
    public var storeID: String
    /// The set this record makes (one more than the set before it).
    public var keySet: Int
    /// The device that made it.
    public var madeBy: String
    /// When (Unix time).
    public var madeAt: Double
    /// Devices removed by this set (empty for a rotation).
    public var removed: [String]
    /// Devices the set was made for, the maker included, with their public keys as the maker
    /// trusted them (a device certified later starts from this list, `DeviceTrust`).
    public var members: [String: DevicePublicKeys]
    /// The set's class B public key, base64.
    public var classBPublic: String
    /// Device id → the set's class keys A ‖ B ‖ C ‖ D sealed to that device's X25519 key, base64.
    public var grants: [String: String]
    /// The set's escrow slots as the maker wrote them under the recovery key (slot → base64),
    /// so a device that takes the set up can still be recovered and can remove devices.
    public var escrow: [String: String]
    /// The store certification key from this set on (Ed25519 public, base64), when the set
    /// replaced it (a recovery-key rotation); nil when it stays.
    public var certify: String? = nil
    /// The new certification key's signature of `message`, base64 (with `certify`).
    public var certifySignature: String? = nil
    /// The signature of `message` by the certification key of the set before (base64): only a
    /// holder of the recovery key, whose escrow holds that key, makes a set the others take up.
    public var rootSignature: String? = nil
    /// Ed25519 signature of `message` by the maker, base64.
    public var signature: String
    /// Keyed BLAKE2b-256 of `message` under class A of the set (base64): only a holder of the
    /// set's keys made it, which a device given the keys by the recovery key checks before it
    /// takes `members` as the devices to trust (`DeviceTrust.bootstrap`).
    public var keysMAC: String = ""
    /// Who approved each member the maker learnt of by a certificate (device id → approver
    /// id, or "store"), so a device that takes the set up still removes what a device approved.
    public var approvals: [String: String]? = nil

    /// The devices the set was made for.
    public var roster: [String] { members.keys.sorted() }

    /// The file name of set `n`'s record by `maker` in the devices folder.
    public static func fileName(_ n: Int, maker: String) -> String { "keyset-\(n).\(maker).json" }

    /// The set number and maker a file name gives, or nil when it names no record.
    public static func parse(fileName name: String) -> (keySet: Int, maker: String)? {
        guard name.hasPrefix("keyset-"), name.hasSuffix(".json") else { return nil }
        let parts = name.dropFirst(7).dropLast(5).split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 2, let n = Int(parts[0]), (1...Keybag.maxKeySet).contains(n),
            DeviceIdentity.isWellFormed(String(parts[1]))
        else { return nil }
        return (n, String(parts[1]))
    }

    /// This record's file name.
    public var fileName: String { Self.fileName(keySet, maker: madeBy) }

    /// The signed bytes.
    public var message: [UInt8] {
        var m = SignedMessage("keybagfs-key-set-v1")
        m.add("storeID", storeID)
        m.add("keySet", String(keySet))
        m.add("madeBy", madeBy)
        m.add("madeAt", String(madeAt))
        for id in removed { m.add("removed", id) }
        for (k, v) in members.sorted(by: { $0.key < $1.key }) { m.add("member." + k, v.joined) }
        m.add("classBPublic", classBPublic)
        m.add("certify", certify ?? "")
        for (k, v) in (approvals ?? [:]).sorted(by: { $0.key < $1.key }) { m.add("approval." + k, v) }
        for (k, v) in grants.sorted(by: { $0.key < $1.key }) { m.add("grant." + k, v) }
        for (k, v) in escrow.sorted(by: { $0.key < $1.key }) { m.add("escrow." + k, v) }
        return m.bytes
    }

    /// Signs it with the maker's signing seed.
    public mutating func sign(with seed: SecureKey) throws {
        signature = Data(try Ed25519.sign(message, seed: seed)).base64EncodedString()
    }

    /// Whether the signature is `signer`'s.
    public func isSigned(by signer: [UInt8]) -> Bool {
        guard let sig = Data(base64Encoded: signature) else { return false }
        return Ed25519.verify([UInt8](sig), of: message, publicKey: signer)
    }

    /// The new certification key (nil: none, or malformed).
    public var certifyKey: [UInt8]? {
        certify.flatMap { Data(base64Encoded: $0) }.map([UInt8].init).flatMap { $0.count == 32 ? $0 : nil }
    }

    /// Whether `rootSignature` is `root`'s (the certification key of the set before).
    public func isSigned(byRoot root: [UInt8]) -> Bool {
        guard let sig = rootSignature.flatMap({ Data(base64Encoded: $0) }) else { return false }
        return Ed25519.verify([UInt8](sig), of: message, publicKey: root)
    }

    /// Whether the record is vouched for by the certification key `root` that a device holds
    /// for this record's set (from the recovery key's escrow, or its own memory): signed by it
    /// as the key of the set before, or (a rotation) naming it as the new key and signed by it;
    /// and signed by its maker as the record lists the maker, and made with the set's keys
    /// (`classA`). What a device that starts at this set takes its list from.
    func isVouched(byRoot root: [UInt8], classA: SecureKey) -> Bool {
        let rootOK = isSigned(byRoot: root) || (certifyKey == root && isSignedByItsCertifyKey)
        guard rootOK, let maker = members[madeBy], isSigned(by: maker.signKey) else { return false }
        return hasKeysMAC(classA: classA)
    }

    /// Whether `certify` is there and signed the record itself.
    public var isSignedByItsCertifyKey: Bool {
        guard let key = certifyKey, let sig = certifySignature.flatMap({ Data(base64Encoded: $0) }) else {
            return false
        }
        return Ed25519.verify([UInt8](sig), of: message, publicKey: key)
    }

    /// Writes it as `devices/keyset-N.MAKER.json` in the store (atomically).
    public func write(storePath: String) throws {
        try StoreDevices.makeFolder(storePath)
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        try AtomicFile.write(try enc.encode(self), to: storePath + "/" + StoreDevices.dirName + "/" + fileName)
    }

    /// The keys MAC under `classA` of the set.
    func keysMAC(classA: SecureKey) throws -> String {
        try classA.withBytes {
            let k = KeyWrap.keyedHash(key: $0, parts: [Array("keybagfs-key-set-members-v1".utf8), message])
            defer { k.wipe() }
            return Data(try k.withBytes { [UInt8]($0) }).base64EncodedString()
        }
    }

    /// Whether `keysMAC` is the one class A of the set gives (compared in constant time).
    func hasKeysMAC(classA: SecureKey) -> Bool {
        guard let want = try? keysMAC(classA: classA), let a = Data(base64Encoded: want),
            let b = Data(base64Encoded: keysMAC), a.count == b.count
        else { return false }
        return sodium_memcmp([UInt8](a), [UInt8](b), a.count) == 0
    }

    /// Whether the record is well formed: ids are device ids, keys are keys.
    var isWellFormed: Bool {
        DeviceIdentity.isWellFormed(madeBy)
            && members.allSatisfy { DeviceIdentity.isWellFormed($0.key) && $0.value.isWellFormed }
            && removed.allSatisfy { DeviceIdentity.isWellFormed($0) || $0 == "first" }
            && Data(base64Encoded: classBPublic)?.count == 32
            && DeviceTrust.wellFormed(approvals ?? [:]).count == (approvals ?? [:]).count
    }

    /// The grant payload: the set number, then A, B, C and D (32 bytes each).
    static func grantPayload(_ set: UnlockedClassKeys, classD: SecureKey, n: Int) throws -> SecureKey {
        try SecureKey(count: 1 + 128) { out in
            out[0] = UInt8(n)
            for (i, k) in [set.classA, set.classBSecret, set.classC, classD].enumerated() {
                try k.withBytes { (out.baseAddress! + 1 + 32 * i).copyMemory(from: $0.baseAddress!, byteCount: 32) }
            }
        }
    }

    /// Opens this device's grant with its X25519 secret: the set's class keys and class D;
    /// `corrupt` when it does not open, names another set or its class B key is not the
    /// one the record names.
    func openGrant(for deviceID: String, boxSecret: SecureKey) throws -> (UnlockedClassKeys, SecureKey) {
        guard let g = grants[deviceID].flatMap({ Data(base64Encoded: $0) }) else {
            throw KeybagError.invalid("key set \(keySet) was not made for this device (\(deviceID))")
        }
        let payload = try SealedBox.open([UInt8](g), secret: boxSecret)
        defer { payload.wipe() }
        let keys: [SecureKey] = try payload.withBytes { p in
            guard p.count == 129, p[0] == UInt8(keySet) else {
                throw KeybagError.corrupt("the grant of key set \(keySet) names another set")
            }
            return (0..<4).map { i in
                SecureKey(count: 32) { $0.baseAddress!.copyMemory(from: p.baseAddress! + 1 + 32 * i, byteCount: 32) }
            }
        }
        let pk = try ClassBAgreement.publicKey(of: keys[1])
        guard Data(pk).base64EncodedString() == classBPublic else {
            keys.forEach { $0.wipe() }
            throw KeybagError.corrupt("the grant of key set \(keySet) does not match its class B public key")
        }
        let set = UnlockedClassKeys(
            classA: keys[0], classBSecret: keys[1], classBPublic: pk, classC: keys[2], keySet: UInt8(keySet))
        return (set, keys[3])
    }
}

/// A removal record, `devices/ID.removed` (JSON): written once by the device that removed it,
/// signed by it where it has an identity (records written before identities have no
/// signature, and only devices without an identity still go by them).
struct DeviceRemoval: Codable {
    var deviceID: String
    var removedAt: Double
    var keySet: Int
    /// The device that removed it (absent before identities).
    var by: String? = nil
    /// Ed25519 signature of `message` by `by`, base64.
    var signature: String? = nil

    /// The signed bytes.
    var message: [UInt8] {
        var m = SignedMessage("keybagfs-device-removal-v1")
        m.add("deviceID", deviceID)
        m.add("removedAt", String(removedAt))
        m.add("keySet", String(keySet))
        m.add("by", by ?? "")
        return m.bytes
    }

    /// Whether the signature is `signer`'s.
    func isSigned(by signer: [UInt8]) -> Bool {
        guard let sig = signature.flatMap({ Data(base64Encoded: $0) }) else { return false }
        return Ed25519.verify([UInt8](sig), of: message, publicKey: signer)
    }
}
