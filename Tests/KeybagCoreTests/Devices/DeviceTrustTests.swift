import Foundation
import XCTest

@testable import KeybagCore

/// `DeviceTrust` on devices folders built with real keys and signatures: what holds, what is
/// refused, and the attacks its rules are there for (backdating, an old certification key,
/// a removed device's approvals, records signed by the wrong device).
final class DeviceTrustTests: XCTestCase {
    let storeID = String(repeating: "ab", count: 16)

    /// A device: its id and identity keys.
    struct Dev {
        let id: String
        let keys: DeviceIdentityKeys
        var pub: DevicePublicKeys {
            DevicePublicKeys(
                box: Data(try! keys.boxPublic()).base64EncodedString(),
                sign: Data(try! keys.signPublic()).base64EncodedString())
        }
    }

    func dev(_ n: Int) -> Dev { Dev(id: String(format: "%032x", n), keys: DeviceIdentityKeys.generate()) }

    /// The certificate of `d` for `keySet`, signed by `signer` (store key or approver seed).
    func cert(_ d: Dev, keySet: Int, by: String, signer: SecureKey) throws -> (String, Data) {
        var c = try DeviceCertificate.issue(
            storeID: storeID, deviceID: d.id, keys: d.keys, name: nil, keySet: keySet, by: by, signer: signer)
        if by != DeviceCertificate.byStore {  // an approved device signs its certificate too
            c.selfSignature = Data(try Ed25519.sign(c.message, seed: d.keys.signSeed)).base64EncodedString()
        }
        return (DeviceCertificate.fileName(d.id), try JSONEncoder().encode(c))
    }

    /// The certification key the records `record` makes are signed with (the set before's).
    var certifiedBy: SecureKey?

    /// The record of set `n` made by `maker` for `members`, signed by `signer` (default the
    /// maker) and (`byRoot`) by `certifiedBy`, its keys MAC under `classA` when given.
    func record(
        _ n: Int, maker: Dev, members: [Dev], removed: [String] = [], certify: SecureKey? = nil,
        signer: SecureKey? = nil,
        classB: String = Data(repeating: 1, count: 32).base64EncodedString(), classA: SecureKey? = nil,
        byRoot: Bool = true
    ) throws -> (String, Data) {
        var r = KeySetRecord(
            storeID: storeID, keySet: n, madeBy: maker.id, madeAt: 1, removed: removed,
            members: Dictionary(uniqueKeysWithValues: members.map { ($0.id, $0.pub) }),
            classBPublic: classB, grants: [:], escrow: [:], signature: "")
        if let certify { r.certify = Data(try Ed25519.publicKey(seed: certify)).base64EncodedString() }
        if let classA { r.keysMAC = try r.keysMAC(classA: classA) }
        try r.sign(with: signer ?? maker.keys.signSeed)
        if byRoot, let root = certifiedBy {
            r.rootSignature = Data(try Ed25519.sign(r.message, seed: root)).base64EncodedString()
        }
        if let certify { r.certifySignature = Data(try Ed25519.sign(r.message, seed: certify)).base64EncodedString() }
        return (r.fileName, try JSONEncoder().encode(r))
    }

    /// What a device holding set `keySet` remembers: `trusted`, `removed`, under `root`.
    func snapshot(_ keySet: Int, root: SecureKey, trusted: [Dev], removed: [String] = [], classB: [Int: String] = [:])
        throws -> TrustSnapshot
    {
        TrustSnapshot(
            keySet: keySet, root: try Ed25519.publicKey(seed: root),
            trusted: Dictionary(uniqueKeysWithValues: trusted.map { ($0.id, $0.pub) }), removed: Set(removed),
            classBPublics: classB)
    }

    func judge(_ files: [(String, Data)], _ snap: TrustSnapshot) -> DeviceTrust {
        DeviceTrust.evaluate(files: Dictionary(files, uniquingKeysWith: { $1 }), storeID: storeID, snapshot: snap)
    }

    func testStoreCertifiedDevicesHoldAndAForgedCertificateIsNamed() throws {
        let root = SecureKey(random: 32), other = SecureKey(random: 32)
        certifiedBy = root
        let (a, b, x) = (dev(1), dev(2), dev(3))
        let t = judge(
            [
                try cert(a, keySet: 0, by: "store", signer: root), try cert(b, keySet: 0, by: "store", signer: root),
                try cert(x, keySet: 0, by: "store", signer: other),
            ], try snapshot(0, root: root, trusted: [a]))
        XCTAssertEqual(Set(t.trusted.keys), [a.id, b.id])
        XCTAssertEqual(t.refused.count, 1)
        XCTAssertTrue(t.refused[0].hasPrefix(DeviceCertificate.fileName(x.id)), "\(t.refused)")
    }

