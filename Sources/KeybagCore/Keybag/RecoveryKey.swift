import CSodium
import Foundation

/// A recovery key: 32 random bytes that unwrap the keybag's escrow slots (every class key,
/// the class D key and the volume key) without the passcode and without the device key.
/// Written for people as `KBR1-` and eleven groups of five base32 characters: the 32 bytes
/// and a 2-byte check, so a mistyped character is caught before it counts as an attempt.
public struct RecoveryKey: Sendable {
    /// The 32 secret bytes.
    public let secret: SecureKey
    /// Length of the written form, dashes and prefix included.
    public static let textLength = 5 + 11 * 5 + 10
    static let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567".utf8)

    /// A new random recovery key.
    public static func generate() -> RecoveryKey { RecoveryKey(secret: SecureKey(random: 32)) }

    /// The 2-byte check of `key`: BLAKE2b-128 of a label keyed by the key, first two bytes.
    static func check(_ key: UnsafeRawBufferPointer) -> (UInt8, UInt8) {
        var h = [UInt8](repeating: 0, count: 16)
        // Keyed by R itself, so R is never copied into an ordinary buffer.
        let label = Array("keybagfs-recovery-check-v1".utf8)
        crypto_generichash(
            &h, 16, label, UInt64(label.count), key.baseAddress!.assumingMemoryBound(to: UInt8.self), key.count)
        return (h[0], h[1])
    }

    /// The written form, in guarded memory (`KBR1-XXXXX-…`, no newline).
    public func text() throws -> SecureKey {
        try secret.withBytes { k in
            let raw = SecureKey(count: 34) { out in
                out.copyMemory(from: k)
                let c = Self.check(k)
                out[32] = c.0
                out[33] = c.1
            }
            defer { raw.wipe() }
            return try raw.withBytes { r in
                SecureKey(count: Self.textLength) { out in
                    for (i, ch) in "KBR1".utf8.enumerated() { out[i] = ch }
                    var pos = 4
                    for i in 0..<55 {
                        if i % 5 == 0 { out[pos] = UInt8(ascii: "-"); pos += 1 }
                        // Character i holds bits 5i ..< 5i+5 of the 272-bit value (the last is padded with zeros).
                        var v = 0
                        for bit in 0..<5 {
                            let n = i * 5 + bit
                            let b = n < 272 ? (Int(r[n / 8]) >> (7 - n % 8)) & 1 : 0
                            v = v << 1 | b
                        }
                        out[pos] = Self.alphabet[v]
                        pos += 1
                    }
                }
            }
        }
    }

    /// Parses the written form (case, spaces and dashes do not matter). A wrong length,
    /// character or check is an `invalid` error: a typo, not a guess.
    public static func parse(_ text: SecureKey) throws -> RecoveryKey {
        let bits = SecureKey(zeroed: 40)
        defer { bits.wipe() }
        var count = 0
        var prefixOK = false
        try text.withBytes { t in
            try bits.withBytes { bb in
                let out = UnsafeMutableRawBufferPointer(mutating: bb)
                var chars = 0
                var i = 0
                // Skip the `KBR1` prefix (required).
                var letters: [UInt8] = []
                while i < t.count && letters.count < 4 {
                    let c = t[i] | 0x20
                    if t[i] != UInt8(ascii: " ") && t[i] != UInt8(ascii: "-") && t[i] != UInt8(ascii: "\t") {
                        letters.append(c)
                    }
                    i += 1
                }
                prefixOK = letters == Array("kbr1".utf8)
                while i < t.count {
                    let c = t[i]
                    i += 1
                    if c == UInt8(ascii: " ") || c == UInt8(ascii: "-") || c == UInt8(ascii: "\t") { continue }
                    let up = (c >= 0x61 && c <= 0x7A) ? c - 0x20 : c
                    guard let v = alphabet.firstIndex(of: up) else {
                        throw KeybagError.invalid("not a recovery key: it uses only the letters A-Z and the digits 2-7")
                    }
                    guard chars < 55 else { throw KeybagError.invalid("not a recovery key: too long") }
                    for bit in 0..<5 {
                        let n = chars * 5 + bit
                        guard (v >> (4 - bit)) & 1 == 1 else { continue }
                        // The last character's low three bits are padding and written as zeros.
                        guard n < 272 else {
                            throw KeybagError.invalid("not a recovery key: its last character is mistyped")
                        }
                        out[n / 8] |= UInt8(0x80 >> (n % 8))
                    }
                    chars += 1
                }
                count = chars
            }
        }
        guard prefixOK else { throw KeybagError.invalid("not a recovery key: it starts with KBR1-") }
        guard count == 55 else { throw KeybagError.invalid("not a recovery key: \(count) of 55 characters") }
        let key = try bits.withBytes { b -> SecureKey in
            let k = UnsafeRawBufferPointer(rebasing: b[0..<32])
            let c = check(k)
            guard c.0 == b[32], c.1 == b[33] else {
                throw KeybagError.invalid("not a recovery key: its check does not match (a character is mistyped)")
            }
            return SecureKey(count: 32) { $0.copyMemory(from: k) }
        }
        return RecoveryKey(secret: key)
    }

