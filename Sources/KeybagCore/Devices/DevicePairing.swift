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
        /// The pairing was given up: this device's pairing files are gone.
        case cancelled(id: String)
    }

    /// Where the approver stands after a step.
    public enum ApproverStep: Sendable, Equatable {
        /// The challenge is written: the newcomer runs its command again.
        case challenged
        /// No reveal from the newcomer yet.
        case waitingForReveal
        /// The reveal is there: the approver needs the code the newcomer shows.
        case needCode
        /// The grant is written; the newcomer needs `confirmation`.
        case approved(keySet: Int, confirmation: String)
        /// The newcomer is a device of the store now, or the pairing was given up: this device's
        /// pairing files are gone.
        case finished
    }

    /// The payload a grant seals: the number of sets (u16 LE), then A, B, C, D of each, then the volume key.
    static func payload(_ keys: StoreKeys) throws -> SecureKey {
        let n = keys.sets.count
        return try SecureKey(count: 2 + 128 * n + 32) { out in
            out[0] = UInt8(n & 0xff)
            out[1] = UInt8(n >> 8)
            var at = 2
            for (i, s) in keys.sets.enumerated() {
                for k in [s.classA, s.classBSecret, s.classC, keys.classD[i]] {
                    try k.withBytes { (out.baseAddress! + at).copyMemory(from: $0.baseAddress!, byteCount: 32) }
                    at += 32
                }
            }
            try keys.volume.withBytes { (out.baseAddress! + at).copyMemory(from: $0.baseAddress!, byteCount: 32) }
        }
    }

    /// The keys of a payload; `corrupt` when malformed (fuzzed: the `pairing` target).
    public static func keys(ofPayload p: SecureKey) throws -> StoreKeys {
        try p.withBytes { b in
            guard b.count >= 2 else { throw KeybagError.corrupt("a grant of the wrong size") }
            let n = Int(b[0]) | Int(b[1]) << 8
            guard n >= 1, n <= Keybag.maxKeySet + 1, b.count == 2 + 128 * n + 32 else {
                throw KeybagError.corrupt("a grant of the wrong size")
            }
            func key(_ at: Int) -> SecureKey {
                SecureKey(count: 32) { $0.baseAddress!.copyMemory(from: b.baseAddress! + at, byteCount: 32) }
            }
            var sets: [UnlockedClassKeys] = [], classD: [SecureKey] = []
            for i in 0..<n {
                let base = 2 + 128 * i
                let bs = key(base + 32)
                sets.append(
                    UnlockedClassKeys(
                        classA: key(base), classBSecret: bs, classBPublic: try ClassBAgreement.publicKey(of: bs),
                        classC: key(base + 64), keySet: UInt8(i)))
                classD.append(key(base + 96))
            }
            return StoreKeys(sets: sets, classD: classD, volume: key(2 + 128 * n))
        }
    }

    /// What the newcomer keeps between its steps, outside the store (`STATE/STOREID.pairing-ID`):
    /// its identity secrets wrapped under the passcode key its keybag will have (same salt and
    /// cost; so they open with the passcode given at the first step, and the device key), its
    /// nonce under its device wrap key, and the challenge it answered once it did.
    struct Pending: Codable {
        var box: String
        var sign: String
        var nonce: String
        var boxPublic: String
        var signPublic: String
        var kdfSalt: String
        var kdfOpsLimit: UInt64
        var kdfMemLimit: UInt64
        /// The name the request gives.
        var name: String?
        /// BLAKE2b-256 of the challenge this device revealed its nonce for (base64).
        var challenge: String?

        static func path(storeID: String, deviceID: String) -> String {
            KeySetFloor.stateFolder + "/\(storeID).pairing-\(deviceID)"
        }

        static func ad(_ storeID: String, _ deviceID: String, _ slot: String) -> [UInt8] {
            Array("keybagfs-pairing-pending-v1|\(storeID)|\(deviceID)|\(slot)".utf8)
        }

        /// The keybag the newcomer will have, as far as its passcode key depends on it.
        func skeleton(storeID: String) -> KeybagFile {
            KeybagFile(
                format: Keybag.currentFormat, storeID: storeID, cipher: "", kdfOpsLimit: kdfOpsLimit,
                kdfMemLimit: kdfMemLimit, kdfSalt: kdfSalt, wrapped: [:], classBPublic: "", failedAttempts: 0,
                lockoutUntil: 0, counterMAC: nil)
        }

        /// New secrets, saved (0600); returns the pending state and the nonce.
        static func make(
            storeID: String, deviceID: String, deviceKey: SecureKey, passcode: SecureKey, strength: KDFStrength,
            name: String?
        ) throws -> (Pending, SecureKey) {
            let keys = DeviceIdentityKeys.generate(), nonce = SecureKey(random: 32)
            defer { keys.wipe() }
            var p = Pending(
                box: "", sign: "", nonce: "", boxPublic: Data(try keys.boxPublic()).base64EncodedString(),
                signPublic: Data(try keys.signPublic()).base64EncodedString(),
                kdfSalt: Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString(),
                kdfOpsLimit: strength.opsLimit, kdfMemLimit: strength.memLimit, name: name, challenge: nil)
            let pk = try PasscodeKey.derive(
                passcode: passcode, file: p.skeleton(storeID: storeID), deviceKey: deviceKey)
            defer { pk.wipe() }
            let dwk = try KeybagMACs.deviceWrapKey(deviceKey)
            defer { dwk.wipe() }
            func w(_ k: SecureKey, _ with: SecureKey, _ slot: String) throws -> String {
                Data(try KeyWrap.wrap(k, with: with, ad: ad(storeID, deviceID, slot))).base64EncodedString()
            }
            (p.box, p.sign, p.nonce) = (
                try w(keys.boxSecret, pk, "box"), try w(keys.signSeed, pk, "sign"), try w(nonce, dwk, "nonce")
            )
            try p.save(storeID: storeID, deviceID: deviceID)
            return (p, nonce)
        }

        /// Saves it (0600).
        func save(storeID: String, deviceID: String) throws {
            try FileManager.default.createDirectory(atPath: KeySetFloor.stateFolder, withIntermediateDirectories: true)
            try AtomicFile.write(
                try JSONEncoder().encode(self), to: Self.path(storeID: storeID, deviceID: deviceID))
        }

        /// The saved state (nil: none).
        static func load(storeID: String, deviceID: String) throws -> Pending? {
            guard let d = try StoreFileOpen.contents(path(storeID: storeID, deviceID: deviceID)) else {
                return nil
            }
            return try JSONDecoder().decode(Pending.self, from: d)
        }

        /// The nonce, with the device key.
        func nonce(storeID: String, deviceID: String, deviceKey: SecureKey) throws -> [UInt8] {
            let dwk = try KeybagMACs.deviceWrapKey(deviceKey)
            defer { dwk.wipe() }
            let n = try KeyWrap.unwrap(
                [UInt8](Data(base64Encoded: nonce) ?? Data()), with: dwk, ad: Self.ad(storeID, deviceID, "nonce"))
            defer { n.wipe() }
            return try n.withBytes { [UInt8]($0) }
        }

        /// The identity secrets, with the passcode given at the first step; `badPasscode` for another.
        func identity(storeID: String, deviceID: String, deviceKey: SecureKey, passcode: SecureKey) throws
            -> DeviceIdentityKeys
        {
            let pk = try PasscodeKey.derive(passcode: passcode, file: skeleton(storeID: storeID), deviceKey: deviceKey)
            defer { pk.wipe() }
            func u(_ s: String, _ slot: String) throws -> SecureKey {
                do {
                    return try KeyWrap.unwrap(
                        [UInt8](Data(base64Encoded: s) ?? Data()), with: pk, ad: Self.ad(storeID, deviceID, slot))
                } catch KeybagError.corrupt { throw KeybagError.badPasscode }
            }
            let box = try u(box, "box")
            do { return DeviceIdentityKeys(boxSecret: box, signSeed: try u(sign, "sign")) } catch {
                box.wipe()
                throw error
            }
        }
    }
}
