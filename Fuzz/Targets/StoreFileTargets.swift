import Foundation
import KeybagCore

extension FuzzTarget {
    /// The keybag, names, folder metadata and xattr sets: files any store writer can replace.
    static let storeFileTargets: [FuzzTarget] = [
        // STORE/keybag (every format, 1–4): read as the daemon and fsck read it, then bound to
        // the seed device key. A writer without the device key cannot make its MACs; the
        // seed keybags carry valid ones, so the fuzzer reaches the checks after them.
        FuzzTarget(name: "keybag") { input in
            let store = SeedStore.shared.freshCopy()
            put(input, at: store + "/" + Keybag.fileName)
            _ = try? Keybag.load(storePath: store)
            if var kb = try? Keybag.load(storePath: store, deviceKey: SeedStore.shared.deviceKey) {
                _ = try? kb.authenticate(deviceKey: SeedStore.shared.deviceKey)
                _ = DeviceTrust.snapshot(kb)
                _ = try? kb.classDKeys(deviceKey: SeedStore.shared.deviceKey).values.forEach { $0.wipe() }
            }
        },
        // An encrypted name as it stands in a folder of `data/` (any writer can name a file
        // anything), a long name's side-file contents, and a symlink's stored target.
        FuzzTarget(name: "names") { input in
            let s = String(decoding: input, as: UTF8.self)
            let store = SeedStore.shared
            _ = try? store.names.decrypt(s, dirIV: store.rootIV)
            _ = try? store.names.decryptTarget(s)
            _ = NameCipher.backingEntry(for: s)
            _ = NameCipher.isSideFile(s)
            _ = NameCipher.isLongName(s)
            _ = NameCipher.targetLength(storedLength: input.count)
            _ = Base64URL.decode(s)
        },
        // A sync engine's conflict copy name (`NAME.sync-conflict-DATE-TIME-DEVICE.EXT`), as
        // the daemon reads it from a backing folder, and the readable name a user may type.
        FuzzTarget(name: "conflict-copy") { input in
            let s = String(decoding: input, as: UTF8.self)
            if let c = ConflictCopy(backing: s) {
                _ = c.backing
                _ = c.isLong
                _ = c.readableName(of: String(decoding: input.prefix(40), as: UTF8.self))
            }
            _ = ConflictCopy.parse(readable: s)
        },
        // A folder's `.kbfs-dir` (name IV, sealed default class). Sealed under the volume key:
        // a writer without it reaches the length checks and the MAC; the seeds are real ones.
        FuzzTarget(name: "dir-meta") { input in
            _ = try? DirectoryMeta.decode(input, SeedStore.shared.names)
        },
        // A sealed xattr set (`STORE/xattrs/ID`), and its plaintext encoding, which only a
        // device of the store (holding the volume key) can make: both parsed.
        FuzzTarget(name: "xattrs") { input in
            for id in SeedStore.shared.files(in: Keybag.xattrsDirName) {
                _ = try? XattrSet.opened(input, id: id, names: SeedStore.shared.names)
            }
            _ = try? XattrSet.decode(input)
        },
    ]
}
