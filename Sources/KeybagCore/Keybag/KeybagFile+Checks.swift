import CSodium
import Foundation

/// The checks a keybag file meets before anything reads it: each field a hostile keybag
/// could use against the daemon is a `corrupt` error naming the field, never a trap.
extension KeybagFile {
    /// Most Argon2id passes and memory a keybag may ask for (hostile values would stall or kill the daemon).
    public static let maxOpsLimit: UInt64 = 32
    public static let maxMemLimit: UInt64 = 4 << 30
    /// Most failures in a row a keybag may record.
    public static let maxFailedAttempts = 1_000_000

    /// Checks every field a hostile keybag could use against the daemon: each bad value is a
    /// `corrupt` error naming the field, never a trap. A lockout further away than the
    /// longest delay stays as stored (its MAC covers it); `Keybag.retryAfter` cuts the wait.
    func validate() throws {
        func bad(_ field: String, _ why: String) -> KeybagError { .corrupt("keybag field \(field): \(why)") }
        guard (1...Keybag.settingsFormat).contains(format) else {
            throw bad("format", "unknown format \(format) (written by a newer keybagfs?)")
        }
        guard storeID.utf8.count == 32,
            storeID.utf8.allSatisfy({ (0x30...0x39).contains($0) || (0x61...0x66).contains($0) })
        else {
            throw bad("storeID", "not 32 lowercase hex digits")
        }
        guard ContentCipher(name: cipher) != nil else {
            throw bad("cipher", "unknown cipher \(cipher.prefix(40)) (written by a newer keybagfs?)")
        }
        guard kdfOpsLimit >= UInt64(crypto_pwhash_opslimit_min()), kdfOpsLimit <= Self.maxOpsLimit else {
            throw bad("kdfOpsLimit", "out of range")
        }
        guard kdfMemLimit >= UInt64(crypto_pwhash_memlimit_min()), kdfMemLimit <= Self.maxMemLimit else {
            throw bad("kdfMemLimit", "out of range")
        }
        guard let salt = Data(base64Encoded: kdfSalt), salt.count == Int(crypto_pwhash_SALTBYTES) else {
            throw bad("kdfSalt", "not a salt")
        }
        for slot in ["A", "B", "C", "D", "volume"] {
            guard let w = wrapped[slot].flatMap({ Data(base64Encoded: $0) }), w.count == 32 + KeyWrap.overhead else {
                throw bad("wrapped.\(slot)", "missing or not a wrapped key")
            }
        }
        guard let pk = Data(base64Encoded: classBPublic), pk.count == 32 else {
            throw bad("classBPublic", "not a public key")
        }
        try validateKeySets()
        try validateIdentity()
        try validateCountersAndMACs()
        try validateEscrow()
    }

    /// Checks the slots of key sets 1 and up: each set's four class slots and class B public
    /// key present, escrow slots all present or all absent per set, and no slot of a set
    /// above `keySet` (lowering `keySet` means removing slots: a rolled-back keybag).
    private func validateKeySets() throws {
        func bad(_ field: String, _ why: String) -> KeybagError { .corrupt("keybag field \(field): \(why)") }
        let top = keySet ?? 0
        guard (0...Keybag.maxKeySet).contains(top) else { throw bad("keySet", "out of range") }
        if let id = deviceID, !DeviceIdentity.isWellFormed(id) { throw bad("deviceID", "not a device id") }
        guard top == 0 || format >= Keybag.keySetsFormat else {
            throw bad("keySet", "needs format \(Keybag.keySetsFormat)")
        }
        for name in wrapped.keys {
            guard let dot = name.lastIndex(of: ".") else { continue }
            guard let n = Int(name[name.index(after: dot)...]), n >= 1, n <= top else {
                throw bad("wrapped.\(name.prefix(40))", "a slot of no key set of this keybag")
            }
        }
        for n in (classBPublics ?? [:]).keys where Int(n).map({ $0 < 1 || $0 > top }) ?? true {
            throw bad("classBPublics.\(n.prefix(10))", "a public key of no key set of this keybag")
        }
        guard top > 0 else { return }
        for n in 1...top {
            for base in ["A", "B", "C", "D"] {
                let slot = Keybag.slot(base, n)
                guard let w = wrapped[slot].flatMap({ Data(base64Encoded: $0) }), w.count == 32 + KeyWrap.overhead
                else { throw bad("wrapped.\(slot)", "missing or not a wrapped key") }
            }
            guard let pk = classBPublics?[String(n)].flatMap({ Data(base64Encoded: $0) }), pk.count == 32 else {
                throw bad("classBPublics.\(n)", "not a public key")
            }
            let escrow = ["A", "B", "C", "D"].map {
                wrapped["r" + Keybag.slot($0, n)].flatMap { Data(base64Encoded: $0) }
            }
            guard escrow.allSatisfy({ $0 == nil }) || escrow.allSatisfy({ $0?.count == 32 + KeyWrap.overhead }) else {
                throw bad("wrapped.r*.\(n)", "some recovery slots of key set \(n) are missing or damaged")
            }
        }
    }