    /// The key that wraps the escrow slots of store `storeID`.
    func wrapKey(storeID: String) throws -> SecureKey {
        try secret.withBytes { k in
            KeyWrap.keyedHash(key: k, parts: [Array("keybagfs-recovery-kek-v1".utf8), Array(storeID.utf8)])
        }
    }

    /// Zeroes the secret.
    public func wipe() { secret.wipe() }
}

extension Keybag {
    /// Whether the store has a recovery key.
    public var hasRecoveryKey: Bool { file.wrapped["rA"] != nil }

    /// Seconds until the next recovery attempt is allowed.
    public func recoveryRetryAfter(now: Double) -> Double {
        max(0, min((file.recoveryLockoutUntil ?? 0) - now, UnlockThrottle.delay(afterFailures: Int.max)))
    }

    /// The store keys escrowed under `recovery`, from this keybag or from `escrowFrom` when
    /// that one holds a newer key set; a wrong recovery key is counted (and saved) here.
    mutating func escrowedKeysForRecovery(_ recovery: RecoveryKey, escrowFrom: Keybag?, now: Double) throws
        -> StoreKeys
    {
        let source = escrowFrom.flatMap { $0.currentKeySet > currentKeySet ? $0 : nil } ?? self
        // The sets both hold must be the same sets (a removal raced by another, or a rolled-back
        // keybag, can make two different set N): taking the source's would lose this device's.
        for n in 1...max(1, currentKeySet) where n <= min(currentKeySet, source.currentKeySet) {
            guard file.classBPublics?[String(n)] == source.file.classBPublics?[String(n)] else {
                throw KeybagError.corrupt(
                    "key set \(n) of this device differs from the one in \(source.relativePath): two devices made "
                        + "different sets of one number; nothing was changed")
            }
        }
        do { return try RecoveryEscrow.keys(in: source.file, recovery: recovery) } catch KeybagError.badRecoveryKey {
            var failed = file
            failed.recoveryFailedAttempts = (failed.recoveryFailedAttempts ?? 0) + 1
            let d = UnlockThrottle.delay(afterFailures: failed.recoveryFailedAttempts!)
            failed.recoveryLockoutUntil = d > 0 ? now + d : 0
            file = failed
            if counterKey != nil { try save() } else { try saveWithoutCounter() }
            throw KeybagError.badRecoveryKey
        }
    }

    /// With the current device key the escrowed D and volume keys must be the ones it opens.
    private func checkEscrowMatchesDeviceSlots(_ keys: StoreKeys, deviceKey: SecureKey) throws {
        for (slot, escrowed) in [("D", keys.classD[0]), ("volume", keys.volume)] {
            guard let current = try? unwrapDeviceKeySlot(slot, deviceKey: deviceKey) else { continue }
            defer { current.wipe() }
            let same = try current.withBytes { a in
                try escrowed.withBytes { b in sodium_memcmp(a.baseAddress!, b.baseAddress!, 32) == 0 }
            }
            guard same else {
                throw KeybagError.corrupt(
                    "the recovery slots do not match this keybag (damaged or replaced); nothing was changed")
            }
        }
    }

