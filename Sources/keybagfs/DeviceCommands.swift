import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore

/// `keybagfs device`: the devices of a store that several machines share (one keybag each).
struct DeviceCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "device",
        abstract: "List, add and remove the devices of a store shared by several machines.",
        discussion: """
            Each device has its own device key, passcode, failed-attempt counter and lock. A device is added on \
            the new machine, with the store's recovery key, from its copy of the store; it is removed from \
            another device, with that device's passcode: files written from then on cannot be opened with the \
            removed device's keys. See docs/DEVICES.md, "Several devices".
            """,
        subcommands: [ID.self, List.self, Add.self, Approve.self, Remove.self])

    /// `keybagfs device id`.
    struct ID: ParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "id", abstract: "Print this device's id in the store (from its device key).")

        @OptionGroup var target: UnmountedStore

        func run() throws {
            let kb = try Keybag.load(storePath: target.store)
            let dk = try DeviceKeyFile.load(from: target.deviceKeyPath(kb))
            defer { dk.wipe() }
            print(try DeviceIdentity.id(deviceKey: dk, storeID: kb.file.storeID))
        }
    }

    /// `keybagfs device list`.
    struct List: ParsableCommand {
        static let configuration = CommandConfiguration(abstract: "List the store's devices, present and removed.")

        @Argument(help: "The store directory.")
        var store: String

        @Flag(help: "Print JSON.")
        var json = false

        @Option(
            help: """
                This device's key: also show which devices, key sets and records it trusts, and which it refuses                 (forged or damaged).
                """)
        var deviceKey: String?

        func run() throws {
            let any = try Keybag.load(storePath: store)  // a clear error when it is no store
            let devices = StoreDevices.list(storePath: store)
            let trust = try deviceKey.map { path -> DeviceTrust? in
                let dk = try DeviceKeyFile.load(from: path)
                defer { dk.wipe() }
                return DeviceTrust.of(try Keybag.load(storePath: store, deviceKey: dk))
            }
            _ = any
            if json {
                let rows: [[String: Any]] = devices.map { d in
                    var r: [String: Any] = ["id": d.id ?? NSNull(), "name": d.name ?? NSNull()]
                    if let k = d.keybag { r["keybag"] = k }
                    if let t = d.removedAt { r["removedAt"] = t; r["removedBeforeKeySet"] = d.removedBeforeKeySet ?? 0 }
                    if let t = trust ?? nil, let id = d.id { r["trusted"] = t.trusted[id] != nil }
                    return r
                }
                var out: [String: Any] = ["devices": rows]
                if let t = trust ?? nil {
                    out["trust"] = [
                        "trusted": t.trusted.keys.sorted(), "removed": t.removed.sorted(), "refused": t.refused,
                        "newestKeySet": t.newestSet,
                    ]
                }
                let data = try JSONSerialization.data(withJSONObject: out, options: [.sortedKeys])
                print(String(decoding: data, as: UTF8.self))
                return
            }
            if let t = trust ?? nil {
                print("trusted by this device: \(t.trusted.keys.sorted().joined(separator: ", "))")
                for r in t.refused { print("refused: \(r)") }
            } else if deviceKey != nil {
                print("this device has no identity yet (run `keybagfs recover` once to make one)")
            }
            for d in devices {
                let id = d.id ?? "first (its id is written at its next mount; `device remove` takes 'first')"
                if let t = d.removedAt {
                    print("\(id)  removed \(Date(timeIntervalSince1970: t))")
                } else {
                    // A name is whatever the device wrote: no terminal control characters pass.
                    let scalars = (d.name ?? "").unicodeScalars.filter {
                        $0.value >= 0x20 && !(0x7f..<0xa0).contains($0.value)
                    }
                    let name = scalars.map(String.init).joined()
                    print("\(id)  \(name)  \(d.keybag ?? "")")
                }
            }
        }
    }

    /// `keybagfs device add`.
    struct Add: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Make this machine a device of a store it holds a copy of (needs the recovery key).",
            discussion: """
                Run on the new machine, with the store unmounted. The device key is made at --device-key (or the \
                default path) unless a 32-byte key is there. The recovery key is read from --recovery-key-file, \
                or as the first line of stdin with --stdin (the new device's passcode is then the second line), \
                or asked on the terminal. The keys come from the store's recovery slots; no key travels between \
                machines.
                """)

        @OptionGroup var target: UnmountedStore

        @Option(help: "A name for this device (default: the host name).")
        var name: String?

        @OptionGroup var recoveryKey: RecoveryKeySource

        @Flag(help: "Read the recovery key (unless --recovery-key-file) and then the passcode as lines from stdin.")
        var stdin = false

        @Option(help: "Argon2id cost of this device's passcode: interactive, moderate or sensitive.")
        var kdf: KDFStrength = .moderate

        @Option(
            help: ArgumentHelp(
                "Bind this device's passcode to this machine's TPM 2.0 from its keybag's first write: auto (when one "
                    + "is present), on (required) or off."))
        var tpm2: TPMChoice = .auto

        @OptionGroup var tpm: TPMEnrollOptions

        @Flag(
            help: """
                Join by the approval of a device already in the store, without the recovery key: run this again \
                after each step of `keybagfs device approve` on that device, until both show the same code.
                """)
        var approval = false

        @Option(help: "With --approval: the code the approving device showed (it must be this device's).")
        var code: String?

        @Flag(help: "With --approval: give the pairing up (this device's request and secrets go).")
        var cancel = false

        func run() throws {
            let lock = try lockUnmountedStore(target.store)
            defer { close(lock) }
            let any = try Keybag.load(storePath: target.store)
            let dkPath = target.deviceKeyPath(any)
            if approval {
                return try DevicePairingCommand.newcomer(
                    store: target.store, deviceKeyPath: dkPath, name: name ?? ProcessInfo.processInfo.hostName,
                    code: code, stdin: stdin, kdf: kdf, cancel: cancel)
            }
            // Two devices of one store on one machine share the default key path: a key file
            // that is already a device of the store is refused before anything is asked.
            if FileManager.default.fileExists(atPath: dkPath) {
                let key = try DeviceKeyFile.load(from: dkPath)
                defer { key.wipe() }
                if let id = try StoreDevices.deviceOwning(key: key, storePath: target.store) {
                    throw KeybagError.invalid(
                        "the device key \(dkPath) already belongs to device \(id) of this store (another device on "
                            + "this machine?); give this device its own key with --device-key PATH (a new key is made "
                            + "there), or use `keybagfs recover` to bring that device up to date")
                }
            }
            let recovery = try recoveryKey.read(fromStdin: stdin)
            defer { recovery.wipe() }
            let passcode = try PasscodeInput.readNew(
                fromStdin: stdin, prompt: "Passcode of this device: ",
                mismatch: "the passcodes differ; nothing was changed")
            defer { passcode.wipe() }
            let existed = FileManager.default.fileExists(atPath: dkPath)
            let dk = existed ? try DeviceKeyFile.load(from: dkPath) : try DeviceKeyFile.create(at: dkPath)
            defer { dk.wipe() }
            do {
                let storeID = any.file.storeID
                let sealer = try tpm2.tcti(device: target.tpm2Device).map {
                    try TPMSealer.enroll(tcti: $0, deviceKey: dk, storeID: storeID, pcrs: try tpm.pcrs())
                }
                let choice = try tpm.lockoutChoice()
                defer { if case .given(let k) = choice { k.wipe() } }
                try sealer?.checkLockout(choice)
                let kb = try StoreDevices.add(
                    storePath: target.store, recovery: recovery, passcode: passcode, deviceKey: dk,
                    name: name ?? ProcessInfo.processInfo.hostName, strength: kdf, sealer: sealer
                ) { keys in try sealer?.takeLockout(choice, sets: keys.sets, storeID: storeID) }
                print("added this device to \(target.store)")
                if let sealer { TPMEnrollOptions.report(sealer) }
                print("  device id:  \(kb.file.deviceID ?? "")")
                print("  keybag:     \(kb.relativePath)")
                print("  device key: \(dkPath)")
            } catch {
                if !existed { unlink(dkPath) }
                throw error
            }
        }
    }

    /// `keybagfs device remove`.
    struct Remove: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Remove another device (a lost machine): it cannot open files written from now on.",
            discussion: """
                Run on a device that stays, with the store unmounted; needs that device's passcode and the \
                store's recovery key (it must cover the new keys): from --recovery-key-file, or the first line of \
                stdin with --stdin (the passcode is then the second line), or asked on the terminal. New class \
                keys are made for files written from now on; the removed device keeps what it could already \
                read. The devices this one trusts take the new keys up at their next unlock (others with \
                `keybagfs recover`); until then they refuse new files. Also remove the device from the sync engine.
                """)

        @OptionGroup var target: UnmountedStore

        @Argument(help: "The id of the device to remove (`keybagfs device list`), or `first` for the store's first.")
        var id: String

        @OptionGroup var recoveryKey: RecoveryKeySource

        @Flag(help: "Read the recovery key (unless --recovery-key-file) and then the passcode as lines from stdin.")
        var stdin = false

        @Option(help: "A device the removed one approved that stays (by default they go with it); repeatable.")
        var keep: [String] = []

        func run() throws {
            try target.withDeviceKeybag { kb, dk in
                try kb.unwrapDeviceKeySlot("D", deviceKey: dk).wipe()
                let recovery = kb.hasRecoveryKey ? try recoveryKey.read(fromStdin: stdin) : nil
                defer { recovery?.wipe() }
                let passcode = try PasscodeInput.read(fromStdin: stdin, prompt: "Passcode: ")
                defer { passcode.wipe() }
                let keepSet = Set(keep)
                let chain =
                    DeviceTrust.of(kb).map { DeviceTrust.approvalChain(kb, of: id, trust: $0, keep: keepSet) } ?? []
                let names = Dictionary(
                    DeviceCertificate.all(storePath: target.store).map { ($0.deviceID, $0.name ?? "no name") },
                    uniquingKeysWith: { a, _ in a })
                let set = try StoreDevices.remove(
                    &kb, id, passcode: passcode, deviceKey: dk, recovery: recovery, keep: keepSet)
                print("removed device \(id); files written from now on use key set \(set)")
                for d in chain {
                    print(
                        "also removed \(d) (\(DeviceTrust.shown(names[d] ?? "no name"))): approved by \(id) or by a device it "
                            + "approved; keep such a device with --keep ID")
                }
            }
        }
    }
}
