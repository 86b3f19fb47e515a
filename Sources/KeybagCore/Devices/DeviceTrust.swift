import Foundation

/// What a device starts its judgement of the store's records from: its own keybag's memory,
/// under that keybag's settings MAC (docs/FORMAT.md, "Device identities").
public struct TrustSnapshot: Sendable, Equatable {
    /// The newest key set the device holds.
    public var keySet: Int
    /// The store certification key at that set.
    public var root: [UInt8]
    /// The devices it trusts at that set, with their keys.
    public var trusted: [String: DevicePublicKeys]
    /// The devices it knows were removed.
    public var removed: Set<String>
    /// The class B public key (base64) of each set it holds, to spot a record that conflicts.
    public var classBPublics: [Int: String]
    /// Who approved whom, as the record it started from says (bootstrap only).
    public var approvals: [String: String] = [:]
}

/// Which devices, key-set records and removal records of a store hold, as one device judges
/// them forward from its `TrustSnapshot`. Rules (docs/FORMAT.md, "Device identities"):
/// - at the set the device holds, it trusts the devices its snapshot lists, plus every
///   certificate naming that set signed by that set's certification key or by a device it
///   trusts at that set (approvals may chain);
/// - the record of the next set holds when exactly one record of that set is signed by a
///   device trusted at the set before and by the certification key of the set before, lists
///   its maker, does not remove it, and (a rotation) its new certification key signed it too; two such records are a fork, refused; then the
///   devices trusted are exactly those the record lists, minus every device removed so far;
/// - a record of a set the device holds that names another class B key conflicts, and is
///   refused; a removal record removes nobody (only key-set records do), but a signed one
///   from a trusted device tells of a newer set;
/// - a removal record signed by a trusted device tells of the next set (no further);
/// - everything else is refused, and named.
public struct DeviceTrust: Sendable {
    /// The devices trusted at the newest set, with their keys.
    public let trusted: [String: DevicePublicKeys]
    /// Key-set records that hold, newer than the snapshot's set, by set.
    public let records: [Int: KeySetRecord]
    /// Devices removed (the snapshot's and those of the records that hold).
    public let removed: Set<String>
    /// Files of the devices folder refused, each with why.
    public let refused: [String]
    /// The newest set a record that holds makes, or a removal record from a trusted device
    /// names (at least the snapshot's).
    public let newestSet: Int
    /// The certification key at the newest set that holds.
    public let root: [UInt8]
    /// Who approved each device trusted by its certificate here (device id → approver id, or
    /// "store"); devices known from a record or the snapshot are not in it.
    public var approvedBy: [String: String] = [:]

    /// The files of the devices folder of the store at `storePath` that trust reads
    /// (anything larger than a record, or not a plain file, reads as empty).
    static func files(storePath: String) -> [String: Data] {
        var files: [String: Data] = [:]
        for name in StoreDevices.entries(storePath)
        where name.hasSuffix(".identity") || name.hasSuffix(".removed") || KeySetRecord.parse(fileName: name) != nil {
            let path = storePath + "/" + StoreDevices.dirName + "/" + name
            files[name] = (try? StoreFileOpen.contents(path)) ?? Data()
        }
        return files
    }

    /// Records of sets the device holds that name another class B key than it holds.
    private static func conflicts(_ recs: [KeySetRecord], _ s: TrustSnapshot) -> [String] {
        recs.filter { r in r.keySet <= s.keySet && s.classBPublics[r.keySet].map { $0 != r.classBPublic } ?? false }
            .map { "\($0.fileName): conflicts with key set \($0.keySet) this device holds" }
    }

    /// The identity keys each keybag of the store at `storePath` names, by device id (a
    /// certificate must name the same: `addCertified`).
    static func keybagIdentities(storePath: String) -> [String: DevicePublicKeys] {
        struct Names: Decodable { var deviceID: String?, identityBox: String?, identitySign: String? }
        var out: [String: DevicePublicKeys] = [:]
        // Only `devices/ID.keybag` naming ID, and the first device's (which names its own id).
        let paths =
            StoreDevices.entries(storePath).filter { $0.hasSuffix(".keybag") }.map {
                (StoreDevices.dirName + "/" + $0, String($0.dropLast(7)) as String?)
            } + [(Keybag.fileName, nil)]
        for (rel, named) in paths {
            guard let d = try? StoreFileOpen.contents(storePath + "/" + rel),
                let n = try? JSONDecoder().decode(Names.self, from: d), let id = n.deviceID,
                named == nil || named == id,
                out[id] == nil, let box = n.identityBox, let sign = n.identitySign
            else { continue }
            out[id] = DevicePublicKeys(box: box, sign: sign)
        }
        return out
    }

