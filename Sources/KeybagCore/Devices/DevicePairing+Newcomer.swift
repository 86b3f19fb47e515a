import CSodium
import Foundation

/// The newcomer's side of adding a device by approval.
extension DevicePairing {
    /// One step of `keybagfs device add --approval` on the new machine (store unmounted):
    /// writes the request, then the reveal once the challenge is there; once the grant is
    /// there and `confirmedCode` is the code it shows (the user saw the same on the approving
    /// device), checks the grant against the approver's key the code covers and makes this
    /// device's keybag under `passcode()`.
    public static func newcomerStep(
        storePath: String, deviceKey: SecureKey, name: String?, confirmedCode: String?, strength: KDFStrength,
        passcode: () throws -> SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> NewcomerStep {
        let any = try Keybag.load(storePath: storePath)
        let storeID = any.file.storeID
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID)
        guard try Keybag.deviceOwning(key: deviceKey, storePath: storePath) == nil else {
            throw KeybagError.invalid("this device key is already a device of the store (\(id))")
        }
        guard StoreDevices.removal(storePath: storePath, id: id) == nil else {
            throw KeybagError.invalid("this device key was removed from the store: make a new device key")
        }
        guard let (identity, nonce) = try Pending.load(storeID: storeID, deviceID: id, deviceKey: deviceKey) else {
            let (identity, nonce) = try Pending.make(storeID: storeID, deviceID: id, deviceKey: deviceKey)
            defer { identity.wipe(); nonce.wipe() }
            let request = PairingMessages.Request(
                storeID: storeID, deviceID: id, box: Data(try identity.boxPublic()).base64EncodedString(),
                sign: Data(try identity.signPublic()).base64EncodedString(), name: name,
                commit: PairingMessages.commit(try nonce.withBytes { [UInt8]($0) }))
            try PairingMessages.write(request, storePath, id, "request")
            return .requested(id: id)
        }
        defer { identity.wipe(); nonce.wipe() }
        let mine = PairingMessages.Request(
            storeID: storeID, deviceID: id, box: Data(try identity.boxPublic()).base64EncodedString(),
            sign: Data(try identity.signPublic()).base64EncodedString(),
            name: PairingMessages.read(PairingMessages.Request.self, storePath, id, "request")?.name ?? name,
            commit: PairingMessages.commit(try nonce.withBytes { [UInt8]($0) }))
        if PairingMessages.read(PairingMessages.Request.self, storePath, id, "request") != mine {
            try PairingMessages.write(mine, storePath, id, "request")  // put back as this device made it
        }
        guard let challenge = PairingMessages.read(PairingMessages.Challenge.self, storePath, id, "challenge"),
            challenge.deviceID == id, challenge.request == PairingMessages.requestHash(mine)
        else { return .waitingForChallenge(id: id) }
        let n = try nonce.withBytes { [UInt8]($0) }
        try PairingMessages.write(
            PairingMessages.Reveal(deviceID: id, nonce: Data(n).base64EncodedString()), storePath, id, "reveal")
        let code = PairingMessages.code(mine, challenge, nonce: n)
        guard let grant = PairingMessages.read(PairingMessages.Grant.self, storePath, id, "grant"),
            let confirmedCode
        else { return .showCode(id: id, code: code) }
        guard confirmedCode == code else {
            throw KeybagError.invalid(
                "the code you typed (\(confirmedCode.prefix(12))) is not this device's (\(code)): the pairing files were "
                    + "changed on the way; do not use this device; nothing was changed")
        }
        let keys = try openGrant(grant, challenge: challenge, request: mine, identity: identity)
        defer { keys.wipe() }
        let pass = try passcode()
        defer { pass.wipe() }
        let kb = try makeKeybag(
            storePath: storePath, cipher: any.file.cipher, request: mine, grant: grant, keys: keys,
            identity: identity, passcode: pass, deviceKey: deviceKey, strength: strength)
        try grant.certificate.write(storePath: storePath)
        try KeySetFloor.record(kb, deviceID: id)
        for kind in ["request", "reveal"] { unlink(PairingMessages.path(storePath, id, kind)) }
        unlink(Pending.path(storeID: storeID, deviceID: id))
        return .added(id: id, keySet: keys.current)
    }

    /// Writes the newcomer's keybag: every key under its passcode and device key, its identity,
    /// the approver's root and escrow.
    static func makeKeybag(
        storePath: String, cipher: String, request: PairingMessages.Request, grant: PairingMessages.Grant,
        keys: StoreKeys, identity: DeviceIdentityKeys, passcode: SecureKey, deviceKey: SecureKey,
        strength: KDFStrength
    ) throws -> Keybag {
        var file = KeybagFile(
            format: Keybag.currentFormat, storeID: request.storeID, cipher: cipher, kdfOpsLimit: strength.opsLimit,
            kdfMemLimit: strength.memLimit,
            kdfSalt: Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString(),
            wrapped: [:], classBPublic: "", failedAttempts: 0, lockoutUntil: 0, counterMAC: nil)
        file.deviceID = request.deviceID
        file.deviceName = request.name
        try Keybag.wrapAll(keys, into: &file, passcode: passcode, deviceKey: deviceKey)
        try identity.store(into: &file, classA0: keys.sets[0].classA, deviceKey: deviceKey)
        file.storeCertify = grant.storeCertify
        if Keybag.isCompleteEscrow(grant.escrow, sets: keys.current) { file.wrapped.merge(grant.escrow) { $1 } }
        try StoreDevices.makeFolder(storePath)
        let kb = Keybag(
            storePath: storePath, file: file, counterKey: try Keybag.counterKey(deviceKey),
            relativePath: StoreDevices.keybagPath(request.deviceID))
        try kb.save()
        return kb
    }

    /// The store's keys from `grant`, once it verifies under the approver's key the challenge
    /// named and certifies this device's own keys; `corrupt` otherwise.
    static func openGrant(
        _ grant: PairingMessages.Grant, challenge: PairingMessages.Challenge, request: PairingMessages.Request,
        identity: DeviceIdentityKeys
    ) throws -> StoreKeys {
        let approver = Data(base64Encoded: challenge.approverSign).map([UInt8].init) ?? []
        let cert = grant.certificate
        guard grant.storeID == request.storeID, grant.deviceID == request.deviceID,
            grant.approver == challenge.approver,
            let sig = Data(base64Encoded: grant.signature),
            Ed25519.verify([UInt8](sig), of: grant.message, publicKey: approver),
            cert.storeID == request.storeID, cert.deviceID == request.deviceID, cert.box == request.box,
            cert.sign == request.sign, cert.by == challenge.approver, cert.isSigned(by: approver),
            cert.keySet == grant.keySet, Data(base64Encoded: grant.storeCertify)?.count == 32
        else {
            throw KeybagError.corrupt(
                "the grant is not signed by the approving device the code covers, or certifies other keys: nothing "
                    + "was changed")
        }
        let payload = try SealedBox.open([UInt8](Data(base64Encoded: grant.keys) ?? Data()), secret: identity.boxSecret)
        defer { payload.wipe() }
        let keys = try keys(ofPayload: payload)
        guard keys.current == grant.keySet else {
            keys.wipe()
            throw KeybagError.corrupt("the grant's keys do not reach the key set it names")
        }
        return keys
    }
}
