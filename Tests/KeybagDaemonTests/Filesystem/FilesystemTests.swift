import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `Filesystem` on a store of its own, driven as the FUSE handlers drive it but without a
/// mount: the kernel notifier has no session, so page drops go nowhere.
final class FilesystemTests: XCTestCase {
    var dir = ""
    var fs: Filesystem!
    var keyring: ClassKeyring!
    var classKeys: (a: SecureKey, b: SecureKey, c: SecureKey)!
    let root = Caller(uid: 0, gid: 0)
    /// Page drops the filesystem asked the kernel for: (ids, pass).
    let pageDrops = Locked<[([UInt64], String)]>([])

    override func setUpWithError() throws {
        var t = Array("/tmp/kbfs-unit.XXXXXX".utf8CString)
        dir = String(cString: mkdtemp(&t)!)
        var fds: [Int32] = []
        for sub in ["data", "targets", "xattrs"] {
            XCTAssertEqual(mkdir(dir + "/" + sub, 0o700), 0)
            fds.append(open(dir + "/" + sub, O_RDONLY | O_DIRECTORY | O_CLOEXEC))
        }
        classKeys = (SecureKey(random: 32), SecureKey(random: 32), SecureKey(random: 32))
        keyring = ClassKeyring(classD: SecureKey(random: 32))
        try unlock()
        fs = try Filesystem(
            dataFD: fds[0], targetsFD: fds[1], xattrsFD: fds[2], names: NameCipher(volumeKey: SecureKey(random: 32)),
            keyring: keyring, cipher: .default, defaultClass: .completeUntilFirstUserAuthentication,
            kernel: KernelNotifier(
                negotiated: { MountNegotiation(directIOMappable: true, writeback: false) },
                observer: { [pageDrops] ids, pass in pageDrops.withLock { $0.append((ids, pass)) } }))
        _ = try fs.directories.meta(of: fs.table.root)
    }

    override func tearDown() { try? FileManager.default.removeItem(atPath: dir) }

    /// Installs the class keys, as an unlock does.
    func unlock() throws {
        func copy(_ k: SecureKey) throws -> SecureKey {
            try k.withBytes { b in SecureKey(count: 32) { $0.copyMemory(from: b) } }
        }
        let b = try copy(classKeys.b)
        keyring.install(
            UnlockedClassKeys(
                classA: try copy(classKeys.a), classBSecret: b,
                classBPublic: try ClassBAgreement.publicKey(of: b), classC: try copy(classKeys.c)))
    }

    /// A new file of `cls` holding `text`, with its first handle.
    func file(_ name: String, _ cls: ProtectionClass, _ text: String) throws -> KeybagDaemon.OpenFile {
        let (n, _, h) = try fs.io.create(
            parent: 1, name: name, mode: S_IFREG | 0o644, flags: O_RDWR | O_CREAT, caller: root)
        try fs.attributes.setProtection(of: n.id, to: cls)
        try Array(text.utf8).withUnsafeBytes { try fs.io.write(h, offset: 0, data: $0) }
        return h
    }

    /// The text read through `h`, or the errno the read failed with.
    func read(_ h: KeybagDaemon.OpenFile) -> Result<String, FSError> {
        var buf = [UInt8](repeating: 0, count: 4096)
        var text = ""
        do {
            try buf.withUnsafeMutableBytes { b in
                try fs.io.read(h, offset: 0, into: b, reply: { n in text = String(decoding: b[0..<n], as: UTF8.self) })
            }
            return .success(text)
        } catch { return .failure(FSError(error)) }
    }

    func errno<T>(_ r: Result<T, FSError>) -> Int32 { if case .failure(let e) = r { return e.errno }; return 0 }

    func testAClassAHandleIsRefusedFromTheLockToTheUnlock() throws {
        let h = try file("secret", .complete, "quarterly numbers")
        XCTAssertEqual(try read(h).get(), "quarterly numbers")
        Eviction(.lock).run(keyring: keyring, target: fs)
        XCTAssertEqual(errno(read(h)), EACCES)
        XCTAssertThrowsError(
            try fs.attributes.getattr(h.node.id, handle: h), "a cached write would ask for attributes first")
        XCTAssertEqual(fs.attributes.attributeSeconds(h.node.id, normal: 60), 0)
        XCTAssertThrowsError(try fs.io.open(h.node.id, flags: O_RDONLY)) {
            XCTAssertEqual(($0 as? FSError)?.errno, EACCES)
        }
        try unlock()
        XCTAssertEqual(try read(h).get(), "quarterly numbers")
        XCTAssertEqual(fs.attributes.attributeSeconds(h.node.id, normal: 60), 60)
        fs.io.release(h)
    }

    func testTheStoreHoldsNeitherTheNameNorTheContent() throws {
        let h = try file("quarterly-report.txt", .none, "quarterly numbers")
        fs.io.release(h)
        let names = try FileManager.default.subpathsOfDirectory(atPath: dir)
        XCTAssertFalse(names.contains { $0.contains("quarterly") }, "\(names)")
        for name in names {
            let bytes = (try? Data(contentsOf: URL(fileURLWithPath: dir + "/" + name))) ?? Data()
            XCTAssertNil(bytes.range(of: Data("quarterly numbers".utf8)), name)
        }
    }