    /// Judges the devices folder of the store at `storePath` from `snapshot`.
    public static func evaluate(storePath: String, storeID: String, snapshot: TrustSnapshot) -> DeviceTrust {
        evaluate(
            files: files(storePath: storePath), storeID: storeID, snapshot: snapshot,
            keybags: keybagIdentities(storePath: storePath))
    }

    /// Judges `files` (name in the devices folder → contents) of store `storeID` from `snapshot`;
    /// `keybags`: the identity keys the store's keybags name, by device id.
    public static func evaluate(
        files: [String: Data], storeID: String, snapshot s: TrustSnapshot, keybags: [String: DevicePublicKeys] = [:]
    ) -> DeviceTrust {
        var refused: [String] = []
        let (certs, recs, rems) = parse(files, storeID: storeID, refused: &refused)
        var removed = s.removed, root = s.root, newest = s.keySet
        var trusted = s.trusted.filter { !removed.contains($0.key) }
        var verified: [Int: KeySetRecord] = [:], approvedBy: [String: String] = [:]
        refused += conflicts(recs, s)
        addCertified(
            at: s.keySet, certs: certs, to: &trusted, removed: removed, certifyKey: root, keybags: keybags,
            refused: &refused, approvedBy: &approvedBy)
        var everTrusted = Set(trusted.keys)
        var k = s.keySet + 1
        while k <= Keybag.maxKeySet {
            let candidates = recs.filter { $0.keySet == k }
            if candidates.isEmpty { break }
            let holding = candidates.filter { r in
                guard let maker = trusted[r.madeBy] else { return false }
                return r.isSigned(by: maker.signKey) && r.isSigned(byRoot: root) && r.members[r.madeBy] != nil
                    && !r.removed.contains(r.madeBy) && (r.certify == nil || r.isSignedByItsCertifyKey)
            }
            for r in candidates where !holding.contains(r) {
                refused.append(
                    "\(r.fileName): not signed by a device this device trusts and by the store's certification key "
                        + "(forged or damaged)")
            }
            if holding.count > 1 {
                for r in holding {
                    refused.append(
                        "\(r.fileName): one of \(holding.count) records of key set \(k) (two devices made it at once): "
                            + "none is taken up; run `keybagfs recover` on a device that should hold it")
                }
                newest = k
                break
            }
            guard let r = holding.first else { break }
            verified[k] = r
            newest = k
            removed.formUnion(r.removed)
            trusted = r.members.filter { !removed.contains($0.key) }
            if let key = r.certifyKey { root = key }
            addCertified(
                at: k, certs: certs, to: &trusted, removed: removed, certifyKey: root, keybags: keybags,
                refused: &refused, approvedBy: &approvedBy)
            everTrusted.formUnion(trusted.keys)
            k += 1
        }
        newest = max(
            newest, removalSignal(rems, trusted: trusted, newest: newest, holding: s.keySet, refused: &refused))
        refused += untrusted(certs, ever: everTrusted.union(s.trusted.keys), removed: removed, holding: s.keySet)
        return DeviceTrust(
            trusted: trusted, records: verified, removed: removed, refused: Array(Set(refused)).sorted(),
            newestSet: newest, root: root, approvedBy: approvedBy.filter { trusted[$0.key] != nil })
    }

    /// What is said of the certificates of devices never trusted (and not removed).
    private static func untrusted(
        _ certs: [String: DeviceCertificate], ever: Set<String>, removed: Set<String>, holding: Int
    ) -> [String] {
        certs.sorted(by: { $0.key < $1.key }).filter { !removed.contains($0.key) && !ever.contains($0.key) }.map {
            (id, c) in
            c.keySet >= holding
                ? "\(DeviceCertificate.fileName(id)): not certified by the store's key or by a device this device trusts"
                : "\(DeviceCertificate.fileName(id)): certified at key set \(c.keySet), and no newer set lists it"
        }
    }

    /// The snapshot of a device that got the store's keys and the certification key `root`
    /// from the recovery key (`device add`, `recover`): the devices the record of the newest set
    /// lists, when exactly one record of that set is vouched for by `root`, its maker and the
    /// set's keys (`KeySetRecord.isVouched`); else none but those certified at that set. The
    /// root is always the escrow's, never a record's.
    public static func bootstrap(storePath: String, storeID: String, root: [UInt8], keys: StoreKeys) -> TrustSnapshot {
        var ignored: [String] = []
        let (_, recs, _) = parse(files(storePath: storePath), storeID: storeID, refused: &ignored)
        let n = keys.current
        let pk = Data(keys.sets[n].classBPublic).base64EncodedString()
        var classB: [Int: String] = [:]
        for (i, set) in keys.sets.enumerated() { classB[i] = Data(set.classBPublic).base64EncodedString() }
        let genuine = recs.filter {
            $0.keySet == n && $0.classBPublic == pk && $0.isVouched(byRoot: root, classA: keys.sets[n].classA)
        }
        guard n > 0, genuine.count == 1, let r = genuine.first else {
            return TrustSnapshot(keySet: n, root: root, trusted: [:], removed: [], classBPublics: classB)
        }
        let removed = Set(r.removed)
        return TrustSnapshot(
            keySet: n, root: root, trusted: r.members.filter { !removed.contains($0.key) }, removed: removed,
            classBPublics: classB, approvals: r.approvals ?? [:])
    }

