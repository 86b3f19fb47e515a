import Foundation
import Glibc
import KeybagCore

/// The store the targets' inputs belong to: a copy of Fuzz/seed-store (written by the real
/// daemon, `Fuzz/make-seed-store.sh`) opened once with its device key, as the daemon and
/// fsck open a store. Targets that write into a store get a fresh working copy per input.
final class SeedStore: @unchecked Sendable {
    /// The one per process (opened at first use).
    static let shared = SeedStore()

    /// The committed seed store and its device key's folder.
    let source: String
    /// This process's pristine copy and its working copy.
    let pristine: String, work: String
    let deviceKey: SecureKey
    let keybag: Keybag
    let names: NameCipher
    let keyring: ClassKeyring
    let content: EncryptedContent
    let deviceID: String
    /// The IV of the store's root folder (names directly under `data/`).
    let rootIV: [UInt8]
    /// The backing name of the seed store's one folder (class none files in it).
    let docsFolder: String

    private init() {
        let fuzz = ProcessInfo.processInfo.environment["KBFS_FUZZ_DIR"] ?? "Fuzz"
        source = fuzz + "/seed-store"
        let tmp = ProcessInfo.processInfo.environment["TMPDIR"] ?? "/tmp"
        var template = Array("\(tmp)/kbfs-fuzz.XXXXXX".utf8CString)
        guard let dir = mkdtemp(&template) else { Self.fail("mkdtemp in \(tmp)") }
        let base = String(cString: dir)
        pristine = base + "/pristine"
        work = base + "/work"
        do {
            try FileManager.default.copyItem(atPath: source, toPath: pristine)
            deviceKey = try DeviceKeyFile.load(from: fuzz + "/seed.key")
            keybag = try Keybag.load(storePath: pristine, deviceKey: deviceKey)
            let volume = try keybag.unwrapDeviceKeySlot("volume", deviceKey: deviceKey)
            names = try NameCipher(volumeKey: volume)
            volume.wipe()
            keyring = ClassKeyring(
                classD: try keybag.classDKeys(deviceKey: deviceKey), current: UInt8(keybag.currentKeySet))
            content = EncryptedContent(layout: BlockLayout(cipher: keybag.cipher))
            deviceID = try DeviceIdentity.id(deviceKey: deviceKey, storeID: keybag.file.storeID)
            rootIV = try names.rootIV()
            let data = base + "/pristine/" + Keybag.dataDirName
            let folders = try FileManager.default.contentsOfDirectory(atPath: data).filter {
                !$0.hasPrefix(".") && Self.isFolder(data + "/" + $0)
            }
            guard let docs = folders.first else { throw KeybagError.corrupt("the seed store has no folder") }
            docsFolder = docs
        } catch {
            Self.fail("cannot open the seed store \(source) (run from the repository, or set KBFS_FUZZ_DIR): \(error)")
        }
        atexit {
            try? FileManager.default.removeItem(
                atPath: PathText.parent(SeedStore.shared.pristine))
        }
    }

    /// A fresh working copy of the store (the previous input's changes gone); its path.
    /// A copy that fails (two long-pass runs ended so, beside the mount tests) is said and tried
    /// again for up to 10 s, from the committed store where the pristine copy is gone: the
    /// harness's own trouble must not end a search.
    func freshCopy() -> String {
        for attempt in 0..<40 {
            try? FileManager.default.removeItem(atPath: work)
            do {
                if !Self.isFolder(pristine) {
                    try FileManager.default.createDirectory(
                        atPath: PathText.parent(pristine), withIntermediateDirectories: true)
                    try FileManager.default.copyItem(atPath: source, toPath: pristine)
                }
                try FileManager.default.copyItem(atPath: pristine, toPath: work)
                return work
            } catch {
                say("keybagfs-fuzz: copying the seed store failed (attempt \(attempt + 1)): \(error)\n")
                usleep(250_000)
            }
        }
        Self.fail("copy of the seed store failed 40 times")
    }

    /// Backing files of `folder` (a path inside the store) whose names match `keep`.
    func files(in folder: String, _ keep: (String) -> Bool = { _ in true }) -> [String] {
        ((try? FileManager.default.contentsOfDirectory(atPath: pristine + "/" + folder)) ?? []).filter(keep).sorted()
    }

    /// The regular files of `folder` (a path inside the store), names sorted.
    func regularFiles(in folder: String) -> [String] {
        files(in: folder) { name in
            var st = stat()
            return lstat(pristine + "/" + folder + "/" + name, &st) == 0 && st.st_mode & S_IFMT == S_IFREG
                && !name.hasPrefix(".") && !NameCipher.isSideFile(name)
        }
    }

    /// Whether `path` is a folder (not through a symlink).
    static func isFolder(_ path: String) -> Bool {
        var st = stat()
        return lstat(path, &st) == 0 && st.st_mode & S_IFMT == S_IFDIR
    }

    /// A harness failure (not a finding): says so and exits without a crash report.
    static func fail(_ why: String) -> Never {
        say("keybagfs-fuzz: \(why)\n")
        exit(3)
    }
}

/// Writes `text` and a newline to standard error.
func say(_ text: String) {
    FileHandle.standardError.write(Data((text.hasSuffix("\n") ? text : text + "\n").utf8))
}

/// Writes `bytes` as the file at `path` (replacing what is there, following nothing).
func put(_ bytes: [UInt8], at path: String) {
    unlink(path)
    let fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
    guard fd >= 0 else { SeedStore.fail("create \(path): \(String(cString: strerror(errno)))") }
    defer { close(fd) }
    var done = 0
    while done < bytes.count {
        let n = bytes.withUnsafeBytes { write(fd, $0.baseAddress! + done, bytes.count - done) }
        guard n > 0 else { SeedStore.fail("write \(path)") }
        done += n
    }
}

/// An unnamed file holding `bytes` (a backing file without a store around it).
func memoryFile(_ bytes: [UInt8]) -> Int32 {
    let path = PathText.parent(SeedStore.shared.work) + "/loose-file"
    unlink(path)
    let fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
    guard fd >= 0 else { SeedStore.fail("create \(path)") }
    unlink(path)
    if !bytes.isEmpty {
        guard bytes.withUnsafeBytes({ pwrite(fd, $0.baseAddress!, $0.count, 0) }) == bytes.count else {
            SeedStore.fail("pwrite memfd")
        }
    }
    return fd
}
