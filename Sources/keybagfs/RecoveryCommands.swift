import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// `keybagfs recover`.
struct Recover: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract:
            "Set a new passcode (and, if asked, a new device key) from the recovery key; the store must not be "
            + "mounted.",
        discussion: """
            The recovery key is read from --recovery-key-file, or as the first line of stdin with --stdin \
            (the new passcode is then the second line), or asked on the terminal. No file is re-encrypted. \
            With --new-device-key a new device key is written (to --device-key or the default path; an \
            existing file there is replaced) and the old one stops working. Wrong recovery keys are \
            throttled like passcodes. The recovery key stays valid; replace it with `keybagfs recovery-key rotate`.
            """)

    @OptionGroup var target: UnmountedStore

    @Flag(help: "Write a new device key instead of using the existing one (when it was lost).")
    var newDeviceKey = false

    @OptionGroup var recoveryKey: RecoveryKeySource

    @Flag(help: "Read the recovery key (unless --recovery-key-file) and then the new passcode as lines from stdin.")
    var stdin = false

    @Flag(help: "With --new-device-key on a store of several devices: this is the device that made the store.")
    var firstDevice = false

    @Option(
        help: ArgumentHelp(
            "Bind the new passcode to this machine's TPM 2.0 (re-enrolls a cleared or replaced one): auto (the TPM "
                + "of --tpm2-device, of the current enrollment, or /dev/tpmrm0, when present), on, or off."))
    var tpm2: TPMChoice = .auto

    @OptionGroup var tpm: TPMEnrollOptions

    /// The TPM the recovered passcode is bound to (nil: none), for `deviceKey`, its lockout
    /// choice checked; PCRs those of the current enrollment unless --tpm2-pcrs.
    func sealer(
        deviceKey: SecureKey, storeID: String, choice: TPMLockoutChoice, previousDeviceID: String? = nil
    ) throws -> TPMSealer? {
        let path = TPMEnrollment.path(deviceID: try DeviceIdentity.id(deviceKey: deviceKey, storeID: storeID))
        let current = (try? TPMEnrollment.load(from: path)).flatMap { $0 }
        guard let tcti = try tpm2.tcti(device: target.tpm2Device ?? current?.tcti) else { return nil }
        let sealer = try TPMSealer.enroll(
            tcti: tcti, deviceKey: deviceKey, storeID: storeID, pcrs: try tpm.pcrs(fallback: current?.pcrs ?? []),
            previousDeviceID: previousDeviceID)
        try sealer.checkLockout(choice)
        return sealer
    }

    /// Takes the TPM's lockout as chosen, with the recovered keys (nothing without a TPM).
    static func takeLockout(_ kb: Keybag, _ choice: TPMLockoutChoice, _ keys: StoreKeys) throws {
        guard let sealer = kb.sealer as? TPMSealer else { return }
        try sealer.takeLockout(choice, sets: keys.sets, storeID: kb.file.storeID)
    }

    /// The keybag holding the most key sets the recovery key opens (a device that missed a
    /// removal takes up its new set from there); nil when none opens (`recover` counts that).
    static func escrowSource(_ store: String, _ recovery: RecoveryKey) -> Keybag? {
        guard let (kb, keys) = try? StoreDevices.escrowSource(storePath: store, recovery: recovery) else { return nil }
        keys.wipe()
        return kb
    }

    func run() throws {
        let lock = try lockUnmountedStore(target.store)
        defer { close(lock) }
        let kb = try Keybag.load(storePath: target.store)
        let dkPath = target.deviceKeyPath(kb)
        let wait = PasscodeAttempts.recoveryRetryAfter(kb, now: Date().timeIntervalSince1970)
        guard wait == 0 else { throw KeybagError.throttled(retryAfter: wait) }
        let recovery = try recoveryKey.read(fromStdin: stdin)
        defer { recovery.wipe() }
        let passcode = try PasscodeInput.readNew(
            fromStdin: stdin, prompt: "New passcode: ", mismatch: "the passcodes differ; nothing was changed")
        defer { passcode.wipe() }
        let choice = try tpm.lockoutChoice()
        defer { if case .given(let k) = choice { k.wipe() } }
        if newDeviceKey {
            try recoverWithNewDeviceKey(dkPath, recovery: recovery, passcode: passcode, choice: choice)
        } else {
            try recoverWithDeviceKey(dkPath, recovery: recovery, passcode: passcode, choice: choice)
        }
    }

    /// Recovery that makes a new device key: the new key is written (and its folder synced)
    /// under a staged name, the keybag is saved, then the key is renamed into place and the
    /// folder synced again. A crash after the keybag save leaves the store needing
    /// `<key>.new`: rename it, or run `recover` again (the recovery key stays valid).
    private func recoverWithNewDeviceKey(
        _ dkPath: String, recovery: RecoveryKey, passcode: SecureKey, choice: TPMLockoutChoice
    ) throws {
        var lst = stat()
        if lstat(dkPath, &lst) == 0 && lst.st_mode & S_IFMT == S_IFLNK {
            throw KeybagError.invalid("\(dkPath) is a symlink; give the path it points to with --device-key")
        }
        guard FileManager.default.fileExists(atPath: target.store + "/" + Keybag.fileName) else {
            throw KeybagError.invalid(
                "the device that made this store was removed; add this device again with `keybagfs device add` "
                    + "and a new device key")
        }
        let others = StoreDevices.list(storePath: target.store).contains { $0.keybag != Keybag.fileName }
        guard firstDevice || !others else {
            throw KeybagError.invalid(
                "this store has several devices and a new device key takes over the keybag of the device that "
                    + "made it: add --first-device if this is that device; any other device is added again with "
                    + "`keybagfs device add` and a new device key, and its old id removed")
        }
        var kb = try Keybag.load(storePath: target.store, relativePath: Keybag.fileName)
        let wasBound = kb.file.tpm2 == true
        let staged = dkPath + ".new"
        unlink(staged)
        let dk = try DeviceKeyFile.create(at: staged)
        defer { dk.wipe() }
        var lockoutFailure: Error?
        do {
            kb.sealer = try sealer(
                deviceKey: dk, storeID: kb.file.storeID, choice: choice, previousDeviceID: kb.file.deviceID)
            Self.noteOwedRewrap(kb, wasBound: wasBound)
            let taken = kb
            try RecoveryEscrow.recover(
                &kb,
                with: recovery, newPasscode: passcode, deviceKey: dk,
                escrowFrom: Self.escrowSource(target.store, recovery)
            ) { keys in
                // The keybag is saved for the new key by now: a refused lockout must not cost it.
                do { try Self.takeLockout(taken, choice, keys) } catch { lockoutFailure = error }
            }
        } catch {
            unlink(staged)
            throw error
        }
        guard rename(staged, dkPath) == 0 else {
            throw KeybagError.system(
                "the store now needs the device key \(staged); moving it to \(dkPath) failed", errno)
        }
        DeviceKeyFile.syncFolder(of: dkPath)
        print(
            "recovered \(target.store): new passcode set; new device key \(dkPath) (the old one no longer opens "
                + "the store)"
        )
        if let lockoutFailure { throw lockoutFailure }
        if !wasBound { try Self.newKeySetIfBound(&kb, passcode: passcode, deviceKey: dk, recovery: recovery) }
    }

    /// A keybag about to be bound to a TPM it was not bound to owes a new key set and a rewrap
    /// (`newKeySetIfBound`): noted in the enrollment, which its first seal writes before the
    /// keybag's save, so a cut in between is finished by `tpm2 enroll` run again.
    static func noteOwedRewrap(_ kb: Keybag, wasBound: Bool) {
        guard !wasBound, let sealer = kb.sealer as? TPMSealer,
            KeySets.devicesWithout(kb, keySet: kb.currentKeySet + 1).isEmpty
        else { return }
        sealer.notePendingRewrap(kb.currentKeySet + 1)
    }

    /// Recovery with this device's key: a new passcode, the same device key.
    private func recoverWithDeviceKey(
        _ dkPath: String, recovery: RecoveryKey, passcode: SecureKey, choice: TPMLockoutChoice
    ) throws {
        let dk: SecureKey
        do { dk = try DeviceKeyFile.load(from: dkPath) } catch {
            throw KeybagError.invalid("\(error); if the device key is lost, run again with --new-device-key")
        }
        defer { dk.wipe() }
        var kb: Keybag
        do {
            kb = try Keybag.load(storePath: target.store, deviceKey: dk)
            try kb.unwrapDeviceKeySlot("D", deviceKey: dk).wipe()
        } catch KeybagError.badDeviceKey {
            throw KeybagError.invalid(
                "the device key \(dkPath) does not open this store; if the right one is lost, run again with "
                    + "--new-device-key"
            )
        }
        _ = try? kb.authenticate(deviceKey: dk)
        let wasBound = kb.file.tpm2 == true
        kb.sealer = try sealer(deviceKey: dk, storeID: kb.file.storeID, choice: choice)
        Self.noteOwedRewrap(kb, wasBound: wasBound)
        let taken = kb
        var lockoutFailure: Error?
        try RecoveryEscrow.recover(
            &kb,
            with: recovery, newPasscode: passcode, deviceKey: dk,
            escrowFrom: Self.escrowSource(target.store, recovery)
        ) { keys in
            do { try Self.takeLockout(taken, choice, keys) } catch { lockoutFailure = error }
        }
        print("recovered \(target.store): new passcode set")
        if let lockoutFailure { throw lockoutFailure }
        if !wasBound { try Self.newKeySetIfBound(&kb, passcode: passcode, deviceKey: dk, recovery: recovery) }
    }

    /// A keybag that was not bound to a TPM before and is now (`recover` enrolled one): every copy
    /// of it from before is guessable off the TPM, so, as `tpm2 enroll` does, a new key set and
    /// every file rewrapped for it (on a store of one device; on several, the sets stay and it says so).
    static func newKeySetIfBound(
        _ kb: inout Keybag, passcode: SecureKey, deviceKey: SecureKey, recovery: RecoveryKey
    ) throws {
        let others = KeySets.devicesWithout(kb, keySet: kb.currentKeySet + 1)
        guard others.isEmpty else {
            print(
                "  note: the key sets stay (other devices: \(others.joined(separator: ", "))), so a copy of this "
                    + "device's keybag from before still opens today's files; `keybagfs tpm2 remove` then `tpm2 enroll "
                    + "--new-key-set` changes them")
            return
        }
        var moved = StoreRewrap.Result()
        let store = kb.storePath
        guard let sealer = kb.sealer as? TPMSealer else { return }
        let set = try KeySets.start(&kb, passcode: passcode, deviceKey: deviceKey, recovery: recovery) { keys in
            moved = try TPMCommand.Enroll.rewrap(store, keys, sealer)
        }
        print("  bound to the TPM: new key set \(set), \(moved.rewrapped) files rewrapped for it")
    }
}

