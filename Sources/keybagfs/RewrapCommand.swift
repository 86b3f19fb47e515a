import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore

/// `keybagfs rewrap`: every file of the store moved to its newest key set.
struct Rewrap: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Rewrap every file's key for the store's newest key set (store unmounted).",
        discussion: """
            No content is re-encrypted: each file's key is wrapped again for the newest key set, and the older \\
            wrap erased, so keys of older sets (a keybag copied before a TPM enrollment) open none of them. \\
            Crash-safe; run it again to finish a run that was cut. Refused while another device of the store lacks \\
            the newest set (it could open no rewrapped file): run `keybagfs recover` on it first. The passcode is \\
            asked (or one line of stdin with --passcode-stdin); a wrong one counts.
            """)

    @OptionGroup var target: UnmountedStore

    @Flag(help: "Read the passcode as one line from standard input.")
    var passcodeStdin = false

    func run() throws {
        try target.withDeviceKeybag { kb, dk in
            let behind = KeySets.devicesWithout(kb, keySet: kb.currentKeySet)
            guard behind.isEmpty else {
                throw KeybagError.invalid(
                    "devices \(behind.joined(separator: ", ")) lack key set \(kb.currentKeySet) and could open no "
                        + "rewrapped file: run `keybagfs recover` on each first; nothing was changed")
            }
            let passcode = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Passcode: ")
            defer { passcode.wipe() }
            let keys = try PasscodeAttempts.openAllCounted(&kb, passcode: passcode, deviceKey: dk)
            defer { keys.wipe() }
            let start = Date()
            var rewrap = StoreRewrap(storePath: target.store, keys: keys) {
                FileHandle.standardError.write(Data("  \($0) files…\n".utf8))
            }
            let r = try rewrap.run()
            try (kb.sealer as? TPMSealer)?.setPendingRewrap(nil)
            print(
                "rewrapped \(r.rewrapped) files for key set \(keys.current) (\(r.current) already were, \(r.skipped) "
                    + "skipped: fsck names them) in \(String(format: "%.1f", Date().timeIntervalSince(start))) s")
        }
    }
}
