import CSodium
import Foundation

/// A device's keybag: its file and what every holder needs (create, load, authenticate with
/// the device key, unlock, save atomically). Key sets, devices, recovery, the TPM, passcode
/// changes and failed attempts are rooms of their own that take it (`KeySets`, `StoreDevices`,
/// `RecoveryEscrow`, `TPMBinding`, `PasscodeKey`, `PasscodeAttempts`).
public struct Keybag: Sendable {
    /// File name of the keybag inside the store.
    public static let fileName = "keybag"
    /// Folder inside the store that holds the encrypted tree.
    public static let dataDirName = "data"
    /// Folder inside the store for symlink targets too long for a backing symlink.
    public static let targetsDirName = "targets"
    /// Folder inside the store for sealed user xattrs.
    public static let xattrsDirName = "xattrs"

    /// Path of the store.
    public let storePath: String
    /// The keybag file's path inside the store: `keybag` (the device that made the store) or
    /// `devices/ID.keybag`.
    public let relativePath: String
    /// The parsed file.
    public internal(set) var file: KeybagFile
    /// The key that authenticates the failed-attempt counter (from the device key), once known.
    var counterKey: SecureKey?
    /// The first device's keybag learnt its device id on load; `authenticate` saves it.
    var pendingDeviceID = false
    /// This device's TPM, when its passcode key includes a sealed secret (`file.tpm2`).
    public var sealer: (any PasscodeSealer)? = nil
    /// Current keybag format: 4 (settings MAC; device-only slots wrapped with the v4 AD).
    /// Format 2 brought the counter MAC, 3 marks key sets.
    public static let currentFormat = settingsFormat
    /// The keybag format whose settings are authenticated as a whole (`settingsMAC`).
    public static let settingsFormat = 4

    init(storePath: String, file: KeybagFile, counterKey: SecureKey? = nil, relativePath: String = Keybag.fileName) {
        self.storePath = storePath
        self.relativePath = relativePath
        self.file = file
        self.counterKey = counterKey
    }

    /// The store's content cipher.
    public var cipher: ContentCipher { ContentCipher(name: file.cipher) ?? .xchacha20poly1305 }
    /// Path of the keybag file.
    public var path: String { storePath + "/" + relativePath }
    /// The key set new files are wrapped for.
    public var currentKeySet: Int { file.keySet ?? 0 }
    /// The keybag format that marks key sets (an older daemon refuses such a keybag).
    public static let keySetsFormat = 3
    /// Most key sets a store may have (the set number is one header byte).
    public static let maxKeySet = 255

    /// Name of `base`'s slot in key set `set` (`A`, `A.1`, …).
    public static func slot(_ base: String, _ set: Int) -> String { set == 0 ? base : "\(base).\(set)" }