/// `keybagfs recovery-key`.
struct RecoveryKeyCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "recovery-key",
        abstract: "Manage the store's recovery key.",
        subcommands: [Rotate.self])

    /// `keybagfs recovery-key rotate`.
    struct Rotate: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Make a new recovery key (the old one stops working); the store must not be mounted.",
            discussion:
                "Needs the passcode (asked on the terminal, or one line of stdin with --passcode-stdin) and the "
                + "device key, and on a store of several devices the current recovery key: the other devices take the "
                + "new key set up at their next unlock, so the old key opens nothing written afterwards. Also gives a "
                + "recovery key to a store made without one."
        )

        @OptionGroup var target: UnmountedStore

        @Flag(help: "Read the passcode as one line from standard input.")
        var passcodeStdin = false

        @Option(help: "Write the new recovery key to this new file (mode 0600) instead of printing it.")
        var recoveryKeyFile: String?

        @Option(help: "The current recovery key's file (needed on a store of several devices).")
        var currentRecoveryKeyFile: String?

        func run() throws {
            try target.withDeviceKeybag { kb, dk in
                let current = try currentRecoveryKeyFile.map { try RecoveryKeyOutput.read(file: $0, fromStdin: false) }
                defer { current?.wipe() }
                let passcode = try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Passcode: ")
                defer { passcode.wipe() }
                let recovery = try RecoveryEscrow.rotate(&kb, passcode: passcode, deviceKey: dk, current: current) {
                    try RecoveryKeyOutput.give($0, file: recoveryKeyFile)
                }
                defer { recovery.wipe() }
                print("new recovery key for \(target.store) saved; the old one no longer works")
            }
        }
    }
}
