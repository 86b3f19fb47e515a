import Foundation
import Glibc

/// The check of one file: its header slots, a fresh header where one is missing, its blocks.
extension StoreCheck {
    /// The unwrapping key of a class in a key set, when at hand (B needs its private key).
    func classKey(_ cls: ProtectionClass, keySet: UInt8) -> FileHeader.ClassKey? {
        keyring.unwrappingKey(for: cls, keySet: keySet)
    }

    /// Gives a headerless file a header of `cls` (a fresh key; it holds no data).
    func writeFreshHeader(_ fd: Int32, _ cls: ProtectionClass) throws {
        let set = keyring.currentKeySet
        guard !keyring.refusesNewWraps else { throw KeybagError.keyUnavailable }  // a removed device would open it
        let wrap: FileHeader.ClassKey
        if cls == .completeUnlessOpen {
            wrap = .classBPublic(classBPublic)
        } else {
            guard let k = classKey(cls, keySet: set) else { throw KeybagError.keyUnavailable }
            wrap = k
        }
        guard ftruncate(fd, 0) == 0 else { throw KeybagError.system("ftruncate", errno) }
        let raw = SecureKey(random: 32)
        defer { raw.wipe() }
        try HeaderSlots.writeNew(
            fd: fd, try FileHeader.create(fileKey: raw, class: cls, cipher: keybag.cipher, using: wrap, keySet: set))
        guard fsync(fd) == 0 else { throw KeybagError.system("fsync", errno) }
    }

    /// The file's header (a superseded slot erased, when repairing), or nil with the problem noted.
    private func readHeader(fd: Int32, path: String, name: String?) -> FileHeader? {
        do {
            let (header, superseded) = try HeaderSlots.read(fd: fd)
            if let superseded {
                fix(
                    "header-superseded-slot", path, name,
                    "a class change was cut off: slot \(superseded) still holds the older class's wrap"
                ) {
                    try HeaderSlots.erase(fd: fd, index: superseded)
                }
            }
            return header
        } catch {
            unreadableHeaders += 1
            note("header-damaged", path, name, "\(error): the file key is lost", "not-repairable")
            return nil
        }
    }

