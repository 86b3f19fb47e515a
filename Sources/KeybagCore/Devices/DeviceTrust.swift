import Foundation

/// Which devices, key-set records and removal records of a store hold, as one device judges
/// them from the store certification key in its own keybag (its root). Rules (docs/FORMAT.md,
/// "Device identities"):
/// - the root starts at set 0, or at the set whose record names it as the new certification
///   key and carries its signature (a rotation): then the devices that record lists are where
///   trust starts;
/// - at each set, the devices trusted are those of the set before (or, where the set has a
///   record that holds, those its record lists), minus the removed, plus every certificate
///   naming that set signed by the certification key of that set or by a device trusted at it
///   (an approval); a certificate naming an earlier set than the one judged counts only
///   through the lists, so a device cannot be backdated into a set whose maker never knew it;
/// - the record of set k holds when its maker was trusted at set k − 1, signed it, is among
///   those it lists and not among those it removes, and (a rotation) its new certification
///   key signed it too;
/// - a signed removal record of set k holds when its signer was trusted at set k − 1.
/// Everything else is refused, and named.
public struct DeviceTrust: Sendable {
    /// The devices trusted at the newest set, with their keys.
    public let trusted: [String: KeySetRecord.DeviceKeys]
    /// Key-set records that hold, by set.
    public let records: [Int: KeySetRecord]
    /// Devices removed by records that hold.
    public let removed: Set<String>
    /// Files of the devices folder refused, each with why.
    public let refused: [String]
    /// The newest set a key-set or removal record that holds names (0: none).
    public let newestSet: Int

    /// Judges the devices folder of the store at `storePath` (see `evaluate(files:...)`).
    public static func evaluate(storePath: String, storeID: String, root: [UInt8], holding: Int) -> DeviceTrust {
        var files: [String: Data] = [:]
        for name in StoreDevices.entries(storePath)
        where name.hasSuffix(".identity") || name.hasSuffix(".removed") || KeySetRecord.keySet(ofFileName: name) != nil
        {
            let path = storePath + "/" + StoreDevices.dirName + "/" + name
            var st = stat()
            // Records are small: anything larger, or not a plain file, is not one of ours.
            guard lstat(path, &st) == 0, st.st_mode & S_IFMT == S_IFREG, st.st_size < 1 << 20 else {
                files[name] = Data()
                continue
            }
            files[name] = FileManager.default.contents(atPath: path) ?? Data()
        }
        return evaluate(files: files, storeID: storeID, root: root, holding: holding)
    }

    /// Judges `files` (name in the devices folder → contents) for store `storeID` from the
    /// certification key `root`; `holding` is the newest set the judging device holds (an
    /// unsigned removal record, from before identities, is named only when it claims a set above it).
    public static func evaluate(files: [String: Data], storeID: String, root: [UInt8], holding: Int) -> DeviceTrust {
        var refused: [String] = []
        let (certs, recs, rems) = parse(files, storeID: storeID, refused: &refused)
        let rootB64 = Data(root).base64EncodedString()
        // Where the root starts: set 0, or the rotation record that names it and that it signed.
        let start = recs.values.filter { $0.certify == rootB64 && $0.isSignedByItsCertifyKey }.map(\.keySet).min() ?? 0
        let top = max(
            holding, recs.keys.max() ?? 0, certs.values.map(\.keySet).max() ?? 0, rems.values.map(\.keySet).max() ?? 0,
            start)
        var trusted: [String: KeySetRecord.DeviceKeys] = start > 0 ? recs[start]!.members : [:]
        var verified: [Int: KeySetRecord] = start > 0 ? [start: recs[start]!] : [:]
        var removed = Set<String>(start > 0 ? recs[start]!.removed : [])
        var certifyKey = root
        var everTrusted = Set(trusted.keys)
        var newest = start
        for k in start...min(top, Keybag.maxKeySet) {
            if k > start {
                let before = trusted
                if let r = recs[k] {
                    if let maker = before[r.madeBy], r.isSigned(by: maker.signKey), r.members[r.madeBy] != nil,
                        !r.removed.contains(r.madeBy), r.certify == nil || r.isSignedByItsCertifyKey
                    {
                        verified[k] = r
                        newest = max(newest, k)
                        removed.formUnion(r.removed)
                        trusted = r.members
                        if let key = r.certifyKey { certifyKey = key }
                    } else {
                        refused.append(
                            "\(KeySetRecord.fileName(k)): not signed by a device this device trusts (forged or damaged)"
                        )
                    }
                }
                for (name, rem) in rems.sorted(by: { $0.key < $1.key }) where rem.keySet == k {
                    if let by = rem.by, let signer = before[by], rem.isSigned(by: signer.signKey) {
                        removed.insert(rem.deviceID)
                        newest = max(newest, k)
                    } else if rem.signature != nil || k > holding {
                        refused.append("\(name): not signed by a device this device trusts (forged or damaged)")
                    }
                }
            }
            trusted = trusted.filter { !removed.contains($0.key) }
            addCertified(at: k, certs: certs, to: &trusted, removed: removed, certifyKey: certifyKey)
            everTrusted.formUnion(trusted.keys)
        }
        for id in certs.keys.sorted()
        where !removed.contains(id) && !everTrusted.contains(id) && certs[id]!.keySet >= start {
            refused.append(
                "\(DeviceCertificate.fileName(id)): not certified by the store's key or by a device this device trusts")
        }
        return DeviceTrust(
            trusted: trusted, records: verified, removed: removed, refused: refused.sorted(), newestSet: newest)
    }

