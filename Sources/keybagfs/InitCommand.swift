import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// `keybagfs init`.
struct Init: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Create a new store: keybag, class keys and the device key.",
        discussion:
            "The passcode is asked on the terminal (twice), or read as one line from stdin with --passcode-stdin. It "
            + "is never taken from the command line."
    )

    @Argument(help: "The store directory to create (must be absent or empty).")
    var store: String

    @Flag(help: "Read the passcode as one line from standard input.")
    var passcodeStdin = false

    @Option(help: "Device key file (default /var/lib/keybagfs/<store-id>.key). An existing 32-byte key is reused.")
    var deviceKey: String?

    @Option(help: "Argon2id cost: interactive, moderate or sensitive.")
    var kdf: KDFStrength = .moderate

    @Option(
        help: ArgumentHelp(
            "Bind the passcode to this machine's TPM 2.0: auto (when one is present), on (required) or off. With a "
                + "TPM no passcode can be tried off this machine, and the TPM's lockout counts every wrong one."))
    var tpm2: TPMChoice = .auto

    @Option(help: "The TPM's TCTI (default device:/dev/tpmrm0), e.g. swtpm:host=127.0.0.1,port=2321.")
    var tpm2Device: String?

    @OptionGroup var tpm: TPMEnrollOptions

    @Option(
        help: ArgumentHelp(
            "Content cipher: xaes256gcm (the default where the CPU has AES instructions), xchacha20poly1305 (the "
                + "default elsewhere) or aes256gcm (at most 2^32 block writes per file key; for compatibility only).")
    )
    var cipher: ContentCipher = .default

    @Option(help: "Write the recovery key to this new file (mode 0600) instead of printing it.")
    var recoveryKeyFile: String?

    @Flag(help: "Make no recovery key: a lost passcode or device key then loses the store.")
    var noRecoveryKey = false

    func run() throws {
        let fm = FileManager.default
        var isDir: ObjCBool = false
        if fm.fileExists(atPath: store, isDirectory: &isDir) {
            guard isDir.boolValue else { throw KeybagError.invalid("\(store) exists and is not a directory") }
            // A sync engine's own files (Syncthing's `.stfolder`, `.stignore`, `.stversions`) may be
            // there already: the folder was shared first and is initialised second.
            let items = try fm.contentsOfDirectory(atPath: store).filter {
                SyncEngineFile(backing: $0)?.role != .folderFile
            }
            guard items.isEmpty else {
                throw KeybagError.invalid(
                    "\(store) is not empty (\(items.sorted().prefix(3).joined(separator: ", "))"
                        + (items.count > 3 ? ", …" : "") + "); refusing to initialise over existing data")
            }
        } else {
            try fm.createDirectory(
                atPath: store, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        }
        let passcode = try PasscodeInput.readNew(
            fromStdin: passcodeStdin, prompt: "New passcode: ", mismatch: "the passcodes differ; nothing was created")
        defer { passcode.wipe() }
        let storeID = Sodium.randomArray(16).map { String(format: "%02x", $0) }.joined()
        let dkPath = deviceKey ?? DeviceKeyFile.defaultPath(storeID: storeID)
        let dk =
            fm.fileExists(atPath: dkPath) ? try DeviceKeyFile.load(from: dkPath) : try DeviceKeyFile.create(at: dkPath)
        defer { dk.wipe() }
        guard cipher.isAvailable else { throw KeybagError.invalid("this CPU cannot run \(cipher.name)") }
        guard !(noRecoveryKey && recoveryKeyFile != nil) else {
            throw ValidationError("--no-recovery-key and --recovery-key-file exclude each other")
        }
        let tcti = try tpm2.tcti(device: tpm2Device)
        let sealer = try tcti.map {
            try TPMSealer.enroll(tcti: $0, deviceKey: dk, storeID: storeID, pcrs: try tpm.pcrs())
        }
        let choice = try tpm.lockoutChoice()
        defer { if case .given(let k) = choice { k.wipe() } }
        try sealer?.checkLockout(choice)
        let recovery = noRecoveryKey ? nil : RecoveryKey.generate()
        defer { recovery?.wipe() }
        // The recovery key is handed out first: if that fails, no store exists whose key nobody has.
        if let recovery { try RecoveryKeyOutput.give(recovery, file: recoveryKeyFile) }
        let kb = try Keybag.create(
            storePath: store, storeID: storeID, passcode: passcode, deviceKey: dk, strength: kdf, cipher: cipher,
            recovery: recovery, deviceName: ProcessInfo.processInfo.hostName, sealer: sealer
        ) { sets in try sealer?.takeLockout(choice, sets: sets, storeID: storeID) }
        try fm.createDirectory(
            atPath: store + "/" + Keybag.dataDirName, withIntermediateDirectories: false,
            attributes: [.posixPermissions: 0o755])
        print("initialised store \(store)")
        print("  store id:   \(kb.file.storeID)")
        print("  cipher:     \(kb.file.cipher)")
        print("  device id:  \(kb.file.deviceID ?? "")")
        print("  device key: \(dkPath)  (keep it; without it the store cannot be opened)")
        if let sealer { TPMEnrollOptions.report(sealer) }
    }
}
