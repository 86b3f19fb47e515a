import ArgumentParser
import Foundation
import Glibc
import KeybagCore

/// The options of the commands that enroll a TPM (init, tpm2 enroll, recover, device add): the
/// PCRs the sealed secret is bound to and the choice about the TPM's lockout authorization.
struct TPMEnrollOptions: ParsableArguments {
    @Option(
        help: ArgumentHelp(
            "Bind the sealed secret to these PCRs of the SHA-256 bank, comma-separated (e.g. 7, the Secure Boot "
                + "policy): a changed boot state then makes unlock refuse until `keybagfs recover`. Default: none "
                + "(recover: the PCRs of the current enrollment).", valueName: "PCRS"))
    var tpm2Pcrs: String?

    @Option(
        help: ArgumentHelp(
            "The TPM's lockout authorization another tool set, in this file's first line (text, or hex:…): "
                + "keybagfs keeps a copy that only the recovery key or the passcode opens, for `keybagfs tpm2 "
                + "clear-lockout`.", valueName: "FILE"))
    var tpm2LockoutAuthFile: String?

    @Flag(
        help: ArgumentHelp(
            "Accept a TPM lockout that whoever holds the lockout authorization can clear (anyone with root, where "
                + "it is empty): the TPM's limit on passcode guesses is then not enforced against them."))
    var tpm2AcceptClearableLockout = false

    /// The PCR numbers asked for (`fallback` when the option is absent); "none" or "" for none.
    func pcrs(fallback: [Int] = []) throws -> [Int] {
        guard let text = tpm2Pcrs?.trimmingCharacters(in: .whitespaces) else { return fallback }
        guard !text.isEmpty, text != "none" else { return [] }
        return try text.split(separator: ",").map {
            guard let n = Int($0.trimmingCharacters(in: .whitespaces)), (0..<24).contains(n) else {
                throw ValidationError("--tpm2-pcrs: \(String($0).prefix(12)) is not a PCR (0 to 23)")
            }
            return n
        }
    }

    /// The lockout choice (the caller wipes a given authorization).
    func lockoutChoice() throws -> TPMLockoutChoice {
        if tpm2AcceptClearableLockout {
            guard tpm2LockoutAuthFile == nil else {
                throw ValidationError("--tpm2-lockout-auth-file and --tpm2-accept-clearable-lockout exclude each other")
            }
            return .acceptClearable
        }
        guard let path = tpm2LockoutAuthFile else { return .own }
        // Read into a buffer this process zeroes (not a Data it cannot wipe).
        var raw = [UInt8](repeating: 0, count: 256)
        defer { for i in raw.indices { raw[i] = 0 } }
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { throw KeybagError.system("cannot read the lockout authorization file \(path)", errno) }
        let n = raw.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
        close(fd)
        guard n >= 0 else { throw KeybagError.system("cannot read the lockout authorization file \(path)", errno) }
        var line = [UInt8](raw[..<n].prefix { $0 != 0x0A && $0 != 0x0D })
        defer { for i in line.indices { line[i] = 0 } }
        var bytes = line
        if line.starts(with: Array("hex:".utf8)) {
            let hex = String(decoding: line.dropFirst(4), as: UTF8.self)
            guard let b = Hex.bytes(hex) else {
                throw KeybagError.invalid("the lockout authorization file holds hex: but not hex digits")
            }
            bytes = b
        }
        defer { for i in bytes.indices { bytes[i] = 0 } }
        guard (1...32).contains(bytes.count) else {
            throw KeybagError.invalid("a TPM lockout authorization has 1 to 32 bytes")
        }
        return .given(SecureKey(count: bytes.count) { $0.copyBytes(from: bytes) })
    }

    /// The lines of a command's report on a new enrollment: the TPM, its PCRs and its lockout.
    static func report(_ sealer: TPMSealer) {
        print("  TPM:        \(sealer.tcti), enrollment \(sealer.path) (the passcode works only with this TPM)")
        if !sealer.pcrs.isEmpty {
            print(
                "  TPM PCRs:   \(sealer.pcrs.map(String.init).joined(separator: ",")) (SHA-256; a changed boot state "
                    + "needs `keybagfs recover`)")
        }
        print("  TPM lockout: " + lockoutReport(sealer))
    }

    /// What the lockout choice leaves, in one line for the command's report.
    static func lockoutReport(_ sealer: TPMSealer) -> String {
        switch sealer.lockoutHolder {
        case .keybagfs?:
            return "lockout authorization set by keybagfs (a lockout is cleared with `keybagfs tpm2 clear-lockout` "
                + "and the recovery key; no one else can clear it)"
        case .given?:
            return "lockout authorization kept as given (`keybagfs tpm2 clear-lockout` can use it)"
        case .accepted?, nil:
            return "lockout clearable by whoever holds the TPM's lockout authorization (accepted with "
                + "--tpm2-accept-clearable-lockout): the limit on guesses does not bind them"
        }
    }
}
