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
        var pub: KeySetRecord.DeviceKeys {
            KeySetRecord.DeviceKeys(
                box: Data(try! keys.boxPublic()).base64EncodedString(),
                sign: Data(try! keys.signPublic()).base64EncodedString())
        }
    }

    func dev(_ n: Int) -> Dev { Dev(id: String(format: "%032x", n), keys: DeviceIdentityKeys.generate()) }

    /// The certificate of `d` for `keySet`, signed by `signer` (store key or approver seed).
    func cert(_ d: Dev, keySet: Int, by: String, signer: SecureKey) throws -> (String, Data) {
        let c = try DeviceCertificate.issue(
            storeID: storeID, deviceID: d.id, keys: d.keys, name: nil, keySet: keySet, by: by, signer: signer)
        return (DeviceCertificate.fileName(d.id), try JSONEncoder().encode(c))
    }

    /// The record of set `n` made by `maker` for `members`, signed by `signer` (default the maker).
    func record(
        _ n: Int, maker: Dev, members: [Dev], removed: [String] = [], certify: SecureKey? = nil,
        signer: SecureKey? = nil
    ) throws -> (String, Data) {
        var r = KeySetRecord(
            storeID: storeID, keySet: n, madeBy: maker.id, madeAt: 1, removed: removed,
            members: Dictionary(uniqueKeysWithValues: members.map { ($0.id, $0.pub) }),
            classBPublic: Data(repeating: 1, count: 32).base64EncodedString(), grants: [:], escrow: [:], signature: "")
        if let certify { r.certify = Data(try Ed25519.publicKey(seed: certify)).base64EncodedString() }
        try r.sign(with: signer ?? maker.keys.signSeed)
        if let certify { r.certifySignature = Data(try Ed25519.sign(r.message, seed: certify)).base64EncodedString() }
        return (KeySetRecord.fileName(n), try JSONEncoder().encode(r))
    }

    func judge(_ files: [(String, Data)], root: SecureKey, holding: Int = 0) throws -> DeviceTrust {
        DeviceTrust.evaluate(
            files: Dictionary(files, uniquingKeysWith: { $1 }), storeID: storeID,
            root: try Ed25519.publicKey(seed: root), holding: holding)
    }

    func testStoreCertifiedDevicesHoldAndAForgedCertificateIsNamed() throws {
        let root = SecureKey(random: 32), other = SecureKey(random: 32)
        let (a, b, x) = (dev(1), dev(2), dev(3))
        let t = try judge(
            [
                try cert(a, keySet: 0, by: "store", signer: root), try cert(b, keySet: 0, by: "store", signer: root),
                try cert(x, keySet: 0, by: "store", signer: other),
            ], root: root)
        XCTAssertEqual(Set(t.trusted.keys), [a.id, b.id])
        XCTAssertEqual(t.refused.count, 1)
        XCTAssertTrue(t.refused[0].hasPrefix(DeviceCertificate.fileName(x.id)), "\(t.refused)")
    }

    func testARecordHoldsOnlyWhenItsMakerWasTrustedAndSignedIt() throws {
        let root = SecureKey(random: 32)
        let (a, b, c, x) = (dev(1), dev(2), dev(3), dev(4))
        let certs = try [a, b, c].map { try cert($0, keySet: 0, by: "store", signer: root) }
        let good = try judge(certs + [try record(1, maker: a, members: [a, c], removed: [b.id])], root: root)
        XCTAssertEqual(good.newestSet, 1)
        XCTAssertEqual(good.removed, [b.id])
        XCTAssertEqual(Set(good.trusted.keys), [a.id, c.id])
        // Signed by a device nobody certified; by the device it removes; claimed by A, signed by B.
        for bad in [
            try record(1, maker: x, members: [x]), try record(1, maker: b, members: [a, b], removed: [b.id]),
            try record(1, maker: a, members: [a, b], removed: [c.id], signer: b.keys.signSeed),
        ] {
            let t = try judge(certs + [bad], root: root)
            XCTAssertEqual(t.newestSet, 0)
            XCTAssertEqual(Set(t.trusted.keys), [a.id, b.id, c.id])
            XCTAssertTrue(t.refused.contains { $0.hasPrefix("keyset-1.json") }, "\(t.refused)")
        }
    }

    /// A removed device keeps its signing key: an approval it backdates to a set before its
    /// removal counts only through the next record's list (which never names its puppet), and
    /// one dated after its removal has no trusted signer.
    func testARemovedDevicesApprovalsDoNotHold() throws {
        let root = SecureKey(random: 32)
        let (a, r, c, p) = (dev(1), dev(2), dev(3), dev(4))
        let base = try [a, r, c].map { try cert($0, keySet: 0, by: "store", signer: root) }
        let removal = try record(1, maker: a, members: [a, c], removed: [r.id])
        for dated in [0, 1] {
            let t = try judge(
                base + [removal, try cert(p, keySet: dated, by: r.id, signer: r.keys.signSeed)], root: root)
            XCTAssertNil(t.trusted[p.id], "backdated to \(dated)")
            XCTAssertNil(t.trusted[r.id])
        }
        // Before the removal, the same approval held: the rule is about sets, not signers.
        let before = try judge(base + [try cert(p, keySet: 0, by: r.id, signer: r.keys.signSeed)], root: root)
        XCTAssertNotNil(before.trusted[p.id])
    }

    func testApprovalsChainWithinASet() throws {
        let root = SecureKey(random: 32)
        let (a, n1, n2) = (dev(1), dev(2), dev(3))
        let t = try judge(
            [
                try cert(a, keySet: 0, by: "store", signer: root),
                try cert(n1, keySet: 0, by: a.id, signer: a.keys.signSeed),
                try cert(n2, keySet: 0, by: n1.id, signer: n1.keys.signSeed),
            ], root: root)
        XCTAssertEqual(Set(t.trusted.keys), [a.id, n1.id, n2.id])
    }

    /// A rotation replaces the certification key: the old one certifies nothing from then on,
    /// and a device whose root is the new key starts from the rotation's list.
    func testARotationRetiresTheOldCertificationKey() throws {
        let k0 = SecureKey(random: 32), k1 = SecureKey(random: 32)
        let (a, b, p, d) = (dev(1), dev(2), dev(3), dev(4))
        var files = [
            try cert(a, keySet: 0, by: "store", signer: k0), try cert(b, keySet: 0, by: "store", signer: k0),
            try record(1, maker: a, members: [a, b], certify: k1),
        ]
        files.append(try cert(p, keySet: 1, by: "store", signer: k0))  // the old key, after the rotation
        files.append(try cert(d, keySet: 1, by: "store", signer: k1))  // the new key
        for root in [k0, k1] {
            let t = try judge(files, root: root)
            XCTAssertEqual(Set(t.trusted.keys), [a.id, b.id, d.id], "from the root of set \(root === k0 ? 0 : 1)")
            XCTAssertEqual(t.newestSet, 1)
        }
        // A rotation record whose new key did not sign it does not hold.
        var unsigned = try record(1, maker: a, members: [a, b], certify: k1)
        var r = try JSONDecoder().decode(KeySetRecord.self, from: unsigned.1)
        r.certifySignature = nil
        unsigned.1 = try JSONEncoder().encode(r)
        XCTAssertEqual(try judge(files.dropLast(3) + [unsigned], root: k0).newestSet, 0)
    }

    /// Removal records: a signed one holds and tells of the set; an unsigned one (from before
    /// identities, or forged) is named when it claims a set above the device's; a deleted one
    /// hides nothing the set's record says.
    func testRemovalRecords() throws {
        let root = SecureKey(random: 32)
        let (a, b, c) = (dev(1), dev(2), dev(3))
        let certs = try [a, b, c].map { try cert($0, keySet: 0, by: "store", signer: root) }
        var signed = DeviceRemoval(deviceID: b.id, removedAt: 5, keySet: 1, by: a.id)
        signed.signature = Data(try Ed25519.sign(signed.message, seed: a.keys.signSeed)).base64EncodedString()
        let t = try judge(certs + [("\(b.id).removed", try JSONEncoder().encode(signed))], root: root)
        XCTAssertEqual(t.removed, [b.id])
        XCTAssertEqual(t.newestSet, 1, "a device learns of set 1 from the removal alone")
        let unsigned = DeviceRemoval(deviceID: c.id, removedAt: 5, keySet: 3)
        let u = try judge(certs + [("\(c.id).removed", try JSONEncoder().encode(unsigned))], root: root, holding: 1)
        XCTAssertEqual(u.removed, [])
        XCTAssertEqual(u.newestSet, 0)
        XCTAssertTrue(u.refused.contains { $0.hasPrefix("\(c.id).removed") }, "\(u.refused)")
        let old = try judge(certs + [("\(c.id).removed", try JSONEncoder().encode(unsigned))], root: root, holding: 3)
        XCTAssertEqual(old.refused, [], "not named when this device holds that set anyway")
        let deleted = try judge(certs + [try record(1, maker: a, members: [a, c], removed: [b.id])], root: root)
        XCTAssertEqual(deleted.removed, [b.id])
    }

    /// Garbage in the devices folder is named and changes nothing.
    func testGarbageIsNamed() throws {
        let root = SecureKey(random: 32)
        let a = dev(1)
        let t = try judge(
            [
                try cert(a, keySet: 0, by: "store", signer: root), ("keyset-1.json", Data("{".utf8)),
                ("\(dev(2).id).identity", Data([0, 1, 2])), ("x.removed", Data("[]".utf8)),
            ], root: root)
        XCTAssertEqual(Set(t.trusted.keys), [a.id])
        XCTAssertEqual(t.refused.count, 3, "\(t.refused)")
    }
}
