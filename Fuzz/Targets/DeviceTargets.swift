import Foundation
import KeybagCore

extension FuzzTarget {
    /// The devices folder (`STORE/devices`) and the files beside a device's keybag.
    static let deviceTargets: [FuzzTarget] = [
        // Certificates, key-set records and removal records, judged from the seed device's
        // trust as `device list` and every unlock judge them. Signatures need the devices'
        // keys; the seeds are the seed store's real records. The input is a set of files:
        // repeated (name selector, 2-byte length, contents).
        FuzzTarget(name: "device-trust") { input in
            let store = SeedStore.shared
            guard let snapshot = DeviceTrust.snapshot(store.keybag) else { return }
            var r = ByteReader(input[...])
            var files: [String: Data] = [:]
            let names = store.files(in: "devices") + ["keyset-2.\(store.deviceID).json", "x.removed", "y.identity"]
            while !r.atEnd && files.count < 16 {
                let pick = Int(r.byte())
                let name =
                    pick < 0xf0
                    ? names[pick % names.count] : String(decoding: r.bytes(Int(r.byte()) % 64), as: UTF8.self)
                files[name] = Data(r.bytes(Int(r.u16())))
            }
            let trust = DeviceTrust.evaluate(files: files, storeID: store.keybag.file.storeID, snapshot: snapshot)
            _ = trust.refused.map(DeviceTrust.shown)
        },
        // A device's pairing files (request, challenge, reveal, grant), as `device add
        // --approval` and `device approve` read them from the store.
        FuzzTarget(name: "pairing") { input in
            let store = SeedStore.shared.freshCopy()
            let id = SeedStore.shared.deviceID
            for kind in ["request", "challenge", "reveal", "grant"] {
                put(input, at: PairingMessages.path(store, id, kind))
            }
            if let q = PairingMessages.read(PairingMessages.Request.self, store, id, "request") {
                _ = q.message
                _ = PairingMessages.requestHash(q)
                if let c = PairingMessages.read(PairingMessages.Challenge.self, store, id, "challenge") {
                    _ = c.message
                    _ = PairingMessages.challengeHash(c)
                    _ = PairingMessages.code(q, c, nonce: Array(input.prefix(32)))
                    _ = PairingMessages.confirmation(q, c, nonce: Array(input.prefix(32)))
                }
            }
            _ = PairingMessages.read(PairingMessages.Reveal.self, store, id, "reveal")
            _ = PairingMessages.read(PairingMessages.Grant.self, store, id, "grant")
            // The keys a grant seals, as the newcomer takes them once the box opens: only a device
            // of the store that signs the grant reaches this (an empty payload trapped here).
            let payload = SecureKey(count: input.count) { $0.copyBytes(from: input) }
            (try? DevicePairing.keys(ofPayload: payload))?.wipe()
            payload.wipe()
        },
        // A device's TPM enrollment record (`/var/lib/keybagfs/ID.tpm2`): decoded, its blobs
        // and PCR list read (sealing and unsealing need a TPM: the mount tests' swtpm).
        FuzzTarget(name: "tpm-enrollment") { input in
            let path = SeedStore.shared.freshCopy() + "/enrollment.tpm2"
            put(input, at: path)
            _ = try? TPMEnrollment.load(from: path)
        },
    ]
}
