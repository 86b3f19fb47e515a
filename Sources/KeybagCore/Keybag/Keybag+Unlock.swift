import Foundation

/// Opening a keybag's slots: device-only keys with the device key, the class keys with the passcode.
extension Keybag {
    /// Unwraps a device-only key (`D` or `volume`); a wrong device key gives `badDeviceKey`.
    public func unwrapDeviceKeySlot(_ slot: String, deviceKey: SecureKey) throws -> SecureKey {
        let dwk = try KeybagMACs.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        do {
            return try KeyWrap.unwrap(
                try file.blob(slot), with: dwk, ad: KeybagMACs.ad(file.storeID, slot, format: file.format))
        } catch KeybagError.corrupt {
            // A format-4 keybag edited to claim an older format: the slot opens under the v4 tag.
            if file.format < Keybag.settingsFormat,
                let k = try? KeyWrap.unwrap(
                    try file.blob(slot), with: dwk, ad: KeybagMACs.ad(file.storeID, slot, format: Keybag.settingsFormat)
                )
            {
                k.wipe()
                throw KeybagError.corrupt(
                    "keybag field format was edited offline (it says \(file.format); the keybag was written as format "
                        + "\(Keybag.settingsFormat)); nothing was changed")
            }
            throw KeybagError.badDeviceKey
        }
    }

    /// Unwraps A, B and C of key set 0 with a passcode; `badPasscode` when it is wrong. Does
    /// not count attempts.
    public func unlock(passcode: SecureKey, deviceKey: SecureKey) throws -> UnlockedClassKeys {
        let sets = try unlockAll(passcode: passcode, deviceKey: deviceKey)
        for s in sets.dropFirst() { s.wipe() }
        return sets[0]
    }

    /// Unwraps A, B and C of every key set with a passcode, oldest first; `badPasscode` when
    /// it is wrong. Does not count attempts.
    public func unlockAll(passcode: SecureKey, deviceKey: SecureKey) throws -> [UnlockedClassKeys] {
        let kek = try PasscodeKey.derive(passcode: passcode, file: file, deviceKey: deviceKey, sealer: sealer)
        defer { kek.wipe() }
        var sets: [UnlockedClassKeys] = []
        do {
            for n in 0...currentKeySet {
                func take(_ base: String) throws -> SecureKey {
                    let slot = Keybag.slot(base, n)
                    return try KeyWrap.unwrap(try file.blob(slot), with: kek, ad: KeybagMACs.ad(file.storeID, slot))
                }
                let a = try take("A")
                let b: SecureKey, c: SecureKey
                do { b = try take("B") } catch { a.wipe(); throw error }
                do { c = try take("C") } catch { a.wipe(); b.wipe(); throw error }
                let pk: [UInt8]
                do { pk = try ClassBAgreement.publicKey(of: b) } catch { a.wipe(); b.wipe(); c.wipe(); throw error }
                sets.append(
                    UnlockedClassKeys(classA: a, classBSecret: b, classBPublic: pk, classC: c, keySet: UInt8(n)))
            }
            return sets
        } catch KeybagError.corrupt {
            for s in sets { s.wipe() }
            throw KeybagError.badPasscode
        }
    }

    /// The class D key of every key set (the device key alone opens them).
    public func classDKeys(deviceKey: SecureKey) throws -> [UInt8: SecureKey] {
        var keys: [UInt8: SecureKey] = [:]
        do {
            for n in 0...currentKeySet {
                keys[UInt8(n)] = try unwrapDeviceKeySlot(Keybag.slot("D", n), deviceKey: deviceKey)
            }
        } catch {
            for k in keys.values { k.wipe() }
            throw error
        }
        return keys
    }

}
