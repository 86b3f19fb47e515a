import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// The store and device key of a command on an unmounted store.
struct UnmountedStore: ParsableArguments {
    @Argument(help: "The store directory (not mounted).")
    var store: String

    @Option(help: "Device key file (default /var/lib/keybagfs/<store-id>.key).")
    var deviceKey: String?

    @Option(help: "The TPM's TCTI when it is not the one this device enrolled (e.g. swtpm:host=127.0.0.1,port=2321).")
    var tpm2Device: String?

    /// The device key path for a keybag.
    func deviceKeyPath(_ kb: Keybag) -> String { deviceKey ?? DeviceKeyFile.defaultPath(storeID: kb.file.storeID) }

    /// The device key and its device's keybag (with its TPM, when bound to one), refused when
    /// rolled back below the key set its device held or below its TPM's counter (the caller
    /// wipes the key).
    func deviceKeybag() throws -> (Keybag, SecureKey) {
        let dkPath = deviceKeyPath(try Keybag.load(storePath: store))
        let dk = try DeviceKeyFile.load(from: dkPath)
        do {
            var kb = try Keybag.load(storePath: store, deviceKey: dk)
            try KeySetFloor.check(kb, deviceID: try DeviceIdentity.id(deviceKey: dk, storeID: kb.file.storeID))
            try TPMBinding.attach(&kb, tcti: tpm2Device, deviceKey: dk)
            return (kb, dk)
        } catch { dk.wipe(); throw error }
    }

    /// Runs `body` on the store locked against a daemon, with the device's keybag and key
    /// (`deviceKeybag`); the key is wiped and the lock let go after.
    func withDeviceKeybag<R>(_ body: (inout Keybag, SecureKey) throws -> R) throws -> R {
        let lock = try lockUnmountedStore(store)
        defer { close(lock) }
        var (kb, dk) = try deviceKeybag()
        defer { dk.wipe() }
        return try body(&kb, dk)
    }
}

/// `--recovery-key-file`, of the commands that read the store's recovery key.
struct RecoveryKeySource: ParsableArguments {
    @Option(help: "Read the recovery key from this file's first line.")
    var recoveryKeyFile: String?

    /// The recovery key: from the file, else from stdin (`fromStdin`) or the terminal.
    func read(fromStdin: Bool) throws -> RecoveryKey {
        try RecoveryKeyOutput.read(file: recoveryKeyFile, fromStdin: fromStdin)
    }
}

/// Hands a new recovery key to the user: into a new 0600 file, or printed once.
enum RecoveryKeyOutput {
    static func give(_ recovery: RecoveryKey, file: String?) throws {
        let text = try recovery.text()
        defer { text.wipe() }
        if let file {
            let fd = open(file, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
            guard fd >= 0 else { throw KeybagError.system("cannot create the recovery key file \(file)", errno) }
            defer { close(fd) }
            let ok =
                try text.withBytes { t in write(fd, t.baseAddress!, t.count) == t.count } && write(fd, "\n", 1) == 1
                && fsync(fd) == 0
            guard ok else { throw KeybagError.system("cannot write the recovery key file \(file)", errno) }
            print(
                "recovery key: written to \(file)  (keep it offline; it opens the store without passcode and device "
                    + "key)"
            )
            return
        }
        // Every byte must reach stdout, or the caller saves nothing (a closed pipe is an error, not a signal).
        signal(SIGPIPE, SIG_IGN)
        let intro =
            "recovery key (shown once; keep it offline, it opens the store without passcode and device key):\n    "
        func put(_ p: UnsafeRawPointer, _ n: Int) -> Bool {
            var off = 0
            while off < n {
                let w = write(1, p + off, n - off)
                if w < 0 && errno == EINTR { continue }
                if w <= 0 { return false }
                off += w
            }
            return true
        }
        fflush(nil)
        let ok =
            try Array(intro.utf8).withUnsafeBytes { put($0.baseAddress!, $0.count) }
            && text.withBytes { put($0.baseAddress!, $0.count) } && put("\n", 1)
        guard ok else {
            throw KeybagError.system("cannot show the recovery key on standard output; nothing was changed", errno)
        }
    }

    /// Reads a recovery key from a file's first line, from stdin, or from the terminal.
    static func read(file: String?, fromStdin: Bool) throws -> RecoveryKey {
        let text: SecureKey
        if let file {
            let fd = open(file, O_RDONLY | O_CLOEXEC)
            guard fd >= 0 else { throw KeybagError.system("cannot read the recovery key file \(file)", errno) }
            defer { close(fd) }
            guard let t = try PasscodeInput.readLine(fd: fd) else {
                throw KeybagError.invalid("the recovery key file \(file) is empty")
            }
            text = t
        } else {
            text = try PasscodeInput.read(fromStdin: fromStdin, prompt: "Recovery key: ")
        }
        defer { text.wipe() }
        return try RecoveryKey.parse(text)
    }
}

/// Takes the store's lock the daemon holds while mounted; refuses a mounted store.
func lockUnmountedStore(_ store: String) throws -> Int32 {
    let lock = open(store, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    guard lock >= 0 else {
        throw KeybagError.invalid("cannot open the store \(store): \(String(cString: strerror(errno)))")
    }
    do {
        try StoreLock.acquire(fd: lock) { FileHandle.standardError.write(Data(("keybagfs: " + $0 + "\n").utf8)) }
    } catch let refusal as StoreLock.Refusal {
        close(lock)
        let who: String
        switch refusal {
        case .heldByLiveProcess(let pid): who = pid.map { " (pid \($0))" } ?? ""
        case .exitingHolderStayed(let pid): who = " (pid \(pid), exiting for \(Int(StoreLock.exitingHolderWait)) s)"
        }
        throw KeybagError.invalid("the store \(store) is mounted (a keybagfs daemon holds it\(who)); unmount it first")
    } catch {
        close(lock)
        throw error
    }
    return lock
}
