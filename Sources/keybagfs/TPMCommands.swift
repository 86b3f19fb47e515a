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
        subcommands: [Enroll.self, Remove.self, Helper.self])

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

    /// Says so when the TPM's lockout authorization is empty (root can then clear its lockout).
    static func warnIfLockoutIsOpen(_ sealer: TPMSealer) {
        guard let st = try? sealer.lockoutState(), !st.lockoutAuthSet else { return }
        print(
            "  warning: the TPM's lockout authorization is empty, so any root user can clear its lockout and keep "
                + "guessing; set one with `tpm2_changeauth -c lockout` (keep it apart from this machine)")
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
                The passcode is asked (or read from stdin with --passcode-stdin); a wrong one counts. A random secret is \
                sealed in the TPM behind an authorization derived from the passcode, and the class keys are rewrapped \
                under a key that needs it. The TPM's file goes to /var/lib/keybagfs/DEVICEID.tpm2 ($STATE_DIRECTORY), never \
                into the store. \
                The TPM is --tpm2-device, else /dev/tpmrm0.
                """)

        @OptionGroup var target: UnmountedStore

        @Flag(help: "Read the passcode as one line from standard input.")
        var passcodeStdin = false

        func run() throws {
            try TPMCommand.moving(target, passcodeStdin: passcodeStdin) { kb, dk, passcode in
                if let current = kb.sealer as? TPMSealer {
                    throw KeybagError.invalid(
                        "this device is already bound to the TPM at \(current.tcti); `keybagfs tpm2 remove` first to move it"
                    )
                }
                guard let tcti = try TPMChoice.on.tcti(device: target.tpm2Device) else { return }
                let sealer = try TPMSealer.enroll(tcti: tcti, deviceKey: dk, storeID: kb.file.storeID)
                try kb.moveToSealer(sealer, passcode: try passcode(), deviceKey: dk)
                print("bound this device's passcode to the TPM at \(tcti) (enrollment \(sealer.path))")
                TPMCommand.warnIfLockoutIsOpen(sealer)
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
                try kb.moveToSealer(nil, passcode: try passcode(), deviceKey: dk)
                try old.remove()
                print("this device's passcode is no longer bound to the TPM at \(old.tcti)")
            }
        }
    }
}