    /// Checks one regular file: header slots, layout, and with its class key every block.
    func checkFile(dirFD: Int32, backing: String, path: String, name: String?, dirClass: ProtectionClass) {
        let fd = openat(dirFD, backing, (options.repair ? O_RDWR : O_RDONLY) | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { return note("unreadable", path, name, String(cString: strerror(errno)), "not-repairable") }
        defer { close(fd) }
        var st = stat()
        fstat(fd, &st)
        let size = Int(st.st_size)
        if size < FileHeader.size {
            let keyAtHand = dirClass == .completeUnlessOpen || classKey(dirClass, keySet: keyring.currentKeySet) != nil
            let detail =
                size == 0
                ? "an empty file without header (a crash during create); it becomes an empty \(dirClass.name) file"
                : "a header cut to \(size) bytes: the file key is lost" + Self.halfSynced
            if !keyAtHand && options.repair {
                return note(size == 0 ? "no-header" : "header-truncated", path, name, detail, "needs-passcode")
            }
            return fix(size == 0 ? "no-header" : "header-truncated", path, name, detail, losesData: size > 0) {
                try writeFreshHeader(fd, dirClass)
            }
        }
        if Self.allZero(fd, size: size) {
            // Created, never synced: the size reached the disk, the bytes did not (ext4 shows a
            // preallocated block whose write was cut off as zeros). No key was ever stored.
            let detail = "a file of \(size) zero bytes without header (a crash after create, before its first sync)"
            return fix("no-header", path, name, detail, losesData: false) {
                guard ftruncate(fd, 0) == 0 else { throw KeybagError.system("ftruncate", errno) }
                try writeFreshHeader(fd, dirClass)
            }
        }
        guard let header = readHeader(fd: fd, path: path, name: name) else { return }
        xattrIDs.insert(Base64URL.encode(header.fileID))
        guard header.cipher.sharesLayout(with: keybag.cipher) else {
            return note(
                "header-cipher", path, name,
                "the header names \(header.cipher.name), whose blocks have another layout than the store's "
                    + "\(keybag.cipher.name)",
                "not-repairable")
        }
        let layout = content.layout
        let rest = (size - FileHeader.size) % layout.cipherBlockSize
        if rest > 0 && rest <= layout.overhead {
            let detail = "\(rest) bytes after the last block hold no data (a write cut off" + Self.halfSynced + ")"
            fix("torn-fragment", path, name, detail) {
                guard ftruncate(fd, off_t(size - rest)) == 0 else { throw KeybagError.system("ftruncate", errno) }
            }
        }
        guard let ck = classKey(header.protectionClass, keySet: header.keySet) else { keyless += 1; return }
        let key: FileContentKey
        do { key = try FileContentKey(key: try header.unwrap(using: ck), header: header) } catch {
            return note(
                "header-wrap", path, name, "the file key does not unwrap (header edited offline)", "not-repairable")
        }
        defer { key.wipe() }
        checkBlocks(fd: fd, key: key, path: path, name: name)
    }

    /// Every block of a file; repairs end marks, torn tails and damaged blocks.
    func checkBlocks(fd: Int32, key: FileContentKey, path: String, name: String?) {
        guard let checks = try? content.blockChecks(fd: fd, key: key) else {
            return note("unreadable", path, name, "cannot read the blocks", "not-repairable")
        }
        blocks += checks.count
        let n = checks.count
        guard n > 0 else { return }
        // The last block that authenticates: everything after it is torn.
        let lastGood = checks.lastIndex { $0 == .authentic || $0 == .wrongEnd } ?? -1
        if lastGood < n - 1 {
            let lost = n - 1 - lastGood
            fix(
                "torn-tail", path, name,
                "the last \(lost) block(s) do not authenticate (a write cut off before fsync" + Self.halfSynced
                    + "); repair cuts the file after block \(lastGood)",
                losesData: true
            ) {
                try content.cut(fd: fd, afterBlocks: lastGood + 1)
                if lastGood >= 0 && key.sealsEnd {
                    try content.resealEndMark(fd: fd, key: key, block: lastGood, from: false, to: true)
                }
            }
        } else if checks[n - 1] == .wrongEnd {
            fix(
                "end-not-sealed", path, name,
                "the file ends at block \(n - 1) but that block is not sealed as the end (a cut, or a truncate "
                    + "cut off" + Self.halfSynced + ")"
            ) {
                try content.resealEndMark(fd: fd, key: key, block: n - 1, from: false, to: true)
            }
        }
        for (b, c) in checks.enumerated() where b < lastGood && c == .damaged {
            fix(
                "block-damaged", path, name, "block \(b) does not authenticate; repair turns it into a hole (zeros)",
                losesData: true
            ) {
                let zeros = [UInt8](repeating: 0, count: content.layout.cipherBlockSize)
                try zeros.withUnsafeBytes {
                    try FullIO.pwriteFull(fd, $0, offset: content.layout.cipherOffset(ofBlock: b))
                }
            }
        }
        if options.repair { _ = fsync(fd) }
    }

    /// Whether the first `size` bytes of `fd` are all zero (read in 64 KiB pieces).
    static func allZero(_ fd: Int32, size: Int) -> Bool {
        var buf = [UInt8](repeating: 0, count: min(size, 1 << 16))
        var at = 0
        while at < size {
            let n = buf.withUnsafeMutableBytes { pread(fd, $0.baseAddress!, min($0.count, size - at), off_t(at)) }
            guard n > 0, buf[0..<n].allSatisfy({ $0 == 0 }) else { return false }
            at += n
        }
        return true
    }
}