    /// Creates a new keybag in `storePath` (which must be empty or absent) and returns it.
    /// With `recovery`, the five keys are also wrapped for that recovery key.
    public static func create(
        storePath: String, storeID: String, passcode: SecureKey, deviceKey: SecureKey, strength: KDFStrength,
        cipher: ContentCipher = .default, format: Int = Keybag.currentFormat, recovery: RecoveryKey? = nil,
        deviceName: String? = nil, sealer: (any PasscodeSealer)? = nil,
        withKeys: ([UnlockedClassKeys]) throws -> Void = { _ in }
    ) throws -> Keybag {
        var file = KeybagFile(
            format: format, storeID: storeID, cipher: cipher.name, kdfOpsLimit: strength.opsLimit,
            kdfMemLimit: strength.memLimit,
            kdfSalt: Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString(),
            wrapped: [:], classBPublic: "", failedAttempts: 0, lockoutUntil: 0, counterMAC: nil)
        file.deviceID = try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID)
        file.deviceName = deviceName
        if sealer != nil { file.tpm2 = true }
        let kek = try PasscodeKey.derive(
            passcode: passcode, file: file, deviceKey: deviceKey, sealer: sealer, making: true)
        defer { kek.wipe() }
        let dwk = try KeybagMACs.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        let a = SecureKey(random: 32), bs = SecureKey(random: 32), c = SecureKey(random: 32)
        let d = SecureKey(random: 32), vol = SecureKey(random: 32)
        defer { [a, bs, c, d, vol].forEach { $0.wipe() } }
        let bp = try ClassBAgreement.publicKey(of: bs)
        for (slot, key, wrapper) in [("A", a, kek), ("B", bs, kek), ("C", c, kek), ("D", d, dwk), ("volume", vol, dwk)]
        {
            file.wrapped[slot] = Data(
                try KeyWrap.wrap(key, with: wrapper, ad: KeybagMACs.ad(storeID, slot, format: format))
            )
            .base64EncodedString()
        }
        var certificate: DeviceCertificate?
        if let recovery {
            try RecoveryEscrow.write(
                &file, keys: [("A", a), ("B", bs), ("C", c), ("D", d), ("volume", vol)], recovery: recovery)
            if format >= settingsFormat {  // a new store's certification key, and this device's identity
                let certify = SecureKey(random: 32)
                defer { certify.wipe() }
                let keys = StoreKeys(
                    sets: [UnlockedClassKeys(classA: a, classBSecret: bs, classBPublic: bp, classC: c)], classD: [d],
                    volume: vol)  // the same key objects: wiped by the defers above
                certificate = try DeviceIdentityKeys.make(
                    &file, keys: keys, storePath: storePath, deviceKey: deviceKey, certifySeed: certify,
                    recovery: recovery)
            }
        }
        file.classBPublic = Data(bp).base64EncodedString()
        var kb = Keybag(
            storePath: storePath, file: file, counterKey: format >= 2 ? try KeybagMACs.counterKey(deviceKey) : nil)
        kb.sealer = sealer
        try kb.save()
        try sealer?.keepOnly(salt: file.kdfSalt)
        try certificate?.write(storePath: storePath)
        try withKeys([UnlockedClassKeys(classA: a, classBSecret: bs, classBPublic: bp, classC: c)])
        return kb
    }

    /// What `authenticate` found.
    public enum CounterCheck: Equatable, Sendable { case authentic, upgraded, tampered }

    /// Binds the keybag to the device key (daemon start). Format 4: the settings MAC must
    /// verify, or the keybag was edited offline and is refused. Older keybags are upgraded in
    /// place to format 4 (device-only slots rewrapped under the v4 tag, settings MAC written):
    /// a format-1 keybag at once (it has no MAC to check), formats 2 and 3 after their cipher
    /// and counter MACs are checked. A missing or wrong counter MAC means the counter was
    /// edited offline: it is set to the longest lockout from now and saved, so editing it can
    /// only ever cost the editor time.
    public mutating func authenticate(
        deviceKey: SecureKey, now: Double = Date().timeIntervalSince1970
    ) throws -> CounterCheck {
        let key = try KeybagMACs.counterKey(deviceKey)
        counterKey = key
        if file.format == 1 {
            try upgradeToSettingsFormat(deviceKey: deviceKey)
            return .upgraded
        }
        if file.format >= Keybag.settingsFormat, try !KeybagMACs.settingsAreAuthentic(file, key: key) {
            throw KeybagError.corrupt(
                "keybag \(relativePath) was edited offline: its settings MAC does not match (a setting such as the "
                    + "format, the KDF cost or salt, the key set or the device was changed); nothing was changed. Put "
                    + "back the keybag from a backup, or run `keybagfs recover` with the recovery key")
        }
        switch try KeybagMACs.cipherIsAuthentic(file, key: key) {
        case false?:
            throw KeybagError.corrupt(
                "keybag field cipher (\(file.cipher.prefix(40))) was edited offline: its MAC does not match; set it "
                    + "again with `keybagfs cipher`"
            )
        case nil:
            // Every keybag written since devices and key sets has the MAC: one without it is stripped.
            guard currentKeySet == 0, file.format < Keybag.keySetsFormat, file.deviceID == nil || pendingDeviceID
            else {
                throw KeybagError.corrupt("keybag field cipherMAC was removed offline (the keybag was edited)")
            }
            file.cipherMAC = try KeybagMACs.cipherMAC(file, key: key)  // keybags written before the MAC
            if file.format >= Keybag.settingsFormat { try saveWithoutCounter() }
        case true?:
            if pendingDeviceID && file.format >= Keybag.settingsFormat { try saveWithoutCounter() }
        }
        pendingDeviceID = false
        var check = CounterCheck.tampered
        if KeybagMACs.storedMAC(file.counterMAC, matches: try KeybagMACs.counterMAC(file, key: key)) == true {
            check = .authentic
        } else {
            file.failedAttempts = max(file.failedAttempts, 9)
            file.lockoutUntil = now + UnlockThrottle.delay(afterFailures: file.failedAttempts)
        }
        if file.format < Keybag.settingsFormat {
            try upgradeToSettingsFormat(deviceKey: deviceKey)  // saves the counter as checked above
            return check == .authentic ? .upgraded : .tampered
        }
        if check == .tampered { try save() }
        return check
    }

    /// Rewraps the device-only slots (`D` of every key set, `volume`) under the format-4
    /// associated data, sets format 4 and saves (settings, cipher and counter MACs written).
    private mutating func upgradeToSettingsFormat(deviceKey: SecureKey) throws {
        let dwk = try KeybagMACs.deviceWrapKey(deviceKey)
        defer { dwk.wipe() }
        var next = file
        next.format = Keybag.settingsFormat
        for slot in ["volume"] + (0...currentKeySet).map({ Keybag.slot("D", $0) }) {
            let k = try unwrapDeviceKeySlot(slot, deviceKey: deviceKey)
            defer { k.wipe() }
            next.wrapped[slot] = Data(
                try KeyWrap.wrap(k, with: dwk, ad: KeybagMACs.ad(file.storeID, slot, format: next.format))
            )
            .base64EncodedString()
        }
        file = next
        try save()
    }

    /// Names the cipher of new files, with its MAC under the device key, and saves; the
    /// failed-attempt counter and its MAC stay as stored.
    public mutating func setCipherOfNewFiles(_ cipher: ContentCipher, deviceKey: SecureKey) throws {
        let key = try KeybagMACs.counterKey(deviceKey)
        defer { key.wipe() }
        file.cipher = cipher.name
        file.cipherMAC = try KeybagMACs.cipherMAC(file, key: key)
        try saveWithoutCounter()
    }

    /// Writes the keybag atomically: temp file, fsync, rename, fsync of the folder.
    public func save() throws { try save(recomputingCounterMAC: true) }

    /// Writes the keybag keeping the stored counter MAC: only for changes outside what it
    /// covers (the recovery counter), when the device key is not at hand.
    func saveWithoutCounter() throws { try save(recomputingCounterMAC: false) }

    private func save(recomputingCounterMAC: Bool) throws {
        var file = self.file
        // With a TPM each save is one generation past the TPM's counter, which then steps:
        // an older copy of the keybag is then below the counter.
        let counting = file.tpm2 == true && file.format >= Keybag.settingsFormat && counterKey != nil
        if counting, let sealer, let counted = try sealer.generation() { file.generation = counted + 1 }
        if file.format >= 2 && recomputingCounterMAC {
            guard let counterKey else {
                throw KeybagError.invalid("keybag not bound to its device key; cannot authenticate the counter")
            }
            file.counterMAC = try KeybagMACs.counterMAC(file, key: counterKey)
            file.cipherMAC = try KeybagMACs.cipherMAC(file, key: counterKey)
        }
        // The settings MAC is written whenever the device key is at hand (saves without it
        // change only what it does not cover: the recovery counters).
        if file.format >= Keybag.settingsFormat, let counterKey {
            file.settingsMAC = try KeybagMACs.settingsMAC(file, key: counterKey)
        }
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        try AtomicFile.write(try enc.encode(file), to: path)
        if counting, let sealer { try sealer.advanceGeneration() }
    }

}
