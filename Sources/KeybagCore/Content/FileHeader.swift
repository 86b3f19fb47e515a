import CSodium

/// The per-file header at the start of every backing file: two 160-byte slots, one
/// holding the file id, class and the file key wrapped by its class key, the other erased.
/// A class change writes the erased slot with a higher generation and makes it durable,
/// then erases the old slot and makes that durable: killed at any instant, the file has
/// the old or the new class, and once the change is done no older wrap remains.
public struct FileHeader: Sendable, Equatable {
    /// Bytes of one slot.
    public static let slotSize = 160
    /// Bytes before the first content block.
    public static let size = 2 * slotSize
    static let magic: [UInt8] = Array("KBH1".utf8)
    /// Bytes of a slot covered by the checksum.
    static let bodySize = 132

    /// Slot generation; the valid slot with the highest generation wins.
    public var generation: UInt32
    /// The file's protection class.
    public var protectionClass: ProtectionClass
    /// The store's content cipher, repeated here for self-description.
    public var cipher: ContentCipher
    /// Format flags (byte 10): `sealsEnd` for files whose last block is marked in its
    /// associated data; 0 for files written before that format.
    public var flags: UInt8
    /// The store's key set whose class key wraps the file key (byte 11): 0 for the store's
    /// first keys; each device removal starts a new set (`KeySets`).
    public var keySet: UInt8 = 0
    /// Random 16-byte file id, bound into every content block.
    public var fileID: [UInt8]
    /// Ephemeral X25519 public key (class B), else zeros.
    public var ephemeralPublic: [UInt8]
    /// nonce (24) || wrapped file key (32) || tag (16).
    public var wrappedKey: [UInt8]
    /// Index (0 or 1) of the slot this header was read from or will be written to.
    public var slot: Int

    /// What can unwrap or wrap a file key for one class.
    public enum ClassKey {
        /// Classes A, C, D: a 32-byte symmetric class key.
        case symmetric(SecureKey)
        /// Class B, wrapping only: the class public key.
        case classBPublic([UInt8])
        /// Class B, both ways: the class private key and its public key.
        case classBPrivate(SecureKey, [UInt8])
    }

    /// Flag: the last content block is sealed as the last (a cut or an append fails).
    public static let sealsEnd: UInt8 = 1
    /// Every flag this version knows; a slot with any other bit set is damaged.
    static let knownFlags: UInt8 = sealsEnd

    /// Whether the file's end is authenticated (`sealsEnd`).
    public var endIsSealed: Bool { flags & FileHeader.sealsEnd != 0 }

    /// Bytes 0..<60 of the slot: authenticated by the key wrap.
    private func wrapAD() -> [UInt8] {
        var ad = FileHeader.magic
        withUnsafeBytes(of: generation.littleEndian) { ad += $0 }
        ad += [protectionClass.rawValue, cipher.rawValue, flags, keySet]
        ad += fileID
        ad += ephemeralPublic
        return ad
    }

    /// A header for a new file: `fileKey` wrapped for `cls` by that class's key of `keySet`.
    public static func create(
        fileKey: SecureKey, class cls: ProtectionClass, cipher: ContentCipher, using classKey: ClassKey,
        keySet: UInt8 = 0
    ) throws -> FileHeader {
        var h = FileHeader(
            generation: 1, protectionClass: cls, cipher: cipher, flags: FileHeader.sealsEnd, keySet: keySet,
            fileID: Sodium.randomArray(16),
            ephemeralPublic: [UInt8](repeating: 0, count: 32), wrappedKey: [], slot: 0)
        try h.wrap(fileKey, using: classKey)
        return h
    }

    /// The same file moved to class `cls` (wrapped by that class's key of `keySet`), written to
    /// the other slot with the next generation.
    public func rewrapped(
        fileKey: SecureKey, to cls: ProtectionClass, using classKey: ClassKey, keySet: UInt8 = 0
    ) throws -> FileHeader {
        var h = self
        h.generation = generation &+ 1
        h.protectionClass = cls
        h.keySet = keySet
        h.slot = 1 - slot
        h.ephemeralPublic = [UInt8](repeating: 0, count: 32)
        try h.wrap(fileKey, using: classKey)
        return h
    }

    private mutating func wrap(_ fileKey: SecureKey, using classKey: ClassKey) throws {
        let wrapKey: SecureKey
        switch classKey {
        case .symmetric(let k): wrapKey = k
        case .classBPublic(let pk), .classBPrivate(_, let pk):
            let (k, eph) = try ClassBAgreement.newFileWrapKey(classPublicKey: pk, fileID: fileID)
            ephemeralPublic = eph
            wrapKey = k
        }
        wrappedKey = try KeyWrap.wrap(fileKey, with: wrapKey, ad: wrapAD())
        if case .symmetric = classKey {} else { wrapKey.wipe() }
    }

