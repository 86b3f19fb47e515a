import Foundation
import Glibc

/// A backing entry's plaintext name, read as the daemon and `fsck` both read it: an encrypted
/// short name (or a sync engine's conflict copy of one), a hashed long name through its side
/// file, a conflict copy of a long name through the original's side file; and where a long
/// symlink target lives. The one home of these rules (gocryptfs' nametransform);
/// `NameCipher` does the cryptography, `ConflictCopy` the copies' names.
public struct StoreNames: Sendable {
    /// The volume key's name cipher.
    public let cipher: NameCipher

    /// Why a backing entry has no plaintext name.
    public enum Problem: Error, Equatable, Sendable {
        /// A hashed long name whose side file is missing (or not a regular file).
        case sideFileMissing
        /// A side file that does not hold the entry's encrypted name (empty, or another's).
        case sideFileMismatch
        /// The name decrypts under none of the directory's IVs (moved or edited offline).
        case doesNotDecrypt
        /// A conflict copy's readable name would be over 255 bytes.
        case readableNameTooLong

        /// One line for a log or an error.
        public func message(_ backing: String) -> String {
            switch self {
            case .sideFileMissing: return "long name \(backing) has no side file"
            case .sideFileMismatch: return "side file of \(backing) does not match"
            case .doesNotDecrypt: return "name \(backing) does not decrypt in this directory"
            case .readableNameTooLong: return "the readable name of a conflict copy is over 255 bytes"
            }
        }
    }

    /// Names read with `cipher`.
    public init(cipher: NameCipher) { self.cipher = cipher }

    /// Whether a backing entry carries a name: not one of the store's own files (`.kbfs-…`)
    /// nor a long name's side file.
    public static func carriesName(_ backing: String) -> Bool {
        BackingKind.of(backing).carriesName
    }

    /// The plaintext name of `backing`, an entry of the directory `dirFD`, and the index in
    /// `ivs` of the first IV it decrypts under (a directory's own IV first, then its metadata
    /// copies'); nil for an entry that carries no name.
    public func plaintextName(dirFD: Int32, backing: String, ivs: [[UInt8]]) -> Result<
        (name: String, index: Int)?, Problem
    > {
        guard Self.carriesName(backing) else { return .success(nil) }
        // A conflict copy shows its original's name, read as the original's (a long one from
        // the original's side file, which the copy shares).
        let copy = ConflictCopy(backing: backing)
        let original = copy?.original ?? backing
        let encrypted: String
        if NameCipher.isLongName(original) {
            switch sideFile(dirFD: dirFD, of: original) {
            case .failure(let problem): return .failure(problem)
            case .success(let e): encrypted = e
            }
        } else {
            encrypted = original
        }
        for (i, iv) in ivs.enumerated() {
            guard let plain = try? cipher.decrypt(encrypted, dirIV: iv) else { continue }
            let name = String(decoding: plain, as: UTF8.self)
            guard let copy else { return .success((name, i)) }
            let readable = copy.readableName(of: name)
            guard readable.utf8.count <= NameCipher.backingNameMax else { return .failure(.readableNameTooLong) }
            return .success((readable, i))
        }
        return .failure(.doesNotDecrypt)
    }

    /// The encrypted name a hashed long name's side file holds, checked against the entry.
    public func sideFile(dirFD: Int32, of backing: String) -> Result<String, Problem> {
        let fd = StoreFileOpen.regular(dirFD, backing + NameCipher.longSuffix)
        guard fd >= 0 else { return .failure(.sideFileMissing) }
        defer { close(fd) }
        var buf = [UInt8](repeating: 0, count: 1024)
        let n = read(fd, &buf, buf.count)
        let encrypted = String(decoding: buf[0..<max(n, 0)], as: UTF8.self)
        guard n > 0, NameCipher.backingEntry(for: encrypted).name == backing else { return .failure(.sideFileMismatch) }
        return .success(encrypted)
    }

    /// The file in the store's `targets/` folder that holds a long symlink target stored as
    /// `stored` in the link; nil for a target stored in the link itself.
    public static func longTargetID(_ stored: String) -> String? {
        stored.hasPrefix(NameCipher.longTargetPrefix)
            ? String(stored.dropFirst(NameCipher.longTargetPrefix.count)) : nil
    }
}
