import Foundation

/// The escrow slots of a keybag file (`r` + slot name): every key of the store wrapped for
/// the recovery key, which alone opens them (no passcode, no device key).
public enum RecoveryEscrow {
    /// Keys kept in escrow, each in slot `r` + name.
    static let slots = ["A", "B", "C", "D", "volume"]

    /// Associated data of an escrow slot.
    static func ad(_ storeID: String, _ slot: String) -> [UInt8] {
        Array("keybagfs-escrow-v1|\(storeID)|\(slot)".utf8)
    }

    /// Wraps `keys` (slot name → key) for the recovery key into `f`.
    static func write(_ f: inout KeybagFile, keys: [(String, SecureKey)], recovery: RecoveryKey) throws {
        let rwk = try recovery.wrapKey(storeID: f.storeID)
        defer { rwk.wipe() }
        for (slot, key) in keys {
            f.wrapped["r" + slot] = Data(try KeyWrap.wrap(key, with: rwk, ad: ad(f.storeID, slot)))
                .base64EncodedString()
        }
    }

    /// Opens escrow slot `slot` with the recovery key's wrap key; `corrupt` when it does not
    /// open (a wrong key, or a slot damaged, swapped or planted).
    static func open(_ slot: String, in file: KeybagFile, rwk: SecureKey) throws -> SecureKey {
        try KeyWrap.unwrap(try file.blob("r" + slot), with: rwk, ad: ad(file.storeID, slot))
    }

    /// Every key of the store from the escrow slots of `file`; `badRecoveryKey` when the key is wrong,
    /// `corrupt` when the slots do not match this keybag (planted, swapped or damaged).
    public static func keys(in file: KeybagFile, recovery: RecoveryKey) throws -> StoreKeys {
        let rwk = try recovery.wrapKey(storeID: file.storeID)
        defer { rwk.wipe() }
        var taken: [String: SecureKey] = [:]
        defer { taken.values.forEach { $0.wipe() } }
        do {
            taken["volume"] = try open("volume", in: file, rwk: rwk)
        } catch KeybagError.corrupt { throw KeybagError.badRecoveryKey }
        for n in 0...(file.keySet ?? 0) {
            for base in ["A", "B", "C", "D"] {
                let slot = Keybag.slot(base, n)
                guard file.wrapped["r" + slot] != nil else {
                    throw KeybagError.corrupt(
                        "the recovery key does not cover key set \(n) (made before it); nothing was changed")
                }
                taken[slot] = try open(slot, in: file, rwk: rwk)
            }
        }
        // Escrow slots planted or swapped: each escrowed class B key must be the one whose
        // public key the keybag names. (Damage, not a guess: not counted.)
        var sets: [UnlockedClassKeys] = [], classD: [SecureKey] = []
        for n in 0...(file.keySet ?? 0) {
            let pk = try ClassBAgreement.publicKey(of: taken[Keybag.slot("B", n)]!)
            let named = n == 0 ? file.classBPublic : file.classBPublics?[String(n)] ?? ""
            guard Data(base64Encoded: named).map([UInt8].init) == pk else {
                throw KeybagError.corrupt(
                    "the recovery slots do not match this keybag (damaged or replaced); nothing was changed")
            }
            sets.append(
                UnlockedClassKeys(
                    classA: taken.removeValue(forKey: Keybag.slot("A", n))!,
                    classBSecret: taken.removeValue(forKey: Keybag.slot("B", n))!, classBPublic: pk,
                    classC: taken.removeValue(forKey: Keybag.slot("C", n))!, keySet: UInt8(n)))
            classD.append(taken.removeValue(forKey: Keybag.slot("D", n))!)
        }
        return StoreKeys(sets: sets, classD: classD, volume: taken.removeValue(forKey: "volume")!)
    }

    /// Whether `escrow` holds every escrow slot of sets 0…`sets`, and the volume key, each a wrapped key.
    static func isComplete(_ escrow: [String: String], sets: Int) -> Bool {
        var want = ["rvolume"]
        for n in 0...sets { want += ["A", "B", "C", "D"].map { "r" + Keybag.slot($0, n) } }
        return want.allSatisfy { escrow[$0].flatMap { Data(base64Encoded: $0) }?.count == 32 + KeyWrap.overhead }
    }
}