    /// Adds to `trusted` every certificate naming set `k` signed by that set's certification
    /// key or by a device trusted at it, until no more hold (approvals may chain).
    private static func addCertified(
        at k: Int, certs: [String: DeviceCertificate], to trusted: inout [String: KeySetRecord.DeviceKeys],
        removed: Set<String>, certifyKey: [UInt8]
    ) {
        var changed = true
        while changed {
            changed = false
            for (id, c) in certs where trusted[id] == nil && c.keySet == k && !removed.contains(id) && c.by != id {
                let signer = c.by == DeviceCertificate.byStore ? certifyKey : trusted[c.by]?.signKey
                if let signer, c.isSigned(by: signer) {
                    trusted[id] = KeySetRecord.DeviceKeys(box: c.box, sign: c.sign)
                    changed = true
                }
            }
        }
    }

    /// Decodes the certificates, key-set records and removal records of `files`; what does not
    /// decode or names another store or file is refused.
    private static func parse(_ files: [String: Data], storeID: String, refused: inout [String]) -> (
        [String: DeviceCertificate], [Int: KeySetRecord], [String: DeviceRemoval]
    ) {
        var certs: [String: DeviceCertificate] = [:]
        var recs: [Int: KeySetRecord] = [:]
        var rems: [String: DeviceRemoval] = [:]
        let dec = JSONDecoder()
        for (name, data) in files.sorted(by: { $0.key < $1.key }) {
            if name.hasSuffix(".identity") {
                if let c = try? dec.decode(DeviceCertificate.self, from: data), c.storeID == storeID,
                    DeviceCertificate.fileName(c.deviceID) == name, DeviceIdentity.isWellFormed(c.deviceID),
                    c.boxKey.count == 32, c.signKey.count == 32, (0...Keybag.maxKeySet).contains(c.keySet)
                {
                    certs[c.deviceID] = c
                } else {
                    refused.append("\(name): not a device certificate of this store")
                }
            } else if let n = KeySetRecord.keySet(ofFileName: name) {
                if let r = try? dec.decode(KeySetRecord.self, from: data), r.storeID == storeID, r.keySet == n,
                    r.members.values.allSatisfy({ $0.boxKey.count == 32 && $0.signKey.count == 32 })
                {
                    recs[n] = r
                } else {
                    refused.append("\(name): not a key-set record of this store")
                }
            } else if name.hasSuffix(".removed") {
                if let r = try? dec.decode(DeviceRemoval.self, from: data), "\(r.deviceID).removed" == name {
                    rems[name] = r
                } else {
                    refused.append("\(name): not a removal record")
                }
            }
        }
        return (certs, recs, rems)
    }
}