    /// Sets a new passcode and binds the store to `deviceKey` (the old one, or a new one
    /// when it was lost), from the recovery key. The class keys stay, so no file changes.
    /// A wrong key is counted and throttled like a passcode. The escrow slots are read from
    /// `escrowFrom` when given (the keybag with the newest key set: a device that missed a
    /// removal takes up the new set this way).
    public mutating func recover(
        with recovery: RecoveryKey, newPasscode: SecureKey, deviceKey: SecureKey,
        escrowFrom: Keybag? = nil, now: Double = Date().timeIntervalSince1970,
        withKeys: (StoreKeys) throws -> Void = { _ in }
    ) throws {
        guard hasRecoveryKey else {
            throw KeybagError.invalid(
                "this store has no recovery key (it was made before recovery keys, or with --no-recovery-key)")
        }
        let wait = recoveryRetryAfter(now: now)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        let keys = try escrowedKeysForRecovery(recovery, escrowFrom: escrowFrom, now: now)
        defer { keys.wipe() }
        try checkEscrowMatchesDeviceSlots(keys, deviceKey: deviceKey)
        var next = file
        let id = try DeviceIdentity.id(deviceKey: deviceKey, storeID: file.storeID)
        guard relativePath == Keybag.fileName || id == file.deviceID else {
            throw KeybagError.invalid(
                "a device added with `keybagfs device add` cannot take a new device key: add it again instead")
        }
        let previousID = file.deviceID
        next.deviceID = id
        next.kdfSalt = Data(Sodium.randomArray(Int(crypto_pwhash_SALTBYTES))).base64EncodedString()
        // Never weaker than `interactive`, whatever the keybag says.
        next.kdfOpsLimit = max(next.kdfOpsLimit, KDFStrength.interactive.opsLimit)
        next.kdfMemLimit = max(next.kdfMemLimit, KDFStrength.interactive.memLimit)
        next.format = max(next.format, Keybag.currentFormat)
        next.tpm2 = sealer != nil ? true : nil  // re-enrolled on this machine's TPM, or off it
        next.generation = nil
        try Keybag.wrapAll(keys, into: &next, passcode: newPasscode, deviceKey: deviceKey, sealer: sealer)
        // Every set escrowed under the recovery key itself from now on (sealed slots too).
        try RecoveryEscrow.write(&next, keys: keys.escrowEntries(), recovery: recovery)
        // New identity keys, certified by the store's key (made here for a store without one).
        let certify = try Keybag.certifySeed(storePath: storePath, recovery: recovery, preferring: escrowFrom ?? self)
        defer { certify.wipe() }
        let certificate = try Keybag.makeIdentity(
            &next, keys: keys, storePath: storePath, deviceKey: deviceKey, certifySeed: certify, recovery: recovery,
            now: now)
        next.failedAttempts = 0
        next.lockoutUntil = 0
        next.recoveryFailedAttempts = nil
        next.recoveryLockoutUntil = nil
        counterKey = try KeybagMACs.counterKey(deviceKey)
        file = next
        try save()
        try sealer?.keepOnly(salt: next.kdfSalt)
        try certificate.write(storePath: storePath)
        if let old = previousID, old != id {  // the old device key's identity goes with it
            unlink(storePath + "/" + StoreDevices.dirName + "/" + DeviceCertificate.fileName(old))
        }
        try KeySetFloor.record(self, deviceID: id)
        try withKeys(keys)
    }

    /// Replaces the recovery key (a first one for a store made without); the old one stops
    /// working. Needs the passcode and the device key; a wrong passcode counts as a failure.
    /// `deliver` hands the new key to the user (a file, the terminal) before anything is
    /// saved: if it throws, the keybag and the old key stay as they were. Every key set is
    /// escrowed for the new key.
    public mutating func rotateRecoveryKey(
        passcode: SecureKey, deviceKey: SecureKey, current: RecoveryKey? = nil,
        now: Double = Date().timeIntervalSince1970, deliver: (RecoveryKey) throws -> Void = { _ in }
    ) throws -> RecoveryKey {
        // A wrong device key must fail here, not read as an edited counter below.
        try unwrapDeviceKeySlot("D", deviceKey: deviceKey).wipe()
        let keys = try openAllCounted(passcode: passcode, deviceKey: deviceKey, now: now)
        defer { keys.wipe() }
        if let trust = try rememberCertified(deviceKey: deviceKey) {
            return try rotateForAll(
                keys, trust: trust, current: current, passcode: passcode, deviceKey: deviceKey, now: now,
                deliver: deliver)
        }
        let recovery = RecoveryKey.generate()
        var next = file
        try RecoveryEscrow.write(&next, keys: keys.escrowEntries(), recovery: recovery)
        next.failedAttempts = 0
        next.lockoutUntil = 0
        next.recoveryFailedAttempts = nil
        next.recoveryLockoutUntil = nil
        do { try deliver(recovery) } catch { recovery.wipe(); throw error }
        file = next
        try save()
        return recovery
    }
}
