import Foundation

/// Opening a keybag: reading one from the store, and every key it holds.
extension Keybag {
    /// Reads one keybag file of a store (`keybag` or `devices/ID.keybag`).
    public static func load(
        storePath: String, relativePath: String, now: Double = Date().timeIntervalSince1970
    ) throws -> Keybag {
        let p = storePath + "/" + relativePath
        guard let data = try StoreFileOpen.contents(p) else {
            throw KeybagError.invalid("no keybag at \(p): not a keybagfs store (run `keybagfs init` first)")
        }
        do {
            let file = try JSONDecoder().decode(KeybagFile.self, from: data)
            try file.validate()
            return Keybag(storePath: storePath, file: file, relativePath: relativePath)
        } catch let e as KeybagError {
            throw e
        } catch {
            throw KeybagError.corrupt("keybag \(p) is not valid JSON")
        }
    }

    /// Some keybag of the store (the first device's, else an added device's): its store id
    /// and settings, before the device key is known.
    public static func load(storePath: String, now: Double = Date().timeIntervalSince1970) throws -> Keybag {
        if FileManager.default.fileExists(atPath: storePath + "/" + fileName) {
            return try load(storePath: storePath, relativePath: fileName, now: now)
        }
        if let e = StoreDevices.entries(storePath).first(where: { $0.hasSuffix(".keybag") }) {
            return try load(storePath: storePath, relativePath: StoreDevices.dirName + "/" + e, now: now)
        }
        return try load(storePath: storePath, relativePath: fileName, now: now)  // the "no keybag" error
    }

    /// The keybag of the device holding `deviceKey`: its own `devices/ID.keybag`, else the
    /// store's first keybag. A removed device is told so (its keys stay what they were).
    public static func load(
        storePath: String, deviceKey: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> Keybag {
        let any = try load(storePath: storePath, now: now)
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: any.file.storeID)
        // A device with an identity goes only by a removal record it can verify (a forged one
        // is named by `DeviceTrust`); one without, by any record, as before identities.
        func refuseIfRemoved(_ kb: Keybag?) throws {
            guard let r = StoreDevices.removal(storePath: storePath, id: id) else { return }
            if let kb, let trust = DeviceTrust.of(kb), !trust.removed.contains(id) { return }
            let when = Date(timeIntervalSince1970: r.removedAt)
            throw KeybagError.invalid(
                "this device (\(id)) was removed from the store on \(when); it can open only files written before "
                    + "that. Add it again with `keybagfs device add` and a new device key")
        }
        let own = StoreDevices.keybagPath(id)
        if FileManager.default.fileExists(atPath: storePath + "/" + own) {
            let kb = try load(storePath: storePath, relativePath: own, now: now)
            guard kb.file.storeID == any.file.storeID, kb.file.deviceID == id else {
                throw KeybagError.corrupt("keybag \(own) belongs to another store or device")
            }
            try refuseIfRemoved(kb)
            return kb
        }
        guard var first = try? load(storePath: storePath, relativePath: fileName, now: now),
            (first.file.deviceID ?? id) == id
        else {
            try refuseIfRemoved(nil)
            _ = try load(storePath: storePath, relativePath: fileName, now: now)  // its error, if it has one
            throw KeybagError.badDeviceKey
        }
        try refuseIfRemoved(first)
        if first.file.deviceID == nil {
            first.file.deviceID = id  // saved by `authenticate` at the next mount
            first.pendingDeviceID = true
        }
        return first
    }

    /// This keybag's device id (nil: the first device's keybag, before it learnt its id).
    public var deviceID: String? { file.deviceID }

    /// Whether the store has a recovery key.
    public var hasRecoveryKey: Bool { file.wrapped["rA"] != nil }

    /// Every key this keybag holds, from the passcode and the device key; `badPasscode`
    /// when the passcode is wrong (not counted here).
    public func openAll(passcode: SecureKey, deviceKey: SecureKey) throws -> StoreKeys {
        let d = try classDKeys(deviceKey: deviceKey)
        let volume: SecureKey
        do { volume = try unwrapDeviceKeySlot("volume", deviceKey: deviceKey) } catch {
            d.values.forEach { $0.wipe() }
            throw error
        }
        let sets: [UnlockedClassKeys]
        do { sets = try unlockAll(passcode: passcode, deviceKey: deviceKey) } catch {
            d.values.forEach { $0.wipe() }; volume.wipe(); throw error
        }
        return StoreKeys(sets: sets, classD: (0...currentKeySet).map { d[UInt8($0)]! }, volume: volume)
    }

}
