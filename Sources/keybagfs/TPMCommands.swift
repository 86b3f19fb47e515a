import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore

/// `keybagfs tpm2`: move this device's passcode onto its TPM 2.0, or off it.
struct TPMCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "tpm2",
        abstract: "Bind this device's passcode to its TPM 2.0, or unbind it (store unmounted).",
        subcommands: [Enroll.self, Remove.self, ClearLockout.self, Helper.self])

    /// What enroll and remove share: the store locked against a daemon, this device's keybag
    /// (with its TPM, when bound) and key, and the passcode read only when `body` asks for it
    /// (after its own checks); key and passcode wiped after.
    static func moving(
        _ target: UnmountedStore, passcodeStdin: Bool,
        _ body: (inout Keybag, SecureKey, () throws -> SecureKey) throws -> Void
    ) throws {
        let lock = try lockUnmountedStore(target.store)
        defer { close(lock) }
        var (kb, dk) = try target.deviceKeybag()
        defer { dk.wipe() }
        var read: SecureKey?
        defer { read?.wipe() }
        try body(&kb, dk) {
            let p = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Passcode: ")
            read = p
            return p
        }
    }

    /// `keybagfs tpm2 helper`: one seal or unseal for the daemon (`TPMHelperProcess`), on
    /// stdin and stdout; not for people.
    struct Helper: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Seal or unseal once for the daemon (internal).", shouldDisplay: false)

        func run() throws {
            let rc = TPMHelperProcess.serve()
            if rc != 0 { throw ExitCode(rc) }
        }
    }

    /// `keybagfs tpm2 enroll`.
    struct Enroll: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Bind this device's passcode to its TPM: no passcode can then be tried off this machine.",
            discussion: """
                The passcode is asked (or read from stdin with --passcode-stdin); a wrong one counts. A store with a \
                recovery key needs it too (--recovery-key-file, else asked; with --passcode-stdin the first line of \
                stdin, the passcode the second). A random secret is sealed in the TPM behind an authorization \
                derived from the passcode, a new key set is made that only the TPM-bound keybag (and the recovery \
                key) holds, and every file is rewrapped for it, so a copy of the keybag from before the enrollment \
                opens nothing written or rewrapped since. Where the TPM's lockout authorization is empty, keybagfs \
                sets a random one (see --tpm2-lockout-auth-file, --tpm2-accept-clearable-lockout). The TPM's file \
                goes to /var/lib/keybagfs/DEVICEID.tpm2 ($STATE_DIRECTORY), never into the store. The TPM is \
                --tpm2-device, else /dev/tpmrm0.
                """)

        @OptionGroup var target: UnmountedStore

        @OptionGroup var tpm: TPMEnrollOptions

        @Flag(help: "Read the passcode as one line from standard input.")
        var passcodeStdin = false

        @Option(help: "Read the recovery key from this file's first line.")
        var recoveryKeyFile: String?

        @Flag(
            help: ArgumentHelp(
                "On a store with other devices: make the new key set anyway (each other device then takes it up "
                    + "with `keybagfs recover` before it can open files written from here)."))
        var newKeySet = false

        @Flag(
            help: ArgumentHelp(
                "On a store with other devices: keep the key sets as they are (a copy of this device's keybag from "
                    + "before the enrollment then still opens every file)."))
        var keepKeySet = false

        /// Whether the enrollment makes a new key set: always on a store of one device; on a store of
        /// several, only as the user says (the others could not open new files until `recover`).
        func makesNewKeySet(others: [String]) throws -> Bool {
            guard !(newKeySet && keepKeySet) else {
                throw ValidationError("--new-key-set and --keep-key-set exclude each other")
            }
            if others.isEmpty || newKeySet { return !keepKeySet }
            guard keepKeySet else {
                throw KeybagError.invalid(
                    "this store has other devices (\(others.joined(separator: ", "))): enrolling makes a new key set, "
                        + "which they could not open until each runs `keybagfs recover` with the recovery key. Pass "
                        + "--new-key-set for that, or --keep-key-set to keep the keys (a copy of this device's keybag "
                        + "from before then still opens every file); nothing was changed")
            }
            return false
        }

        func run() throws {
            try TPMCommand.moving(target, passcodeStdin: passcodeStdin) { kb, dk, passcode in
                if let current = kb.sealer as? TPMSealer {
                    throw KeybagError.invalid(
                        "this device is already bound to the TPM at \(current.tcti); `keybagfs tpm2 remove` first to move it"
                    )
                }
                guard let tcti = try TPMChoice.on.tcti(device: target.tpm2Device) else { return }
                let storeID = kb.file.storeID
                let sealer = try TPMSealer.enroll(tcti: tcti, deviceKey: dk, storeID: storeID, pcrs: try tpm.pcrs())
                let choice = try tpm.lockoutChoice()
                defer { if case .given(let k) = choice { k.wipe() } }
                try sealer.checkLockout(choice)
                let others = kb.devicesWithout(keySet: kb.currentKeySet + 1)
                let fresh = try makesNewKeySet(others: others)
                let recovery =
                    fresh && kb.hasRecoveryKey
                    ? try RecoveryKeyOutput.read(file: recoveryKeyFile, fromStdin: passcodeStdin) : nil
                defer { recovery?.wipe() }
                let code = try passcode()
                guard fresh else {
                    let keys = try kb.openAllCounted(passcode: code, deviceKey: dk)
                    defer { keys.wipe() }
                    try kb.moveToSealer(sealer, passcode: code, deviceKey: dk)
                    try sealer.takeLockout(choice, sets: keys.sets, storeID: storeID)
                    print("bound this device's passcode to the TPM at \(tcti) (enrollment \(sealer.path))")
                    print("  key sets kept (--keep-key-set): a copy of this keybag from before still opens every file")
                    print("  " + TPMEnrollOptions.lockoutReport(sealer))
                    return
                }
                var moved: StoreRewrap.Result?
                let set = try kb.enrollTPM(sealer, passcode: code, deviceKey: dk, recovery: recovery) { keys in
                    if others.isEmpty {
                        var rewrap = StoreRewrap(storePath: target.store, keys: keys)
                        moved = try rewrap.run()
                    }
                    try sealer.takeLockout(choice, sets: keys.sets, storeID: storeID)
                }
                print("bound this device's passcode to the TPM at \(tcti) (enrollment \(sealer.path))")
                if !sealer.pcrs.isEmpty {
                    print("  bound to PCRs \(sealer.pcrs.map(String.init).joined(separator: ",")) (SHA-256)")
                }
                print(
                    "  new key set \(set): a keybag copied before this enrollment opens no file written or rewrapped since"
                )
                if let moved {
                    print(
                        "  files rewrapped for it: \(moved.rewrapped) (\(moved.current) already were, \(moved.skipped) skipped)"
                    )
                } else {
                    print(
                        "  files kept on their key sets: other devices (\(others.joined(separator: ", "))) take up the new "
                            + "set with `keybagfs recover`; then `keybagfs rewrap \(target.store)` moves every file to it"
                    )
                }
                print("  " + TPMEnrollOptions.lockoutReport(sealer))
            }
        }
    }

    /// `keybagfs tpm2 clear-lockout`.
    struct ClearLockout: ParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "clear-lockout",
            abstract: "End the TPM's dictionary-attack lockout with the recovery key (store unmounted).",
            discussion: """
                Where keybagfs keeps the TPM's lockout authorization (set at enrollment), the recovery key opens it \
                and the lockout ends: the TPM's counter goes back to 0. Wrong recovery keys are throttled. The \
                recovery key is read from --recovery-key-file, or the first line of stdin with --stdin, or asked.
                """)

        @OptionGroup var target: UnmountedStore

        @Option(help: "Read the recovery key from this file's first line.")
        var recoveryKeyFile: String?

        @Flag(help: "Read the recovery key as one line from standard input.")
        var stdin = false

        func run() throws {
            let lock = try lockUnmountedStore(target.store)
            defer { close(lock) }
            var (kb, dk) = try target.deviceKeybag()
            defer { dk.wipe() }
            guard let sealer = kb.sealer as? TPMSealer else {
                throw KeybagError.invalid("this device's passcode is not bound to a TPM")
            }
            let recovery = try RecoveryKeyOutput.read(file: recoveryKeyFile, fromStdin: stdin)
            defer { recovery.wipe() }
            let keys = try kb.escrowedKeysCounted(recovery: recovery)
            defer { keys.wipe() }
            do { try sealer.clearLockout(sets: keys.sets, storeID: kb.file.storeID) } catch TPMError.lockout {
                let wait = (try? sealer.lockoutState().lockoutRecovery) ?? 0
                throw KeybagError.invalid(
                    "the TPM refuses its lockout authorization for \(wait) s after a wrong one was tried (someone tried "
                        + "to clear the lockout without it); run this again after that")
            }
            print("the TPM's lockout is cleared: its counter is back to 0")
        }
    }

    /// `keybagfs tpm2 remove`.
    struct Remove: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Unbind this device's passcode from its TPM (its NV counter is released, its file removed).",
            discussion: "The passcode is asked (or read from stdin with --passcode-stdin); a wrong one counts.")

        @OptionGroup var target: UnmountedStore

        @Flag(help: "Read the passcode as one line from standard input.")
        var passcodeStdin = false

        func run() throws {
            try TPMCommand.moving(target, passcodeStdin: passcodeStdin) { kb, dk, passcode in
                guard let old = kb.sealer as? TPMSealer else {
                    throw KeybagError.invalid("this device's passcode is not bound to a TPM")
                }
                let code = try passcode()
                let keys = try kb.openAllCounted(passcode: code, deviceKey: dk)
                defer { keys.wipe() }
                try kb.moveToSealer(nil, passcode: code, deviceKey: dk)
                let released = (try? old.releaseLockout(sets: keys.sets, storeID: kb.file.storeID)) ?? false
                try old.remove()
                print("this device's passcode is no longer bound to the TPM at \(old.tcti)")
                print(
                    "  warning: this keybag can now be guessed off this machine: whoever copies it with the device key "
                        + "tries passcodes at one Argon2id each, on as many computers as they like, with no lockout")
                if released { print("  the TPM's lockout authorization, which keybagfs had set, is empty again") }
            }
        }
    }
}