    /// Checks the identity fields: both public halves and both wrapped private halves, or
    /// none; a certification key and its escrow of the right sizes.
    private func validateIdentity() throws {
        func bad(_ field: String, _ why: String) -> KeybagError { .corrupt("keybag field \(field): \(why)") }
        func bytes(_ s: String?) -> Int? { s.flatMap { Data(base64Encoded: $0) }?.count }
        let parts = [
            identityBox, identitySign, wrapped[DeviceIdentityKeys.boxSlot],
            wrapped[DeviceIdentityKeys.signSlot],
        ]
        guard parts.allSatisfy({ $0 == nil }) || parts.allSatisfy({ $0 != nil }) else {
            throw bad("identity", "some of the device's identity keys are missing")
        }
        if identitySign != nil {
            guard bytes(identityBox) == 32 else { throw bad("identityBox", "not a public key") }
            guard bytes(identitySign) == 32 else { throw bad("identitySign", "not a public key") }
            for slot in [DeviceIdentityKeys.boxSlot, DeviceIdentityKeys.signSlot]
            where bytes(wrapped[slot]) != 32 + KeyWrap.overhead {
                throw bad("wrapped.\(slot)", "not a wrapped key")
            }
        }
        if identitySign != nil, trustedDevices == nil {
            throw bad("trustedDevices", "missing beside identity keys")
        }
        for (id, k) in trustedDevices ?? [:] where !DeviceIdentity.isWellFormed(id) || !k.isWellFormed {
            throw bad("trustedDevices", "not a device id and its keys: \(id.prefix(40))")
        }
        for id in removedDevices ?? [] where !DeviceIdentity.isWellFormed(id) && id != "first" {
            throw bad("removedDevices", "not a device id: \(id.prefix(40))")
        }
        for (id, by) in approvals ?? [:]
        where !DeviceIdentity.isWellFormed(id) || !(DeviceIdentity.isWellFormed(by) || by == DeviceCertificate.byStore)
        {
            throw bad("approvals", "not a device id and its approver: \(id.prefix(40))")
        }
        if storeCertify != nil, bytes(storeCertify) != 32 { throw bad("storeCertify", "not a public key") }
        if let w = wrapped["r" + DeviceIdentityKeys.certifySlot], bytes(w) != 32 + KeyWrap.overhead {
            throw bad("wrapped.r\(DeviceIdentityKeys.certifySlot)", "not a wrapped key")
        }
    }

    /// The failure counters, lockout times and MACs of a keybag file.
    private func validateCountersAndMACs() throws {
        func bad(_ field: String, _ why: String) -> KeybagError { .corrupt("keybag field \(field): \(why)") }
        guard failedAttempts >= 0, failedAttempts <= Self.maxFailedAttempts else {
            throw bad("failedAttempts", "out of range")
        }
        guard lockoutUntil.isFinite, lockoutUntil >= 0 else { throw bad("lockoutUntil", "not a time") }
        if let mac = counterMAC {
            guard let m = Data(base64Encoded: mac), m.count == 32 else { throw bad("counterMAC", "not a MAC") }
        }
        if let mac = cipherMAC {
            guard let m = Data(base64Encoded: mac), m.count == 32 else { throw bad("cipherMAC", "not a MAC") }
        }
        if format >= Keybag.settingsFormat {
            guard let m = settingsMAC.flatMap({ Data(base64Encoded: $0) }), m.count == 32 else {
                throw bad("settingsMAC", "missing or not a MAC (format \(format) keybags carry one)")
            }
        }
    }

    /// The recovery key's escrow slots and its failure counter.
    private func validateEscrow() throws {
        func bad(_ field: String, _ why: String) -> KeybagError { .corrupt("keybag field \(field): \(why)") }
        let escrow = RecoveryEscrow.slots.filter { wrapped["r" + $0] != nil }
        guard escrow.isEmpty || escrow.count == RecoveryEscrow.slots.count else {
            throw bad("wrapped.r*", "some recovery slots are missing")
        }
        for slot in escrow {
            guard let w = wrapped["r" + slot].flatMap({ Data(base64Encoded: $0) }), w.count == 32 + KeyWrap.overhead
            else { throw bad("wrapped.r\(slot)", "not a wrapped key") }
        }
        if let n = recoveryFailedAttempts {
            guard n >= 0, n <= Self.maxFailedAttempts else { throw bad("recoveryFailedAttempts", "out of range") }
        }
        if let t = recoveryLockoutUntil {
            guard t.isFinite, t >= 0 else { throw bad("recoveryLockoutUntil", "not a time") }
        }
    }
}