    /// Overwrites below a file's known hole-free start reserve nothing, unless another writer
    /// is expected in the store (it could punch a hole the daemon does not see at once).
    func testTheKnownHoleFreeStartIsUsedOnlyWhereNoOtherWriterIsExpected() throws {
        XCTAssertTrue(fs.io.storeReportsHoles, "the test's store (/tmp, ext4 here) reports holes exactly")
        let h = try file("db", .none, "")
        let blocks = [UInt8](repeating: 1, count: 8 * 4096)
        try blocks.withUnsafeBytes { try fs.io.write(h, offset: 0, data: $0) }
        let end = fs.io.content.layout.backingSize(plainSize: 8 * 4096)
        XCTAssertEqual(h.file.allocated.load(ordering: .relaxed), end, "a file written in order is known whole")
        try fs.io.truncate(h.node, handle: h, to: 3 * 4096)
        XCTAssertEqual(
            h.file.allocated.load(ordering: .relaxed), fs.io.content.layout.backingSize(plainSize: 3 * 4096),
            "a cut forgets what lay past it")
        fs.underneath.expectAnotherWriter()
        try blocks.withUnsafeBytes {
            try fs.io.write(h, offset: 0, data: UnsafeRawBufferPointer(rebasing: $0[0..<4096]))
        }
        XCTAssertEqual(h.file.allocated.load(ordering: .relaxed), 0, "with another writer expected nothing is known")
    }

    func testAClassBHandleReadsThroughTheLockAndItsLastCloseEndsIt() throws {
        let h = try file("download", .completeUnlessOpen, "partial")
        Eviction(.lock).run(keyring: keyring, target: fs)
        XCTAssertEqual(try read(h).get(), "partial", "a handle opened before the lock keeps its key")
        XCTAssertFalse(
            pageDrops.withLock { $0 }.contains { $0.0.contains(h.node.id) }, "an open class B file keeps its pages")
        fs.io.release(h)
        XCTAssertNil(
            h.file.io.read { $0.readyKey(for: .write, keyring.access) }, "the last close while locked wipes the key")
        fs.kernel.detach()  // returns once the queued page drop has run (no session here anyway)
        XCTAssertTrue(
            pageDrops.withLock { $0 }.contains { $0.0 == [h.node.id] && $0.1.contains("last close") },
            "and its cached pages go")
        XCTAssertThrowsError(try fs.io.open(h.node.id, flags: O_RDONLY)) {
            XCTAssertEqual(($0 as? FSError)?.errno, EACCES)
        }
        let made = try file("made-while-locked", .completeUnlessOpen, "new")
        XCTAssertEqual(try read(made).get(), "new", "class B files are created while locked")
        fs.io.release(made)
    }

    func testAReturnToBeforeFirstUnlockRefusesClassCButNotNone() throws {
        let c = try file("c", .completeUntilFirstUserAuthentication, "until first unlock")
        let d = try file("d", .none, "always")
        Eviction(.lock).run(keyring: keyring, target: fs)
        XCTAssertEqual(try read(c).get(), "until first unlock", "class C outlives a lock")
        Eviction(.returnToBeforeFirstUnlock).run(keyring: keyring, target: fs)
        XCTAssertEqual(errno(read(c)), EACCES)
        XCTAssertTrue(fs.attributes.handlesRefused(c.node))
        XCTAssertEqual(try read(d).get(), "always")
        XCTAssertFalse(fs.attributes.handlesRefused(d.node))
        fs.io.release(c); fs.io.release(d)
    }

    func testAWriteClearsSetIDBitsOnlyWhenTheKernelSaysSo() throws {
        let h = try file("tool", .none, "#!/bin/sh\n")
        XCTAssertEqual(fchmod(h.fd, 0o4755), 0)
        func mode() -> mode_t { var st = stat(); fstat(h.fd, &st); return st.st_mode & 0o7777 }
        fs.io.clearSetIDAfterModification(h, by: Caller(uid: 1000, gid: 1000, kernelSaysClearSetID: false))
        XCTAssertEqual(mode(), 0o4755)
        fs.io.clearSetIDAfterModification(h, by: Caller(uid: 1000, gid: 1000, kernelSaysClearSetID: true))
        XCTAssertEqual(mode(), 0o755)
        // Requests without the kernel's word (fallocate): /proc tells. This test process is
        // root with CAP_FSETID; a caller whose process is unknown counts as root only by uid.
        XCTAssertEqual(fchmod(h.fd, 0o4755), 0)
        fs.io.clearSetIDAfterModification(h, by: Caller(uid: 0, gid: 0, pid: getpid()))
        XCTAssertEqual(mode(), 0o4755)
        fs.io.clearSetIDAfterModification(h, by: Caller(uid: 1000, gid: 1000))
        XCTAssertEqual(mode(), 0o755)
        fs.io.release(h)
    }

    func testACreateThatFindsTheNameTakenTruncatesAsAnOpenWould() throws {
        let h = try file("tool", .none, "#!/bin/sh\n")
        XCTAssertEqual(fchmod(h.fd, 0o4755), 0)
        fs.io.release(h)
        // The kernel's CREATE without O_EXCL lost the race to another create of the name:
        // it opens the file, and its O_TRUNC by a caller without CAP_FSETID clears set-user-ID.
        let caller = Caller(uid: 1000, gid: 1000, kernelSaysClearSetID: true)
        let (_, _, again) = try fs.io.create(
            parent: 1, name: "tool", mode: S_IFREG | 0o644, flags: O_RDWR | O_CREAT | O_TRUNC,
            caller: caller)
        XCTAssertEqual(try read(again).get(), "", "truncated")
        var st = stat()
        XCTAssertEqual(fstat(again.fd, &st), 0)
        XCTAssertEqual(st.st_mode & 0o7777, 0o755)
        fs.io.release(again)
    }
}
