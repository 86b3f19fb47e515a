import CSodium
import Foundation

/// The keybag's MACs (counter, cipher, settings), the associated data of its wrapped slots,
/// and the keys the device key derives for them: pure functions of a `KeybagFile`.
public enum KeybagMACs {
    /// Associated data of a wrapped slot. Format 2 wraps the device-only slots (`D`,
    /// `volume`) under a v2 tag, so a format-2 keybag edited to claim format 1 (to drop the
    /// counter MAC) no longer opens with the device key; format 4 under a v4 tag, so a keybag
    /// edited to claim an older format (to drop the settings MAC) no longer opens either.
    static func ad(_ storeID: String, _ slot: String, format: Int = 1) -> [UInt8] {
        let deviceOnly = slot == "volume" || slot == "D" || slot.hasPrefix("D.")
        let v = !deviceOnly ? "v1" : format >= Keybag.settingsFormat ? "v4" : format >= 2 ? "v2" : "v1"
        return Array("keybagfs-keybag-\(v)|\(storeID)|\(slot)".utf8)
    }

    /// What the settings MAC covers: every field of `f` but the wrapped slots, the cipher
    /// (cipher MAC), the failed-attempt counter and lockout (counter MAC), the recovery
    /// counters and the MACs themselves; each field by name, absent ones marked, lengths
    /// prefixed (little-endian UInt32), so no two keybags share a message.
    static func settingsMessage(_ f: KeybagFile) -> [UInt8] {
        var msg = Array("keybagfs-settings-v1|".utf8)
        func field(_ name: String, _ value: String?) {
            func put(_ bytes: [UInt8]) {
                withUnsafeBytes(of: UInt32(bytes.count).littleEndian) { msg += $0 }; msg += bytes
            }
            put(Array(name.utf8))
            if let value { msg.append(1); put(Array(value.utf8)) } else { msg.append(0) }
        }
        field("format", String(f.format))
        field("storeID", f.storeID)
        field("kdfOpsLimit", String(f.kdfOpsLimit))
        field("kdfMemLimit", String(f.kdfMemLimit))
        field("kdfSalt", f.kdfSalt)
        field("classBPublic", f.classBPublic)
        field("keySet", f.keySet.map { String($0) })
        field(
            "classBPublics",
            f.classBPublics.map { $0.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: ",") }
        )
        field("deviceID", f.deviceID)
        field("deviceName", f.deviceName)
        if f.tpm2 != nil || f.generation != nil {  // keybags without a TPM keep their message
            field("tpm2", f.tpm2.map { $0 ? "1" : "0" })
            field("generation", f.generation.map { String($0) })
        }
        if f.identityBox != nil || f.identitySign != nil || f.storeCertify != nil {  // likewise before identities
            field("identityBox", f.identityBox)
            field("identitySign", f.identitySign)
            field("storeCertify", f.storeCertify)
            field(
                "trustedDevices",
                f.trustedDevices.map { t in t.keys.sorted().map { "\($0)=\(t[$0]!.joined)" }.joined(separator: ",") })
            field("removedDevices", f.removedDevices.map { $0.sorted().joined(separator: ",") })
            if let a = f.approvals {  // keybags without approvals keep their message
                field("approvals", a.keys.sorted().map { "\($0)=\(a[$0]!)" }.joined(separator: ","))
            }
        }
        return msg
    }

    /// The settings MAC of `f` under the counter key.
    static func settingsMAC(_ f: KeybagFile, key: SecureKey) throws -> String {
        let msg = settingsMessage(f)
        return try mac(msg, key: key)
    }

    /// Whether the stored settings MAC of `f` verifies under `key` (false when absent).
    static func settingsAreAuthentic(_ f: KeybagFile, key: SecureKey) throws -> Bool {
        storedMAC(f.settingsMAC, matches: try settingsMAC(f, key: key)) ?? false
    }

    /// Whether the stored base64 MAC `stored` is `expected` (compared in constant time); nil
    /// when none is stored.
    static func storedMAC(_ stored: String?, matches expected: String) -> Bool? {
        guard let s = stored.flatMap({ Data(base64Encoded: $0) }).map([UInt8].init) else { return nil }
        let e = [UInt8](Data(base64Encoded: expected) ?? Data())
        return s.count == e.count && sodium_memcmp(s, e, e.count) == 0
    }

    /// crypto_kdf subkey `id` of the device key under the 8-byte `context`.
    private static func deviceSubkey(_ deviceKey: SecureKey, id: UInt64, context: String) throws -> SecureKey {
        try deviceKey.withBytes { dk in
            SecureKey(count: 32) { out in
                _ = context.withCString { ctx in
                    crypto_kdf_derive_from_key(
                        out.baseAddress!.assumingMemoryBound(to: UInt8.self), 32, id, ctx,
                        dk.baseAddress!.assumingMemoryBound(to: UInt8.self))
                }
            }
        }
    }

    /// The key for the counter MAC: crypto_kdf subkey 2 of the device key, context "kbfscnt1".
    public static func counterKey(_ deviceKey: SecureKey) throws -> SecureKey {
        try deviceSubkey(deviceKey, id: 2, context: "kbfscnt1")
    }

    /// Keyed BLAKE2b-256 of `msg` under `key`, base64 (the keybag's MACs).
    static func mac(_ msg: [UInt8], key: SecureKey) throws -> String {
        var mac = [UInt8](repeating: 0, count: 32)
        try key.withBytes { k in
            _ = crypto_generichash(
                &mac, 32, msg, UInt64(msg.count), k.baseAddress!.assumingMemoryBound(to: UInt8.self), k.count)
        }
        return Data(mac).base64EncodedString()
    }

    /// The MAC of the counter state of `f`.
    static func counterMAC(_ f: KeybagFile, key: SecureKey) throws -> String {
        var msg = Array("keybagfs-counter-v1|\(f.storeID)|".utf8)
        withUnsafeBytes(of: Int64(f.failedAttempts).littleEndian) { msg += $0 }
        withUnsafeBytes(of: f.lockoutUntil.bitPattern.littleEndian) { msg += $0 }
        return try mac(msg, key: key)
    }

    /// The MAC of the cipher name of `f`.
    /// Besides the cipher it covers the key set of new files once there is more than one
    /// (keybags without key sets keep the message they were written with).
    static func cipherMAC(_ f: KeybagFile, key: SecureKey) throws -> String {
        var text = "keybagfs-cipher-v1|\(f.storeID)|\(f.cipher)"
        if let set = f.keySet, set > 0 { text += "|set=\(set)" }
        let msg = Array(text.utf8)
        return try mac(msg, key: key)
    }

    /// Whether the stored cipher MAC of `f` verifies under `key`; nil when there is none.
    static func cipherIsAuthentic(_ f: KeybagFile, key: SecureKey) throws -> Bool? {
        storedMAC(f.cipherMAC, matches: try cipherMAC(f, key: key))
    }

    /// The key that wraps device-only keys: crypto_kdf subkey 1, context "kbfsdev1".
    public static func deviceWrapKey(_ deviceKey: SecureKey) throws -> SecureKey {
        try deviceSubkey(deviceKey, id: 1, context: "kbfsdev1")
    }

    /// Whether the stored failed-attempt counter of `file` authenticates (format 2), without
    /// changing anything (`fsck`); nil for format 1, which has no MAC yet.
    public static func counterIsAuthentic(_ file: KeybagFile, deviceKey: SecureKey) throws -> Bool? {
        guard file.format >= 2 else { return nil }
        let key = try counterKey(deviceKey)
        defer { key.wipe() }
        return storedMAC(file.counterMAC, matches: try counterMAC(file, key: key)) ?? false
    }

    /// Whether the stored cipher name of `file` authenticates under the device key (nil: no MAC yet).
    public static func cipherIsAuthentic(_ file: KeybagFile, deviceKey: SecureKey) throws -> Bool? {
        let key = try counterKey(deviceKey)
        defer { key.wipe() }
        return try cipherIsAuthentic(file, key: key)
    }
}
