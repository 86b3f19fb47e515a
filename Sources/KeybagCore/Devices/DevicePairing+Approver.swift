import Foundation

/// The approver's side of adding a device by approval.
extension DevicePairing {
    /// What the approver keeps between its steps, outside the store
    /// (`STATE/STOREID.approving-ID`): the request it answered and its own nonce, so that no
    /// challenge or request a store writer puts in the store is taken for its own.
    struct ApprovalPin: Codable {
        var request: String
        var challenge: PairingMessages.Challenge

        static func path(storeID: String, deviceID: String) -> String {
            KeySetFloor.stateFolder + "/\(storeID).approving-\(deviceID)"
        }
    }

    /// One step of `keybagfs device approve` on a device of the store (unmounted): answers the
    /// request of `deviceID` with a challenge (kept here, and only that one from then on), then,
    /// once the newcomer revealed its nonce and `code` is the code it shows, opens every key
    /// with this device's passcode (a wrong one counted), certifies the newcomer and seals the
    /// keys to it in a grant this device signs. `cancel` gives the pairing up.
    public static func approveStep(
        _ kb: inout Keybag, _ deviceID: String, code: String?, deviceKey: SecureKey, cancel: Bool = false,
        passcode: () throws -> SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> DevicePairing.ApproverStep {
        guard let me = kb.file.deviceID, let trust = try DeviceTrust.rememberCertified(&kb, deviceKey: deviceKey),
            let mine = KeySets.ownDeviceKeys(kb)
        else {
            throw KeybagError.invalid(
                "this device has no identity yet: run `keybagfs recover` on it once, or add the new device with the "
                    + "recovery key")
        }
        guard DeviceIdentity.isWellFormed(deviceID), deviceID != me else {
            throw KeybagError.invalid("not the id of another device: \(deviceID.prefix(40))")
        }
        let pinPath = ApprovalPin.path(storeID: kb.file.storeID, deviceID: deviceID)
        let joined =
            trust.trusted[deviceID] != nil
            && FileManager.default.fileExists(atPath: kb.storePath + "/" + StoreDevices.keybagPath(deviceID))
        if cancel || joined {
            try endPairing(
                &kb, deviceID, pinPath: pinPath, forget: cancel && !joined, deviceKey: deviceKey)
            return .finished
        }
        try KeySets.refuseWhileBehind(kb, trust)
        guard !trust.removed.contains(deviceID) else { throw KeybagError.invalid("device \(deviceID) was removed") }
        try refuseKnownDevice(kb, deviceID, trust: trust)
        let request = try request(of: deviceID, in: kb)
        let hash = PairingMessages.requestHash(request)
        guard
            let pin = (try? StoreFileOpen.contents(pinPath))?.flatMap({
                try? JSONDecoder().decode(ApprovalPin.self, from: $0)
            })
        else {
            try answer(kb, request, hash: hash, pinPath: pinPath, me: me, sign: mine.sign)
            return .challenged
        }
        guard pin.request == hash else {
            throw KeybagError.invalid(
                "the request of \(deviceID) changed after this device answered it: the pairing files were changed on "
                    + "the way (or the new machine started again); give this pairing up (--cancel) and start again")
        }
        if PairingMessages.read(PairingMessages.Challenge.self, kb.storePath, deviceID, "challenge") != pin.challenge {
            // Put back as this device made it.
            try PairingMessages.write(pin.challenge, kb.storePath, deviceID, "challenge")
        }
        guard let reveal = PairingMessages.read(PairingMessages.Reveal.self, kb.storePath, deviceID, "reveal"),
            let nonce = Data(base64Encoded: reveal.nonce).map([UInt8].init),
            PairingMessages.commit(nonce) == request.commit
        else { return .waitingForReveal }
        guard let code else { return .needCode }
        guard code == PairingMessages.code(request, pin.challenge, nonce: nonce) else {
            throw KeybagError.invalid(
                "that is not the code this pairing gives: the pairing files were changed on the way (or the code was "
                    + "mistyped); nothing was approved")
        }
        let set = try writeGrant(
            &kb, request, trust: trust, deviceKey: deviceKey, passcode: passcode(), now: now)
        return .approved(keySet: set, confirmation: PairingMessages.confirmation(request, pin.challenge, nonce: nonce))
    }

    /// The request of `deviceID` in `kb`'s store, of the right shape for this store.
    private static func request(of deviceID: String, in kb: Keybag) throws -> PairingMessages.Request {
        guard let request = PairingMessages.read(PairingMessages.Request.self, kb.storePath, deviceID, "request"),
            request.storeID == kb.file.storeID, request.deviceID == deviceID,
            Data(base64Encoded: request.box)?.count == 32, Data(base64Encoded: request.sign)?.count == 32
        else { throw KeybagError.invalid("no request from device \(deviceID) in this store (yet)") }
        return request
    }

    /// Removes this device's pairing files for `deviceID`; with `forget` (given up after this
    /// device approved it) also what it remembered of that device.
    private static func endPairing(
        _ kb: inout Keybag, _ deviceID: String, pinPath: String, forget: Bool, deviceKey: SecureKey
    ) throws {
        for kind in ["challenge", "grant"] { unlink(PairingMessages.path(kb.storePath, deviceID, kind)) }
        unlink(pinPath)
        guard forget, let me = kb.file.deviceID, kb.file.approvals?[deviceID] == me else { return }
        if kb.counterKey == nil { _ = try kb.authenticate(deviceKey: deviceKey) }
        kb.file.trustedDevices?[deviceID] = nil
        kb.file.approvals?[deviceID] = nil
        try kb.save()
    }

    /// Refuses to approve an id that is not a new device's: one this device trusts, the first
    /// device's, or one with a keybag or a certificate in the store.
    private static func refuseKnownDevice(_ kb: Keybag, _ deviceID: String, trust: DeviceTrust) throws {
        let firstID = (try? Keybag.load(storePath: kb.storePath, relativePath: Keybag.fileName))?.file.deviceID
        guard trust.trusted[deviceID] == nil, firstID != deviceID,
            !FileManager.default.fileExists(atPath: kb.storePath + "/" + StoreDevices.keybagPath(deviceID)),
            !FileManager.default.fileExists(
                atPath: kb.storePath + "/" + StoreDevices.dirName + "/" + DeviceCertificate.fileName(deviceID))
        else {
            throw KeybagError.invalid(
                "device \(deviceID) is already a device of this store: only a new one is approved")
        }
    }

    /// Answers `request` with a challenge of a fresh nonce, kept at `pinPath` first.
    private static func answer(
        _ kb: Keybag, _ request: PairingMessages.Request, hash: String, pinPath: String, me: String, sign: String
    )
        throws
    {
        let c = PairingMessages.Challenge(
            deviceID: request.deviceID, approver: me, approverSign: sign,
            nonce: Data(Sodium.randomArray(32)).base64EncodedString(), request: hash)
        try FileManager.default.createDirectory(atPath: KeySetFloor.stateFolder, withIntermediateDirectories: true)
        try AtomicFile.write(
            try JSONEncoder().encode(ApprovalPin(request: hash, challenge: c)), to: pinPath)
        try PairingMessages.write(c, kb.storePath, request.deviceID, "challenge")
    }

    /// Opens every key (a wrong passcode counted), certifies `request`'s keys and writes the
    /// grant, with whom this device trusts.
    private static func writeGrant(
        _ kb: inout Keybag, _ request: PairingMessages.Request, trust: DeviceTrust, deviceKey: SecureKey,
        passcode: SecureKey, now: Double
    ) throws -> Int {
        defer { passcode.wipe() }
        let keys = try PasscodeAttempts.openAllCounted(&kb, passcode: passcode, deviceKey: deviceKey, now: now)
        defer { keys.wipe() }
        let identity = try DeviceIdentityKeys.open(from: kb, classA0: keys.sets[0].classA, deviceKey: deviceKey)
        defer { identity.wipe() }
        let me = kb.file.deviceID!
        var cert = DeviceCertificate(
            storeID: kb.file.storeID, deviceID: request.deviceID, box: request.box, sign: request.sign,
            name: request.name, keySet: keys.current, by: me, issuedAt: now.rounded(), signature: "")
        cert.signature = Data(try Ed25519.sign(cert.message, seed: identity.signSeed)).base64EncodedString()
        let payload = try DevicePairing.payload(keys)
        defer { payload.wipe() }
        var grant = PairingMessages.Grant(
            storeID: kb.file.storeID, deviceID: request.deviceID, approver: me, certificate: cert, keySet: keys.current,
            keys: Data(try SealedBox.seal(payload, to: [UInt8](Data(base64Encoded: request.box)!)))
                .base64EncodedString(),
            escrow: KeySets.escrowSlots(kb), storeCertify: Data(trust.root).base64EncodedString(),
            members: trust.trusted,
            removed: trust.removed.sorted(), approvals: DeviceTrust.knownApprovals(kb, trust), signature: "")
        grant.signature = Data(try Ed25519.sign(grant.message, seed: identity.signSeed)).base64EncodedString()
        // This device remembers whom it approved, with its keys, before anyone can claim otherwise.
        kb.file.trustedDevices?[request.deviceID] = DevicePublicKeys(box: request.box, sign: request.sign)
        kb.file.approvals = (kb.file.approvals ?? [:]).merging([request.deviceID: me]) { _, new in new }
        try kb.save()
        try PairingMessages.write(grant, kb.storePath, request.deviceID, "grant")
        return keys.current
    }
}