    /// The newest set the removal records tell of: a signed one from a trusted device names the
    /// next set at most (its record is on the way); others claiming a set above `holding` are refused.
    private static func removalSignal(
        _ rems: [String: DeviceRemoval], trusted: [String: DevicePublicKeys], newest: Int, holding: Int,
        refused: inout [String]
    ) -> Int {
        var signal = newest
        for (name, rem) in rems.sorted(by: { $0.key < $1.key }) {
            if let by = rem.by, let signer = trusted[by], rem.isSigned(by: signer.signKey), rem.keySet <= newest + 1 {
                signal = max(signal, rem.keySet)
            } else if rem.keySet > holding {
                refused.append("\(shown(name)): not signed by a device this device trusts (forged or damaged)")
            }
        }
        return signal
    }

    /// The key-set records of the store at `storePath` (well formed, of store `storeID`).
    static func records(storePath: String, storeID: String) -> [KeySetRecord] {
        var ignored: [String] = []
        return parse(files(storePath: storePath), storeID: storeID, refused: &ignored).1
    }

    /// Adds to `trusted` every certificate naming set `k` signed by that set's certification
    /// key or by a device trusted at it, until no more hold (approvals may chain).
    /// A certificate never gives a device id other keys than those this device already knows
    /// for it, or than the device's own keybag names (a trusted device could otherwise certify
    /// its own keys under another device's id, and receive that device's key sets).
    private static func addCertified(
        at k: Int, certs: [String: DeviceCertificate], to trusted: inout [String: DevicePublicKeys],
        removed: Set<String>, certifyKey: [UInt8], keybags: [String: DevicePublicKeys], refused: inout [String],
        approvedBy: inout [String: String]
    ) {
        for (id, c) in certs.sorted(by: { $0.key < $1.key }) where !removed.contains(id) {
            let keys = DevicePublicKeys(box: c.box, sign: c.sign)
            if let known = trusted[id], known != keys {
                refused.append(
                    "\(DeviceCertificate.fileName(id)): other keys than the device this device knows by that id")
            } else if trusted[id] == nil, let own = keybags[id], own != keys {
                refused.append("\(DeviceCertificate.fileName(id)): other keys than the device's own keybag names")
            }
        }
        var changed = true
        while changed {
            changed = false
            for (id, c) in certs where trusted[id] == nil && c.keySet == k && !removed.contains(id) && c.by != id {
                let keys = DevicePublicKeys(box: c.box, sign: c.sign)
                if let own = keybags[id], own != keys { continue }
                let signer = c.by == DeviceCertificate.byStore ? certifyKey : trusted[c.by]?.signKey
                // An approval holds only with the approved device's own signature too.
                if let signer, c.isSigned(by: signer), c.by == DeviceCertificate.byStore || c.isSelfSigned {
                    trusted[id] = keys
                    approvedBy[id] = c.by
                    changed = true
                }
            }
        }
    }

    /// A file name as a message may show it: control characters as `?`, at most 100 characters
    /// (a store writer chooses names; a log line must stay one line).
    public static func shown(_ name: String) -> String {
        String(
            String.UnicodeScalarView(
                name.unicodeScalars.prefix(100).map { $0.value < 0x20 || (0x7f..<0xa0).contains($0.value) ? "?" : $0 }))
    }

    /// Decodes the certificates, key-set records and removal records of `files`; what does not
    /// decode, or names another store or file, is refused.
    private static func parse(_ files: [String: Data], storeID: String, refused: inout [String]) -> (
        [String: DeviceCertificate], [KeySetRecord], [String: DeviceRemoval]
    ) {
        var certs: [String: DeviceCertificate] = [:]
        var recs: [KeySetRecord] = []
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
                    refused.append("\(shown(name)): not a device certificate of this store")
                }
            } else if KeySetRecord.parse(fileName: name) != nil {
                if let r = try? dec.decode(KeySetRecord.self, from: data), r.storeID == storeID, r.fileName == name,
                    r.isWellFormed
                {
                    recs.append(r)
                } else {
                    refused.append("\(shown(name)): not a key-set record of this store")
                }
            } else if name.hasSuffix(".removed") {
                if let r = try? dec.decode(DeviceRemoval.self, from: data), "\(r.deviceID).removed" == name {
                    rems[name] = r
                } else {
                    refused.append("\(shown(name)): not a removal record")
                }
            }
        }
        return (certs, recs, rems)
    }
}
