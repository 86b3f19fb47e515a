import Foundation

/// The newcomer's side of adding a device by approval.
extension DevicePairing {
    /// One step of `keybagfs device add --approval` on the new machine (store unmounted):
    /// writes the request (its secrets kept under `newPasscode()`), then the reveal for the
    /// first challenge that answers it (and only that one from then on); once the grant is
    /// there and `confirmedCode` is the code it shows (the user saw the approving device take
    /// it), checks the grant against the approver's key the code covers and makes this
    /// device's keybag under `passcode()` (the one given first). `cancel` gives the pairing up.
    public static func newcomerStep(
        storePath: String, deviceKey: SecureKey, name: String?, confirmedCode: String?, strength: KDFStrength,
        cancel: Bool = false, newPasscode: () throws -> SecureKey, passcode: () throws -> SecureKey
    ) throws -> NewcomerStep {
        let any = try Keybag.load(storePath: storePath)
        let storeID = any.file.storeID
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID)
        let cleanUp = {
            for kind in ["request", "reveal"] { unlink(PairingMessages.path(storePath, id, kind)) }
            unlink(Pending.path(storeID: storeID, deviceID: id))
        }
        if cancel {
            cleanUp()
            return .cancelled(id: id)
        }
        guard try StoreDevices.deviceOwning(key: deviceKey, storePath: storePath) == nil else {
            throw KeybagError.invalid("this device key is already a device of the store (\(id))")
        }
        guard var pending = try Pending.load(storeID: storeID, deviceID: id) else {
            let pass = try newPasscode()
            defer { pass.wipe() }
            let (p, nonce) = try Pending.make(
                storeID: storeID, deviceID: id, deviceKey: deviceKey, passcode: pass, strength: strength, name: name)
            defer { nonce.wipe() }
            try PairingMessages.write(
                request(p, storeID, id, try nonce.withBytes { [UInt8]($0) }), storePath, id, "request")
            return .requested(id: id)
        }
        let nonce = try pending.nonce(storeID: storeID, deviceID: id, deviceKey: deviceKey)
        let mine = request(pending, storeID, id, nonce)
        if PairingMessages.read(PairingMessages.Request.self, storePath, id, "request") != mine {
            try PairingMessages.write(mine, storePath, id, "request")  // put back as this device made it
        }
        guard let challenge = PairingMessages.read(PairingMessages.Challenge.self, storePath, id, "challenge"),
            challenge.deviceID == id, challenge.request == PairingMessages.requestHash(mine)
        else { return .waitingForChallenge(id: id) }
        let answered = PairingMessages.challengeHash(challenge)
        guard pending.challenge ?? answered == answered else {
            throw KeybagError.invalid(
                "the approving device's answer changed after this device revealed its nonce: the pairing files were "
                    + "changed on the way; give this pairing up (--cancel) and start again")
        }
        try pin(&pending, answered, storeID: storeID, id: id)
        let reveal = PairingMessages.Reveal(deviceID: id, nonce: Data(nonce).base64EncodedString())
        if PairingMessages.read(PairingMessages.Reveal.self, storePath, id, "reveal") != reveal {
            try PairingMessages.write(reveal, storePath, id, "reveal")
        }
        let code = PairingMessages.code(mine, challenge, nonce: nonce)
        guard let grant = PairingMessages.read(PairingMessages.Grant.self, storePath, id, "grant"), let confirmedCode
        else { return .showCode(id: id, code: code) }
        guard confirmedCode == PairingMessages.confirmation(mine, challenge, nonce: nonce) else {
            throw KeybagError.invalid(
                "\(confirmedCode.prefix(12)) is not the confirmation code of this pairing: a typo, or the approving "
                    + "device did not approve this very pairing (the files were changed on the way: give it up with "
                    + "--cancel); nothing was changed")
        }
        return try finish(
            storePath: storePath, cipher: any.file.cipher, request: mine, pending: pending, challenge: challenge,
            grant: grant, deviceKey: deviceKey, passcode: passcode, cleanUp: cleanUp)
    }

    /// Keeps `answered` as the challenge this device answers from now on (once).
    static func pin(_ pending: inout Pending, _ answered: String, storeID: String, id: String) throws {
        guard pending.challenge == nil else { return }
        pending.challenge = answered
        try pending.save(storeID: storeID, deviceID: id)
    }

    /// The request a pending state makes.
    static func request(_ p: Pending, _ storeID: String, _ id: String, _ nonce: [UInt8]) -> PairingMessages.Request {
        PairingMessages.Request(
            storeID: storeID, deviceID: id, box: p.boxPublic, sign: p.signPublic, name: p.name,
            commit: PairingMessages.commit(nonce))
    }

    /// The last step: opens the identity with the passcode, the grant with it, and writes the
    /// certificate, then the keybag.
    static func finish(
        storePath: String, cipher: String, request: PairingMessages.Request, pending: Pending,
        challenge: PairingMessages.Challenge, grant: PairingMessages.Grant, deviceKey: SecureKey,
        passcode: () throws -> SecureKey, cleanUp: () -> Void
    ) throws -> NewcomerStep {
        let pass = try passcode()
        defer { pass.wipe() }
        let identity: DeviceIdentityKeys
        do {
            identity = try pending.identity(
                storeID: request.storeID, deviceID: request.deviceID, deviceKey: deviceKey, passcode: pass)
        } catch KeybagError.badPasscode {
            throw KeybagError.invalid("not the passcode given at this device's first step; nothing was changed")
        }
        defer { identity.wipe() }
        let keys = try openGrant(grant, challenge: challenge, request: request, identity: identity)
        defer { keys.wipe() }
        // The certificate first (a keybag without it would be a device nobody trusts), signed
        // by this device too: no other device can claim to have approved it.
        var certificate = grant.certificate
        certificate.selfSignature = Data(try Ed25519.sign(certificate.message, seed: identity.signSeed))
            .base64EncodedString()
        try certificate.write(storePath: storePath)
        let kb = try makeKeybag(
            storePath: storePath, cipher: cipher, request: request, pending: pending, grant: grant, keys: keys,
            identity: identity, passcode: pass, deviceKey: deviceKey)
        try KeySetFloor.record(kb, deviceID: request.deviceID)
        cleanUp()
        return .added(id: request.deviceID, keySet: keys.current)
    }

    /// Writes the newcomer's keybag: every key under its passcode (the salt and cost its pending
    /// state chose) and device key, its identity, whom the approver trusts, its root and escrow.
    static func makeKeybag(
        storePath: String, cipher: String, request: PairingMessages.Request, pending: Pending,
        grant: PairingMessages.Grant, keys: StoreKeys, identity: DeviceIdentityKeys, passcode: SecureKey,
        deviceKey: SecureKey
    ) throws -> Keybag {
        var file = pending.skeleton(storeID: request.storeID)
        file.cipher = cipher
        file.deviceID = request.deviceID
        file.deviceName = request.name
        try KeySets.wrapAll(keys, into: &file, passcode: passcode, deviceKey: deviceKey)
        try identity.store(into: &file, classA0: keys.sets[0].classA, deviceKey: deviceKey)
        var trusted = grant.members
        trusted[request.deviceID] = DevicePublicKeys(box: request.box, sign: request.sign)
        var approvals = DeviceTrust.wellFormed(grant.approvals ?? [:])
        approvals[request.deviceID] = grant.approver
        file.approvals = approvals
        DeviceTrust.remember(
            trusted: trusted, removed: Set(grant.removed),
            root: Data(base64Encoded: grant.storeCertify).map([UInt8].init) ?? [], in: &file)
        let escrow = grant.escrow.filter { $0.key.hasPrefix("r") }
        if RecoveryEscrow.isComplete(escrow, sets: keys.current) { file.wrapped.merge(escrow) { $1 } }
        try StoreDevices.makeFolder(storePath)
        let kb = Keybag(
            storePath: storePath, file: file, counterKey: try KeybagMACs.counterKey(deviceKey),
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
            cert.keySet == grant.keySet, Data(base64Encoded: grant.storeCertify)?.count == 32,
            grant.members.allSatisfy({ DeviceIdentity.isWellFormed($0.key) && $0.value.isWellFormed }),
            grant.members[challenge.approver]?.sign == challenge.approverSign,
            !grant.removed.contains(challenge.approver), !grant.removed.contains(request.deviceID)
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
