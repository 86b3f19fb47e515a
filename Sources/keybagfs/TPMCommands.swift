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
        try target.withDeviceKeybag { kb, dk in
            var read: SecureKey?
            defer { read?.wipe() }
            try body(&kb, dk) {
                let p = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Passcode: ")
                read = p
                return p
            }
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

        @OptionGroup var recoveryKey: RecoveryKeySource

        @Flag(help: "Read the recovery key as one line from standard input.")
        var stdin = false

        func run() throws {
            try target.withDeviceKeybag { kb, dk in
                guard let sealer = kb.sealer as? TPMSealer else {
                    throw KeybagError.invalid("this device's passcode is not bound to a TPM")
                }
                let recovery = try recoveryKey.read(fromStdin: stdin)
                defer { recovery.wipe() }
                let keys = try RecoveryEscrow.keysCounted(&kb, recovery: recovery)
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
                let keys = try PasscodeAttempts.openAllCounted(&kb, passcode: code, deviceKey: dk)
                defer { keys.wipe() }
                // The lockout authorization first: while the TPM refuses it, nothing changes (the
                // enrollment, which keeps it, stays).
                let released = try old.releaseLockout(sets: keys.sets, storeID: kb.file.storeID)
                try TPMBinding.moveToSealer(&kb, nil, passcode: code, deviceKey: dk)
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
