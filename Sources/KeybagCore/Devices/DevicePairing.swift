import CSodium
import Foundation

/// Adding a device by the approval of a device already in the store, without the recovery
/// key (`PairingMessages`). Each side takes one step per run and says what comes next, so
/// the files can travel through a sync engine at its own pace.
public enum DevicePairing {
    /// Where the newcomer stands after a step.
    public enum NewcomerStep: Sendable, Equatable {
        /// The request is written: an existing device runs `device approve`.
        case requested(id: String)
        /// No challenge from the approver yet.
        case waitingForChallenge(id: String)
        /// The nonce is revealed and the code is known: the approver types it.
        case showCode(id: String, code: String)
        /// Done: the keybag of the new device.
        case added(id: String, keySet: Int)
    }

    /// Where the approver stands after a step.
    public enum ApproverStep: Sendable, Equatable {
        /// The challenge is written: the newcomer runs its command again.
        case challenged
        /// No reveal from the newcomer yet.
        case waitingForReveal
        /// The reveal is there: the approver needs the code the newcomer shows.
        case needCode
        /// The grant is written.
        case approved(keySet: Int)
        /// The newcomer is a device of the store now: this device's pairing files are gone.
        case finished
    }

    /// The payload a grant seals: the number of sets, then A, B, C, D of each, then the volume key.
    static func payload(_ keys: StoreKeys) throws -> SecureKey {
        let n = keys.sets.count
        return try SecureKey(count: 1 + 128 * n + 32) { out in
            out[0] = UInt8(n)
            var at = 1
            for (i, s) in keys.sets.enumerated() {
                for k in [s.classA, s.classBSecret, s.classC, keys.classD[i]] {
                    try k.withBytes { (out.baseAddress! + at).copyMemory(from: $0.baseAddress!, byteCount: 32) }
                    at += 32
                }
            }
            try keys.volume.withBytes { (out.baseAddress! + at).copyMemory(from: $0.baseAddress!, byteCount: 32) }
        }
    }

    /// The keys of a payload; `corrupt` when malformed.
    static func keys(ofPayload p: SecureKey) throws -> StoreKeys {
        try p.withBytes { b in
            let n = Int(b[0])
            guard n >= 1, b.count == 1 + 128 * n + 32 else { throw KeybagError.corrupt("a grant of the wrong size") }
            func key(_ at: Int) -> SecureKey {
                SecureKey(count: 32) { $0.baseAddress!.copyMemory(from: b.baseAddress! + at, byteCount: 32) }
            }
            var sets: [UnlockedClassKeys] = [], classD: [SecureKey] = []
            for i in 0..<n {
                let base = 1 + 128 * i
                let bs = key(base + 32)
                sets.append(
                    UnlockedClassKeys(
                        classA: key(base), classBSecret: bs, classBPublic: try ClassBAgreement.publicKey(of: bs),
                        classC: key(base + 64), keySet: UInt8(i)))
                classD.append(key(base + 96))
            }
            return StoreKeys(sets: sets, classD: classD, volume: key(1 + 128 * n))
        }
    }

    /// What the newcomer keeps between its steps, outside the store (`STATE/STOREID.pairing-ID`):
    /// its identity secrets and nonce, each wrapped under its device wrap key.
    struct Pending: Codable {
        var box: String
        var sign: String
        var nonce: String

        static func path(storeID: String, deviceID: String) -> String {
            KeySetFloor.stateFolder + "/\(storeID).pairing-\(deviceID)"
        }

        static func ad(_ storeID: String, _ deviceID: String, _ slot: String) -> [UInt8] {
            Array("keybagfs-pairing-pending-v1|\(storeID)|\(deviceID)|\(slot)".utf8)
        }

        /// New secrets, saved (0600).
        static func make(storeID: String, deviceID: String, deviceKey: SecureKey) throws
            -> (DeviceIdentityKeys, SecureKey)
        {
            let keys = DeviceIdentityKeys.generate(), nonce = SecureKey(random: 32)
            let dwk = try Keybag.deviceWrapKey(deviceKey)
            defer { dwk.wipe() }
            func w(_ k: SecureKey, _ slot: String) throws -> String {
                Data(try KeyWrap.wrap(k, with: dwk, ad: ad(storeID, deviceID, slot))).base64EncodedString()
            }
            let p = Pending(
                box: try w(keys.boxSecret, "box"), sign: try w(keys.signSeed, "sign"), nonce: try w(nonce, "nonce"))
            try FileManager.default.createDirectory(atPath: KeySetFloor.stateFolder, withIntermediateDirectories: true)
            try Keybag.writeAtomically(try JSONEncoder().encode(p), to: path(storeID: storeID, deviceID: deviceID))
            return (keys, nonce)
        }

        /// The saved secrets (nil: none saved).
        static func load(storeID: String, deviceID: String, deviceKey: SecureKey) throws
            -> (DeviceIdentityKeys, SecureKey)?
        {
            guard let d = FileManager.default.contents(atPath: path(storeID: storeID, deviceID: deviceID)) else {
                return nil
            }
            let p = try JSONDecoder().decode(Pending.self, from: d)
            let dwk = try Keybag.deviceWrapKey(deviceKey)
            defer { dwk.wipe() }
            func u(_ s: String, _ slot: String) throws -> SecureKey {
                try KeyWrap.unwrap(
                    [UInt8](Data(base64Encoded: s) ?? Data()), with: dwk, ad: ad(storeID, deviceID, slot))
            }
            return (
                DeviceIdentityKeys(boxSecret: try u(p.box, "box"), signSeed: try u(p.sign, "sign")),
                try u(p.nonce, "nonce")
            )
        }
    }
}
