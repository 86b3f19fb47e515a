import CSodium
import Foundation

/// The four files of adding a device by approval, each written by one side into the devices
/// folder (docs/FORMAT.md, "Adding a device by approval"): the newcomer's request (its public
/// keys and a commitment to its nonce), the approver's challenge (its signing key and its
/// nonce), the newcomer's reveal (its nonce), and the approver's grant (the certificate and
/// the store's keys sealed to the newcomer). Both sides show a six-digit code computed from
/// all three; a store writer who swaps any of them must have fixed its own nonce before it
/// saw the other side's, so it cannot pick keys that give the same code.
public enum PairingMessages {
    /// The newcomer's request: `devices/ID.request`.
    public struct Request: Codable, Sendable, Equatable {
        public var storeID: String
        public var deviceID: String
        public var box: String
        public var sign: String
        public var name: String?
        /// BLAKE2b-256 of the newcomer's nonce (base64): fixes it before the challenge.
        public var commit: String

        /// The bytes the code and the challenge bind.
        public var message: [UInt8] {
            var m = SignedMessage("keybagfs-pairing-request-v1")
            for (k, v) in [
                ("storeID", storeID), ("deviceID", deviceID), ("box", box), ("sign", sign),
                ("name", name ?? ""), ("commit", commit),
            ] { m.add(k, v) }
            return m.bytes
        }
    }

    /// The approver's answer to a request: `devices/ID.challenge`.
    public struct Challenge: Codable, Sendable, Equatable {
        public var deviceID: String
        public var approver: String
        /// The approver's Ed25519 key (base64): the grant must verify under it.
        public var approverSign: String
        /// 32 random bytes (base64), chosen after the request was seen.
        public var nonce: String
        /// BLAKE2b-256 of the request's message (base64).
        public var request: String

        /// The bytes the code binds.
        public var message: [UInt8] {
            var m = SignedMessage("keybagfs-pairing-challenge-v1")
            for (k, v) in [
                ("deviceID", deviceID), ("approver", approver), ("approverSign", approverSign),
                ("nonce", nonce), ("request", request),
            ] { m.add(k, v) }
            return m.bytes
        }
    }

    /// The newcomer's nonce, once it saw the challenge: `devices/ID.reveal`.
    public struct Reveal: Codable, Sendable, Equatable {
        public var deviceID: String
        public var nonce: String
    }

    /// What the approver hands over: `devices/ID.grant`.
    public struct Grant: Codable, Sendable, Equatable {
        public var storeID: String
        public var deviceID: String
        public var approver: String
        /// The newcomer's certificate, signed by the approver.
        public var certificate: DeviceCertificate
        /// The newest key set the keys reach.
        public var keySet: Int
        /// Every key set's A, B, C, D and the volume key, sealed to the newcomer (base64).
        public var keys: String
        /// The approver's escrow slots (under the recovery key).
        public var escrow: [String: String]
        /// The store certification key the approver trusts (base64): the newcomer's root.
        public var storeCertify: String
        /// The devices the approver trusts, with their keys: where the newcomer's trust starts.
        public var members: [String: DevicePublicKeys]
        /// The devices the approver knows were removed.
        public var removed: [String]
        /// Who approved whom, as the approver knows it.
        public var approvals: [String: String]? = nil
        /// Ed25519 signature of `message` by the approver (base64).
        public var signature: String

        /// The signed bytes.
        public var message: [UInt8] {
            var m = SignedMessage("keybagfs-pairing-grant-v1")
            for (k, v) in [
                ("storeID", storeID), ("deviceID", deviceID), ("approver", approver),
                ("keySet", String(keySet)), ("keys", keys), ("storeCertify", storeCertify),
            ] { m.add(k, v) }
            m.add("certificate", certificate.message)
            m.add("certificateSignature", certificate.signature)
            for (k, v) in escrow.sorted(by: { $0.key < $1.key }) { m.add("escrow." + k, v) }
            for (k, v) in members.sorted(by: { $0.key < $1.key }) { m.add("member." + k, v.joined) }
            for id in removed { m.add("removed", id) }
            for (k, v) in (approvals ?? [:]).sorted(by: { $0.key < $1.key }) { m.add("approval." + k, v) }
            return m.bytes
        }
    }

    /// BLAKE2b-256 of `parts`, concatenated after `label`.
    static func hash(_ label: String, _ parts: [[UInt8]]) -> [UInt8] {
        var all = Array(label.utf8)
        for p in parts { all += p }
        var out = [UInt8](repeating: 0, count: 32)
        Sodium.ensureInitialized()
        crypto_generichash(&out, 32, all, UInt64(all.count), nil, 0)
        return out
    }

    /// The commitment to a nonce.
    public static func commit(_ nonce: [UInt8]) -> String {
        Data(hash("keybagfs-pairing-commit-v1", [nonce])).base64EncodedString()
    }

    /// The six-digit code both sides show for this request, challenge and nonce.
    public static func code(_ request: Request, _ challenge: Challenge, nonce: [UInt8]) -> String {
        let h = hash("keybagfs-pairing-code-v1", [hash("", [request.message]), challenge.message, nonce])
        let n = h.prefix(8).reduce(UInt64(0)) { $0 << 8 | UInt64($1) }
        return String(format: "%06d", Int(n % 1_000_000))
    }

    /// The code the approver shows once it approved, which the newcomer must be given (it shows
    /// it nowhere itself): so the newcomer takes a grant only after the user saw the approver
    /// accept this very pairing.
    public static func confirmation(_ request: Request, _ challenge: Challenge, nonce: [UInt8]) -> String {
        let h = hash("keybagfs-pairing-confirm-v1", [hash("", [request.message]), challenge.message, nonce])
        let n = h.prefix(8).reduce(UInt64(0)) { $0 << 8 | UInt64($1) }
        return String(format: "%06d", Int(n % 1_000_000))
    }

    /// The challenge's hash, as the newcomer pins the one it answered.
    public static func challengeHash(_ challenge: Challenge) -> String {
        Data(hash("", [challenge.message])).base64EncodedString()
    }

    /// The request's hash, as a challenge names it.
    public static func requestHash(_ request: Request) -> String {
        Data(hash("", [request.message])).base64EncodedString()
    }

    /// Path of `deviceID`'s pairing file of `kind` (request, challenge, reveal, grant) in the store.
    public static func path(_ storePath: String, _ deviceID: String, _ kind: String) -> String {
        storePath + "/" + StoreDevices.dirName + "/\(deviceID).\(kind)"
    }

    /// Reads and decodes one pairing file (nil: absent or not one).
    public static func read<T: Decodable>(_ type: T.Type, _ storePath: String, _ deviceID: String, _ kind: String)
        -> T?
    {
        (try? StoreFileOpen.contents(path(storePath, deviceID, kind)))?.flatMap {
            try? JSONDecoder().decode(type, from: $0)
        }
    }

    /// Writes one pairing file atomically.
    public static func write<T: Encodable>(_ value: T, _ storePath: String, _ deviceID: String, _ kind: String) throws {
        try StoreDevices.makeFolder(storePath)
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        try AtomicFile.write(try enc.encode(value), to: path(storePath, deviceID, kind))
    }
}
