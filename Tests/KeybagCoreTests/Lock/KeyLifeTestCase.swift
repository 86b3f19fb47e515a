import XCTest

@testable import KeybagCore

/// Keyrings and file key lives as the daemon has them, without FUSE (a base class: no tests).
class KeyLifeTestCase: XCTestCase {
    let cipher = ContentCipher.default

    /// A keyring after one unlock.
    func unlockedKeyring() throws -> ClassKeyring {
        let ring = ClassKeyring(classD: SecureKey(random: 32))
        ring.install(try freshUnlock())
        return ring
    }

    /// Class keys as an unlock delivers them (the same keys every time, as the keybag does).
    private var stored: (a: SecureKey, b: SecureKey, c: SecureKey)?
    func freshUnlock() throws -> UnlockedClassKeys {
        if stored == nil { stored = (SecureKey(random: 32), SecureKey(random: 32), SecureKey(random: 32)) }
        let s = stored!
        func copy(_ k: SecureKey) throws -> SecureKey {
            try k.withBytes { b in SecureKey(count: 32) { $0.copyMemory(from: b) } }
        }
        let b = try copy(s.b)
        return UnlockedClassKeys(
            classA: try copy(s.a), classBSecret: b, classBPublic: try ClassBAgreement.publicKey(of: b),
            classC: try copy(s.c))
    }

    /// A file of `cls` as the daemon knows it right after loading its header.
    func file(_ cls: ProtectionClass, _ ring: ClassKeyring) throws -> FileKeyLife {
        let (wrap, _, _) = try XCTUnwrap(ring.wrappingKey(for: cls))
        let h = try FileHeader.create(fileKey: SecureKey(random: 32), class: cls, cipher: cipher, using: wrap)
        var life = FileKeyLife()
        _ = try life.header { h }
        return life
    }

    func assertUnavailable(_ body: @autoclosure () throws -> Any, _ msg: String, line: UInt = #line) {
        XCTAssertThrowsError(try body(), msg, line: line) {
            XCTAssertEqual($0 as? KeybagError, .keyUnavailable, msg, line: line)
        }
    }
}

extension ClassKeyring {
    /// Both steps of a lock at once, with no file to visit (the race of a create).
    func evictForLock() {
        beginEviction()
        finishEviction()
    }
}
