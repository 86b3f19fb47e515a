import Foundation
import Glibc
import KeybagCore

extension FuzzTarget {
    /// File headers and contents: the bytes of a backing file.
    static let contentTargets: [FuzzTarget] = [
        // The 320-byte header's two slots, then the file key's unwrap under the class key its
        // class names. A writer without class keys cannot make a wrap that opens; the seeds
        // (class none files of the seed store) carry ones that do.
        FuzzTarget(name: "file-header") { input in
            guard let (header, _) = try? FileHeader.parseSlots(input) else { return }
            _ = header.encodeSlot()
            let store = SeedStore.shared
            guard let ck = store.keyring.unwrappingKey(for: header.protectionClass, keySet: header.keySet),
                let key = try? header.unwrap(using: ck)
            else { return }
            _ = try? FileContentKey(key: key, header: header)
        },
        // A whole backing file (header, sealed blocks, the sealed end): its plaintext read as
        // a mount reads it and its blocks checked as fsck checks them. Block tags need the
        // file key; what a writer without it reaches is the layout, the sizes, holes and torn
        // fills; the seeds open, so a mutation of a real file is what the fuzzer starts from.
        FuzzTarget(name: "file-content") { input in
            let fd = memoryFile(input)
            defer { close(fd) }
            let store = SeedStore.shared
            guard let (header, _) = try? HeaderSlots.read(fd: fd),
                let ck = store.keyring.unwrappingKey(for: header.protectionClass, keySet: header.keySet),
                let raw = try? header.unwrap(using: ck), let key = try? FileContentKey(key: raw, header: header)
            else { return }
            defer { key.wipe() }
            let content = EncryptedContent(layout: BlockLayout(cipher: header.cipher))
            var out = [UInt8](repeating: 0, count: 3 * 4096 + 100)
            var offset = 0
            while let n = try? out.withUnsafeMutableBytes({
                try content.read(fd: fd, key: key, offset: offset, into: $0)
            }), n > 0 {
                offset += n
            }
            _ = try? content.blockChecks(fd: fd, key: key)
        },
        // fsck of the seed store with the input as one file's backing (class none, so the
        // device key opens it): what `keybagfs fsck` reports of a damaged file.
        FuzzTarget(name: "store-check") { input in
            let store = SeedStore.shared.freshCopy()
            let docs = store + "/" + Keybag.dataDirName + "/" + SeedStore.shared.docsFolder
            let folder = Keybag.dataDirName + "/" + SeedStore.shared.docsFolder
            guard let victim = SeedStore.shared.regularFiles(in: folder).first else { return }
            put(input, at: docs + "/" + victim)
            let options = StoreCheck.Options(repair: false, dropData: false)
            guard
                let check = try? StoreCheck(
                    storePath: store, deviceKey: SeedStore.shared.deviceKey, passcode: nil, options: options)
            else { return }
            defer { check.wipe() }
            try? check.run()
        },
    ]
}
