import ArgumentParser
import Foundation
import Glibc
import KeybagCore

/// The steps of adding a device by approval, as the two commands run them.
enum DevicePairingCommand {
    /// `keybagfs device add --approval`: one step on the new machine.
    static func newcomer(
        store: String, deviceKeyPath: String, name: String, code: String?, stdin: Bool, kdf: KDFStrength, cancel: Bool
    ) throws {
        let dk =
            FileManager.default.fileExists(atPath: deviceKeyPath)
            ? try DeviceKeyFile.load(from: deviceKeyPath) : try DeviceKeyFile.create(at: deviceKeyPath)
        defer { dk.wipe() }
        let step = try DevicePairing.newcomerStep(
            storePath: store, deviceKey: dk, name: name, confirmedCode: code, strength: kdf, cancel: cancel,
            newPasscode: {
                try PasscodeInput.readNew(
                    fromStdin: stdin, prompt: "Passcode of this device: ",
                    mismatch: "the passcodes differ; nothing was changed")
            },
            passcode: { try PasscodeInput.read(fromStdin: stdin, prompt: "Passcode of this device (as given first): ") }
        )
        switch step {
        case .requested(let id):
            print("request written for device \(id)")
            print("next: on a device of the store, run `keybagfs device approve STORE \(id)`; then run this again")
        case .waitingForChallenge(let id):
            print("no answer yet from an approving device for \(id) (has the sync engine brought it?)")
        case .showCode(let id, let code):
            print("pairing code: \(code)")
            print(
                "next: type it on the approving device (`keybagfs device approve STORE \(id) --code \(code)`); when it "
                    + "accepts it, it shows a confirmation code: run this again with --code and that code")
        case .cancelled(let id):
            print("gave up the pairing of \(id): its request and secrets are gone")
        case .added(let id, let set):
            print("added this device to \(store) by approval")
            print("  device id:  \(id)")
            print("  keybag:     \(StoreDevices.keybagPath(id))")
            print("  key set:    \(set)")
            print("  device key: \(deviceKeyPath)")
        }
    }
}

extension DeviceCommand {
    /// `keybagfs device approve`.
    struct Approve: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Let a new machine join the store, from a device already in it (no recovery key).",
            discussion: """
                Run on a device of the store, with the store unmounted, after the new machine ran `keybagfs \
                device add --approval`; run it again after each of its steps. When the new machine shows its \
                code, give it with --code: if it is the code this pairing gives, this device's passcode (from \
                stdin with --stdin) opens the keys, which are sealed to the new machine with its certificate.
                """)

        @OptionGroup var target: UnmountedStore

        @Argument(help: "The new machine's device id, as its `device add --approval` printed it.")
        var id: String

        @Option(help: "The code the new machine shows.")
        var code: String?

        @Flag(help: "Read this device's passcode from stdin.")
        var stdin = false

        @Flag(help: "Give this pairing up: this device's challenge, grant and what it kept of the pairing go.")
        var cancel = false

        func run() throws {
            try target.withDeviceKeybag { kb, dk in
                let step = try DevicePairing.approveStep(&kb, id, code: code, deviceKey: dk, cancel: cancel) {
                    try PasscodeInput.read(fromStdin: stdin, prompt: "Passcode of this device: ")
                }
                switch step {
                case .challenged:
                    print("answered the request of \(id); next: run `keybagfs device add --approval` on it again")
                case .waitingForReveal:
                    print("waiting for the new machine's next step (has the sync engine brought it?)")
                case .needCode:
                    print("next: run this again with --code and the code the new machine shows")
                case .finished:
                    print(
                        "the pairing of \(id) is over (it joined, or was given up); this device's pairing files are removed"
                    )
                case .approved(let set, let confirmation):
                    print("approved device \(id) (key sets 0 to \(set))")
                    print("confirmation code: \(confirmation)")
                    print("next: on the new machine, `keybagfs device add STORE --approval --code \(confirmation)`")
                }
            }
        }
    }
}
