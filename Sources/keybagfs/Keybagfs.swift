import ArgumentParser
import CSystem
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// `keybagfs`: create a store, mount it.
@main
struct Keybagfs: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "keybagfs",
        abstract:
            "iOS-style Data Protection for a directory: an encrypted FUSE filesystem with four protection classes.",
        discussion: """
            Create a store once with `keybagfs init`, mount it with `keybagfs mount`, then unlock and lock it \
            with `keybagctl`. Each file's class is the xattr user.protection (none, \
            completeUntilFirstUserAuthentication, completeUnlessOpen, complete).
            """,
        subcommands: [
            Init.self, Mount.self, Fsck.self, Recover.self, RecoveryKeyCommand.self, CipherCommand.self,
            DeviceCommand.self, TPMCommand.self, Rewrap.self,
        ])

    /// Runs the command; usage errors exit 2, refusals 1.
    static func main() {
        _ = kbfs_set_nondumpable()  // passcodes and recovery keys pass through this process
        runWithContractExitCodes(
            tool: "keybagfs", arguments: Self.mountHelperArguments(Array(CommandLine.arguments.dropFirst())))
    }

    /// `mount -t fuse.keybagfs STORE DIR -o OPTS` runs `keybagfs STORE DIR -o OPTS` (fuse3's
    /// mount.fuse3): arguments that start with neither a subcommand nor an option are a mount.
    static func mountHelperArguments(_ args: [String]) -> [String] {
        let names = configuration.subcommands.map { $0._commandName } + ["help"]
        guard args.count >= 2, let first = args.first, !first.hasPrefix("-"), !names.contains(first) else {
            return args
        }
        return ["mount"] + args
    }
}

/// Parses a class name or Apple alias for an option.
extension ProtectionClass: ExpressibleByArgument {
    public init?(argument: String) { self.init(name: argument) }
    public static var allValueStrings: [String] { allCases.map(\.name) }
}

extension KDFStrength: ExpressibleByArgument {}

extension TPMChoice: ExpressibleByArgument {}

extension StoreSharing.Mode: ExpressibleByArgument {}

/// Parses a content cipher name for `init --cipher`.
extension ContentCipher: ExpressibleByArgument {
    public init?(argument: String) { self.init(name: argument) }
    public static var allValueStrings: [String] { allCases.map(\.name) }
}
