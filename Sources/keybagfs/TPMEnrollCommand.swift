import ArgumentParser
import Foundation
import KeybagCLI
import KeybagCore

extension TPMCommand {
    /// `keybagfs tpm2 enroll`: this device's passcode bound to its TPM, a new key set, every file
    /// rewrapped for it and the TPM's lockout taken; run again, it finishes an enrollment cut short.
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
                sets a random one (see --tpm2-lockout-auth-file, --tpm2-accept-clearable-lockout). Run again on a \
                device already bound, it finishes what a cut run left (the lockout, the rewrap). The TPM's file \
                goes to /var/lib/keybagfs/DEVICEID.tpm2 ($STATE_DIRECTORY), never into the store. The TPM is \
                --tpm2-device, else /dev/tpmrm0.
                """)

        @OptionGroup var target: UnmountedStore

        @OptionGroup var tpm: TPMEnrollOptions

        @Flag(help: "Read the passcode as one line from standard input.")
        var passcodeStdin = false

        @OptionGroup var recoveryKey: RecoveryKeySource

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
                let choice = try tpm.lockoutChoice()
                defer { if case .given(let k) = choice { k.wipe() } }
                if let current = kb.sealer as? TPMSealer {
                    return try finish(&kb, dk, current, choice, passcode)
                }
                guard let tcti = try TPMChoice.on.tcti(device: target.tpm2Device) else { return }
                let sealer = try TPMSealer.enroll(
                    tcti: tcti, deviceKey: dk, storeID: kb.file.storeID, pcrs: try tpm.pcrs())
                try sealer.checkLockout(choice)
                let others = KeySets.devicesWithout(kb, keySet: kb.currentKeySet + 1)
                guard try makesNewKeySet(others: others) else {
                    let code = try passcode()
                    let keys = try PasscodeAttempts.openAllCounted(&kb, passcode: code, deviceKey: dk)
                    defer { keys.wipe() }
                    try TPMBinding.moveToSealer(&kb, sealer, passcode: code, deviceKey: dk)
                    try sealer.takeLockout(choice, sets: keys.sets, storeID: kb.file.storeID)
                    report(sealer, set: nil, moved: nil, others: others)
                    return
                }
                let recovery = kb.hasRecoveryKey ? try recoveryKey.read(fromStdin: passcodeStdin) : nil
                defer { recovery?.wipe() }
                var moved: StoreRewrap.Result?
                let storeID = kb.file.storeID
                // Written with the enrollment's first seal, before the keybag's save: a cut after
                // that save leaves the rewrap owed, and a second run does it.
                if others.isEmpty { sealer.notePendingRewrap(kb.currentKeySet + 1) }
                let set = try TPMBinding.enroll(
                    &kb, sealer, passcode: try passcode(), deviceKey: dk, recovery: recovery
                ) {
                    keys in
                    // The lockout first: the rewrap is the long part, where a cut is likeliest.
                    Failpoint.enrollBeforeLockout.hit()
                    try sealer.takeLockout(choice, sets: keys.sets, storeID: storeID)
                    if others.isEmpty { moved = try Self.rewrap(target.store, keys, sealer) }
                }
                report(sealer, set: set, moved: moved, others: others)
            }
        }

        /// Every file moved to the newest set, the enrollment saying so until it is done.
        static func rewrap(_ store: String, _ keys: StoreKeys, _ sealer: TPMSealer) throws -> StoreRewrap.Result {
            try sealer.setPendingRewrap(keys.current)
            var rewrap = StoreRewrap(storePath: store, keys: keys)
            let r = try rewrap.run()
            try sealer.setPendingRewrap(nil)
            return r
        }

        /// A device already bound to `sealer`: finishes what a cut enrollment left (the TPM's lockout;
        /// the new key set a cut `recover` had not made yet; the rewrap), or refuses when nothing is left.
        func finish(
            _ kb: inout Keybag, _ dk: SecureKey, _ sealer: TPMSealer, _ choice: TPMLockoutChoice,
            _ passcode: () throws -> SecureKey
        ) throws {
            let lockout = try sealer.lockoutUnfinished()
            let owed = sealer.pendingRewrap
            guard lockout || owed != nil else {
                throw KeybagError.invalid(
                    "this device is already bound to the TPM at \(sealer.tcti); `keybagfs tpm2 remove` first to move it"
                )
            }
            if lockout { try sealer.checkLockout(choice) }
            let newSet = owed.map { $0 > kb.currentKeySet } ?? false
            let recovery = newSet && kb.hasRecoveryKey ? try recoveryKey.read(fromStdin: passcodeStdin) : nil
            defer { recovery?.wipe() }
            let code = try passcode()
            if newSet { _ = try KeySets.start(&kb, passcode: code, deviceKey: dk, recovery: recovery) }
            let keys = try PasscodeAttempts.openAllCounted(&kb, passcode: code, deviceKey: dk)
            defer { keys.wipe() }
            if lockout { try sealer.takeLockout(choice, sets: keys.sets, storeID: kb.file.storeID) }
            let behind = KeySets.devicesWithout(kb, keySet: keys.current)
            let moved = owed != nil && behind.isEmpty ? try Self.rewrap(target.store, keys, sealer) : nil
            print("finished this device's enrollment on the TPM at \(sealer.tcti)")
            if let moved { print("  files rewrapped for key set \(keys.current): \(moved.rewrapped)") }
            if owed != nil && !behind.isEmpty {
                print("  files not rewrapped: \(behind.joined(separator: ", ")) lack key set \(keys.current)")
            }
            print("  " + TPMEnrollOptions.lockoutReport(sealer))
        }

        /// What the enrollment did, for people.
        func report(_ sealer: TPMSealer, set: Int?, moved: StoreRewrap.Result?, others: [String]) {
            print("bound this device's passcode to the TPM at \(sealer.tcti) (enrollment \(sealer.path))")
            if !sealer.pcrs.isEmpty {
                print("  bound to PCRs \(sealer.pcrs.map(String.init).joined(separator: ",")) (SHA-256)")
            }
            if let set {
                print(
                    "  new key set \(set): a keybag copied before this enrollment opens no file written or rewrapped since"
                )
            } else {
                print("  key sets kept (--keep-key-set): a copy of this keybag from before still opens every file")
            }
            if let moved {
                print(
                    "  files rewrapped for it: \(moved.rewrapped) (\(moved.current) already were, \(moved.skipped) skipped)"
                )
            } else if set != nil {
                print(
                    "  files kept on their key sets: other devices (\(others.joined(separator: ", "))) take up the new "
                        + "set with `keybagfs recover`; then `keybagfs rewrap \(target.store)` moves every file to it")
            }
            print("  " + TPMEnrollOptions.lockoutReport(sealer))
            print(
                "  the passcode is the one you had: a copy of the keybag from before can still be guessed for it "
                    + "offline; change it (`keybagctl passwd`) if such copies may exist")
        }
    }
}