    /// Unwraps the file key; throws `keyUnavailable` for a public-only class B key and
    /// `corrupt` when the wrap does not authenticate.
    public func unwrap(using classKey: ClassKey) throws -> SecureKey {
        switch classKey {
        case .symmetric(let k):
            return try KeyWrap.unwrap(wrappedKey, with: k, ad: wrapAD())
        case .classBPublic:
            throw KeybagError.keyUnavailable
        case .classBPrivate(let sk, let pk):
            let k = try ClassBAgreement.existingFileWrapKey(
                classSecret: sk, classPublicKey: pk, ephPublic: ephemeralPublic, fileID: fileID)
            defer { k.wipe() }
            return try KeyWrap.unwrap(wrappedKey, with: k, ad: wrapAD())
        }
    }

    /// The 160 bytes of this header's slot.
    public func encodeSlot() -> [UInt8] {
        var b = wrapAD()
        b += wrappedKey
        precondition(b.count == FileHeader.bodySize)
        var sum = [UInt8](repeating: 0, count: 16)
        crypto_generichash(&sum, 16, b, UInt64(b.count), nil, 0)
        b += sum
        b += [UInt8](repeating: 0, count: FileHeader.slotSize - b.count)
        return b
    }

    /// Byte offset of this header's slot in the backing file.
    public var slotOffset: Int { slot * FileHeader.slotSize }

    /// Parses one slot; nil when it is empty, torn or not a header. Every byte counts: the
    /// flags and the zero bytes (148..<160) must hold what this version writes.
    static func parseSlot(_ b: ArraySlice<UInt8>, index: Int) -> FileHeader? {
        let s = Array(b)
        guard s.count == slotSize, Array(s[0..<4]) == magic else { return nil }
        var sum = [UInt8](repeating: 0, count: 16)
        crypto_generichash(&sum, 16, s, UInt64(bodySize), nil, 0)
        guard sodium_memcmp(sum, Array(s[bodySize..<(bodySize + 16)]), 16) == 0 else { return nil }
        guard s[10] & ~knownFlags == 0, s[(bodySize + 16)...].allSatisfy({ $0 == 0 }) else { return nil }
        let gen = UInt32(s[4]) | UInt32(s[5]) << 8 | UInt32(s[6]) << 16 | UInt32(s[7]) << 24
        guard let cls = ProtectionClass(rawValue: s[8]), let cipher = ContentCipher(rawValue: s[9]) else { return nil }
        return FileHeader(
            generation: gen, protectionClass: cls, cipher: cipher, flags: s[10], keySet: s[11],
            fileID: Array(s[12..<28]),
            ephemeralPublic: Array(s[28..<60]), wrappedKey: Array(s[60..<132]), slot: index)
    }

    /// Parses the two-slot header. Each slot is either erased (all zero) or a valid header;
    /// a slot that is neither makes the header corrupt, so a damaged newest slot can never
    /// fall back to an older class's wrap. Two valid slots mean a class change was cut off
    /// before it erased the older one: the newer wins and `superseded` names the slot to erase.
    public static func parseSlots(_ bytes: [UInt8]) throws -> (current: FileHeader, superseded: Int?) {
        guard bytes.count >= size else { throw KeybagError.corrupt("file header truncated") }
        var valid: [FileHeader] = []
        for i in 0..<2 {
            let raw = bytes[(i * slotSize)..<((i + 1) * slotSize)]
            if raw.allSatisfy({ $0 == 0 }) { continue }
            guard let h = parseSlot(raw, index: i) else {
                throw KeybagError.corrupt("file header slot \(i) is damaged")
            }
            valid.append(h)
        }
        switch valid.count {
        case 0:
            throw KeybagError.corrupt("no file header")
        case 1:
            return (valid[0], nil)
        default:
            let (x, y) = (valid[0], valid[1])
            guard x.generation != y.generation, x.fileID == y.fileID else {
                throw KeybagError.corrupt("file header slots disagree")
            }
            return x.generation > y.generation ? (x, y.slot) : (y, x.slot)
        }
    }

    /// Parses the two-slot header (see `parseSlots`).
    public static func parse(_ bytes: [UInt8]) throws -> FileHeader { try parseSlots(bytes).current }
}
