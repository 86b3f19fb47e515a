import CSodium
import Foundation

/// The approver's side of adding a device by approval (`DevicePairing`).
extension Keybag {
    /// One step of `keybagfs device approve` on a device of the store (unmounted): answers the
    /// request of `deviceID` with a challenge, then, once the newcomer revealed its nonce and
    /// `code` is the code it shows, opens every key with this device's passcode (a wrong one
    /// counted), certifies the newcomer and seals the keys to it in a grant this device signs.
    public mutating func approveStep(
        _ deviceID: String, code: String?, deviceKey: SecureKey, passcode: () throws -> SecureKey,
        now: Double = Date().timeIntervalSince1970
    ) throws -> DevicePairing.ApproverStep {
        guard let me = file.deviceID, hasIdentity, let mine = ownDeviceKeys else {
            throw KeybagError.invalid(
                "this device has no identity yet: run `keybagfs recover` on it once, or add the new device with the "
                    + "recovery key")
        }
        guard DeviceIdentity.isWellFormed(deviceID), deviceID != me else {
            throw KeybagError.invalid("not the id of another device: \(deviceID.prefix(40))")
        }
        if StoreDevices.list(storePath: storePath).contains(where: { $0.id == deviceID }),
            FileManager.default.fileExists(atPath: PairingMessages.path(storePath, deviceID, "grant"))
        {
            for kind in ["challenge", "grant"] { unlink(PairingMessages.path(storePath, deviceID, kind)) }
            return .finished
        }
        guard let request = PairingMessages.read(PairingMessages.Request.self, storePath, deviceID, "request"),
            request.storeID == file.storeID, request.deviceID == deviceID,
            Data(base64Encoded: request.box)?.count == 32, Data(base64Encoded: request.sign)?.count == 32
        else { throw KeybagError.invalid("no request from device \(deviceID) in this store (yet)") }
        guard StoreDevices.removal(storePath: storePath, id: deviceID) == nil,
            !StoreDevices.list(storePath: storePath).contains(where: { $0.id == deviceID })
        else { throw KeybagError.invalid("device \(deviceID) is already a device of this store, or was removed") }
        let hash = PairingMessages.requestHash(request)
        guard let challenge = PairingMessages.read(PairingMessages.Challenge.self, storePath, deviceID, "challenge"),
            challenge.request == hash, challenge.approver == me, challenge.approverSign == mine.sign
        else {
            let c = PairingMessages.Challenge(
                deviceID: deviceID, approver: me, approverSign: mine.sign,
                nonce: Data(Sodium.randomArray(32)).base64EncodedString(), request: hash)
            try PairingMessages.write(c, storePath, deviceID, "challenge")
            return .challenged
        }
        guard let reveal = PairingMessages.read(PairingMessages.Reveal.self, storePath, deviceID, "reveal"),
            let nonce = Data(base64Encoded: reveal.nonce).map([UInt8].init)
        else { return .waitingForReveal }
        guard PairingMessages.commit(nonce) == request.commit else {
            throw KeybagError.invalid(
                "the new device's nonce does not match its request: the pairing files were changed on the way; do not "
                    + "approve")
        }
        guard let code else { return .needCode }
        guard code == PairingMessages.code(request, challenge, nonce: nonce) else {
            throw KeybagError.invalid(
                "that is not the code this pairing gives: the pairing files were changed on the way (or the code was "
                    + "mistyped); nothing was approved")
        }
        return .approved(keySet: try writeGrant(request, deviceKey: deviceKey, passcode: passcode(), now: now))
    }

    /// Opens every key (a wrong passcode counted), certifies `request`'s keys and writes the grant.
    private mutating func writeGrant(
        _ request: PairingMessages.Request, deviceKey: SecureKey, passcode: SecureKey, now: Double
    ) throws -> Int {
        defer { passcode.wipe() }
        let keys = try openAllCounted(passcode: passcode, deviceKey: deviceKey, now: now)
        defer { keys.wipe() }
        let identity = try identityKeys(classA0: keys.sets[0].classA, deviceKey: deviceKey)
        defer { identity.wipe() }
        let me = file.deviceID!
        var cert = DeviceCertificate(
            storeID: file.storeID, deviceID: request.deviceID, box: request.box, sign: request.sign,
            name: request.name, keySet: keys.current, by: me, issuedAt: now.rounded(), signature: "")
        cert.signature = Data(try Ed25519.sign(cert.message, seed: identity.signSeed)).base64EncodedString()
        let payload = try DevicePairing.payload(keys)
        defer { payload.wipe() }
        var grant = PairingMessages.Grant(
            storeID: file.storeID, deviceID: request.deviceID, approver: me, certificate: cert, keySet: keys.current,
            keys: Data(try SealedBox.seal(payload, to: [UInt8](Data(base64Encoded: request.box)!)))
                .base64EncodedString(),
            escrow: escrowSlots, storeCertify: file.storeCertify ?? "", signature: "")
        grant.signature = Data(try Ed25519.sign(grant.message, seed: identity.signSeed)).base64EncodedString()
        try PairingMessages.write(grant, storePath, request.deviceID, "grant")
        return keys.current
    }
}