    func testARecordHoldsOnlyWhenItsMakerWasTrustedAndSignedIt() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let (a, b, c, x) = (dev(1), dev(2), dev(3), dev(4))
        let snap = try snapshot(0, root: root, trusted: [a, b, c])
        let good = judge([try record(1, maker: a, members: [a, c], removed: [b.id])], snap)
        XCTAssertEqual(good.newestSet, 1)
        XCTAssertEqual(good.removed, [b.id])
        XCTAssertEqual(Set(good.trusted.keys), [a.id, c.id])
        // Signed by a device nobody trusts; by the device it removes; claimed by A, signed by B.
        for bad in [
            try record(1, maker: x, members: [x]), try record(1, maker: b, members: [a, b], removed: [b.id]),
            try record(1, maker: a, members: [a, b], removed: [c.id], signer: b.keys.signSeed),
            try record(1, maker: a, members: [a, c], removed: [b.id], byRoot: false),
        ] {
            let t = judge([bad], snap)
            XCTAssertEqual(t.newestSet, 0)
            XCTAssertEqual(Set(t.trusted.keys), [a.id, b.id, c.id])
            XCTAssertTrue(t.refused.contains { $0.hasPrefix("keyset-1.") }, "\(t.refused)")
        }
    }

    /// A removed device keeps its signing key: an approval it backdates to a set before its
    /// removal counts only through the next record's list (which never names its puppet), and
    /// one dated after its removal has no trusted signer.
    func testARemovedDevicesApprovalsDoNotHold() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let (a, r, c, p) = (dev(1), dev(2), dev(3), dev(4))
        let snap = try snapshot(0, root: root, trusted: [a, r, c])
        let removal = try record(1, maker: a, members: [a, c], removed: [r.id])
        for dated in [0, 1] {
            let t = judge([removal, try cert(p, keySet: dated, by: r.id, signer: r.keys.signSeed)], snap)
            XCTAssertNil(t.trusted[p.id], "backdated to \(dated)")
            XCTAssertNil(t.trusted[r.id])
        }
        // Before the removal, the same approval held: the rule is about sets, not signers.
        XCTAssertNotNil(judge([try cert(p, keySet: 0, by: r.id, signer: r.keys.signSeed)], snap).trusted[p.id])
    }

    /// The removed device makes a record of the set that removes it, one of its own (it was
    /// trusted at the set before): without the certification key (the recovery key's) it holds
    /// nothing, even where the real record is kept away; two records both signed by it (two
    /// holders of the recovery key at once) are a fork, and neither is taken up.
    func testARecordNeedsTheCertificationKeyAndTwoOfOneSetAreAFork() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let (a, r, c) = (dev(1), dev(2), dev(3))
        let snap = try snapshot(0, root: root, trusted: [a, r, c])
        let forged = try record(1, maker: r, members: [r, c], byRoot: false)
        let alone = judge([forged], snap)
        XCTAssertEqual(alone.newestSet, 0)
        XCTAssertNotNil(alone.trusted[a.id])
        XCTAssertTrue(alone.refused.contains { $0.hasPrefix("keyset-1.\(r.id)") }, "\(alone.refused)")
        let real = try record(1, maker: a, members: [a, c], removed: [r.id])
        XCTAssertEqual(Set(judge([real, forged], snap).trusted.keys), [a.id, c.id], "the real one holds")
        let fork = judge([real, try record(1, maker: r, members: [r, c])], snap)
        XCTAssertEqual(fork.records.count, 0)
        XCTAssertEqual(fork.newestSet, 1, "a newer set exists: the device stops wrapping for the older one")
        XCTAssertEqual(fork.refused.filter { $0.contains("two devices made it") }.count, 2, "\(fork.refused)")
    }

    /// What a device took up stays: deleting the record that removed a device, or the removal
    /// record, gives the removed device nothing back; a record of a set it holds with other
    /// keys conflicts; a removal record on its own removes nobody.
    func testMemoryOutlivesDeletedAndForgedRecords() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let (a, r, c, p) = (dev(1), dev(2), dev(3), dev(4))
        let held = try snapshot(
            1, root: root, trusted: [a, c], removed: [r.id],
            classB: [1: Data(repeating: 5, count: 32).base64EncodedString()])
        let t = judge(
            [
                try cert(r, keySet: 0, by: "store", signer: root),
                try cert(p, keySet: 0, by: r.id, signer: r.keys.signSeed),
                try record(1, maker: r, members: [r, c], signer: r.keys.signSeed),
            ], held)
        XCTAssertEqual(Set(t.trusted.keys), [a.id, c.id])
        XCTAssertTrue(t.refused.contains { $0.hasPrefix("keyset-1.") && $0.contains("conflicts") }, "\(t.refused)")
        XCTAssertTrue(t.refused.contains { $0.hasPrefix(DeviceCertificate.fileName(p.id)) }, "\(t.refused)")
        // A removal of C signed by A while A was trusted: it tells of set 2, removes nobody.
        var rem = DeviceRemoval(deviceID: c.id, removedAt: 5, keySet: 2, by: a.id)
        rem.signature = Data(try Ed25519.sign(rem.message, seed: a.keys.signSeed)).base64EncodedString()
        let u = judge([("\(c.id).removed", try JSONEncoder().encode(rem))], held)
        XCTAssertEqual(u.newestSet, 2)
        XCTAssertEqual(u.removed, [r.id])
        XCTAssertNotNil(u.trusted[c.id])
    }

    /// A trusted device certifies its own keys under another device's id: refused where this
    /// device already knows that id's keys, and where the device's own keybag names other keys.
    func testACertificateNeverGivesAKnownIdOtherKeys() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let (a, t, h) = (dev(1), dev(2), dev(3))
        let thief = Dev(id: a.id, keys: DeviceIdentityKeys.generate())  // the thief's keys, A's id
        let squat = try cert(thief, keySet: 0, by: t.id, signer: t.keys.signSeed)
        let known = judge([squat], try snapshot(0, root: root, trusted: [a, t]))
        XCTAssertEqual(known.trusted[a.id], a.pub)
        XCTAssertTrue(
            known.refused.contains { $0.contains("other keys than the device this device knows") }, "\(known.refused)")
        // H, certified since the last set (not remembered yet): its keybag names its real keys.
        let hThief = Dev(id: h.id, keys: DeviceIdentityKeys.generate())
        let t2 = DeviceTrust.evaluate(
            files: Dictionary(uniqueKeysWithValues: [try cert(hThief, keySet: 0, by: t.id, signer: t.keys.signSeed)]),
            storeID: storeID, snapshot: try snapshot(0, root: root, trusted: [a, t]), keybags: [h.id: h.pub])
        XCTAssertNil(t2.trusted[h.id])
        XCTAssertTrue(t2.refused.contains { $0.contains("keybag names") }, "\(t2.refused)")
    }

    /// A trusted device cannot claim to have approved another device (with that device's own
    /// keys): without the approved device's own signature the claim holds nothing.
    func testAnApprovalNeedsTheApprovedDevicesOwnSignature() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let (a, t, h) = (dev(1), dev(2), dev(3))
        var claim = try DeviceCertificate.issue(
            storeID: storeID, deviceID: h.id, keys: h.keys, name: nil, keySet: 0, by: t.id, signer: t.keys.signSeed)
        let forged = judge(
            [(DeviceCertificate.fileName(h.id), try JSONEncoder().encode(claim))],
            try snapshot(0, root: root, trusted: [a, t]))
        XCTAssertNil(forged.trusted[h.id])
        XCTAssertNil(forged.approvedBy[h.id])
        claim.selfSignature = Data(try Ed25519.sign(claim.message, seed: h.keys.signSeed)).base64EncodedString()
        let real = judge(
            [(DeviceCertificate.fileName(h.id), try JSONEncoder().encode(claim))],
            try snapshot(0, root: root, trusted: [a, t]))
        XCTAssertEqual(real.approvedBy[h.id], t.id)
    }

    func testApprovalsChainWithinASet() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let (a, n1, n2) = (dev(1), dev(2), dev(3))
        let t = judge(
            [
                try cert(n1, keySet: 0, by: a.id, signer: a.keys.signSeed),
                try cert(n2, keySet: 0, by: n1.id, signer: n1.keys.signSeed),
            ], try snapshot(0, root: root, trusted: [a]))
        XCTAssertEqual(Set(t.trusted.keys), [a.id, n1.id, n2.id])
    }

    /// A rotation replaces the certification key: the old one certifies nothing from then on,
    /// for a device that saw the rotation and one certified after it alike.
    func testARotationRetiresTheOldCertificationKey() throws {
        let k0 = SecureKey(random: 32), k1 = SecureKey(random: 32)
        certifiedBy = k0
        let (a, b, p, d) = (dev(1), dev(2), dev(3), dev(4))
        let files = [
            try record(1, maker: a, members: [a, b], certify: k1),
            try cert(p, keySet: 1, by: "store", signer: k0),  // the old key, after the rotation
            try cert(d, keySet: 1, by: "store", signer: k1),  // the new key
        ]
        for snap in [try snapshot(0, root: k0, trusted: [a, b]), try snapshot(1, root: k1, trusted: [a, b])] {
            let t = judge(files, snap)
            XCTAssertEqual(Set(t.trusted.keys), [a.id, b.id, d.id], "from set \(snap.keySet)")
            XCTAssertEqual(t.root, try Ed25519.publicKey(seed: k1))
        }
        // A rotation record whose new key did not sign it does not hold.
        var unsigned = try record(1, maker: a, members: [a, b], certify: k1)
        var r = try JSONDecoder().decode(KeySetRecord.self, from: unsigned.1)
        r.certifySignature = nil
        unsigned.1 = try JSONEncoder().encode(r)
        XCTAssertEqual(judge([unsigned], try snapshot(0, root: k0, trusted: [a, b])).newestSet, 0)
    }

    /// A device given the store's keys by the recovery key starts from the record of the
    /// newest set only when that record carries the MAC of that set's keys.
    func testBootstrapTakesOnlyARecordMadeWithTheSetsKeys() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let (a, c, r) = (dev(1), dev(2), dev(3))
        func set(_ n: UInt8) throws -> UnlockedClassKeys {
            let b = SecureKey(random: 32)
            return UnlockedClassKeys(
                classA: SecureKey(random: 32), classBSecret: b, classBPublic: try ClassBAgreement.publicKey(of: b),
                classC: SecureKey(random: 32), keySet: n)
        }
        let keys = StoreKeys(
            sets: [try set(0), try set(1)], classD: [SecureKey(random: 32), SecureKey(random: 32)],
            volume: SecureKey(random: 32))
        defer { keys.wipe() }
        let pk1 = Data(keys.sets[1].classBPublic).base64EncodedString()
        let dir = NSTemporaryDirectory() + "kbfs-trust-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        try FileManager.default.createDirectory(atPath: dir + "/devices", withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: dir) }
        func put(_ f: (String, Data)) throws { try f.1.write(to: URL(fileURLWithPath: dir + "/devices/" + f.0)) }
        // A record of set 1 with the right class B key but no keys MAC (anyone can copy a public key).
        try put(try record(1, maker: r, members: [r], classB: pk1))
        var snap = DeviceTrust.bootstrap(
            storePath: dir, storeID: storeID, root: try Ed25519.publicKey(seed: root), keys: keys)
        XCTAssertEqual(snap.trusted, [:])
        try FileManager.default.removeItem(atPath: dir + "/devices/" + KeySetRecord.fileName(1, maker: r.id))
        // A device that holds set 1 (it can make the MAC) but not the certification key: nothing.
        try put(try record(1, maker: r, members: [r], classB: pk1, classA: keys.sets[1].classA, byRoot: false))
        snap = DeviceTrust.bootstrap(
            storePath: dir, storeID: storeID, root: try Ed25519.publicKey(seed: root), keys: keys)
        XCTAssertEqual(snap.trusted, [:])
        try FileManager.default.removeItem(atPath: dir + "/devices/" + KeySetRecord.fileName(1, maker: r.id))
        try put(try record(1, maker: a, members: [a, c], removed: [r.id], classB: pk1, classA: keys.sets[1].classA))
        snap = DeviceTrust.bootstrap(
            storePath: dir, storeID: storeID, root: try Ed25519.publicKey(seed: root), keys: keys)
        XCTAssertEqual(Set(snap.trusted.keys), [a.id, c.id])
        XCTAssertEqual(snap.removed, [r.id])
    }

    /// Garbage in the devices folder is named and changes nothing; a name with control
    /// characters is shown without them.
    func testGarbageIsNamed() throws {
        let root = SecureKey(random: 32)
        certifiedBy = root
        let a = dev(1)
        let t = judge(
            [
                ("keyset-1.\(a.id).json", Data("{".utf8)), ("\(dev(2).id).identity", Data([0, 1, 2])),
                ("x\ny.removed", Data("[]".utf8)),
            ], try snapshot(0, root: root, trusted: [a]))
        XCTAssertEqual(Set(t.trusted.keys), [a.id])
        XCTAssertEqual(t.refused.count, 3, "\(t.refused)")
        XCTAssertFalse(t.refused.contains { $0.contains("\n") })
    }
}
