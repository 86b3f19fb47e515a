import ArgumentParser
import CSystem
import Foundation
import Glibc
import KeybagCLI
import KeybagCore

/// `keybagctl protect`.
struct Protect: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Set the protection class of files, and the default class of directories.",
        discussion:
            "With -R, also of everything below each directory. Symlinks are never followed and other file systems "
            + "never entered. Exit 1 if any path failed (each is named on stderr)."
    )

    /// Accepted like every subcommand's; classes are set through the paths themselves.
    @OptionGroup var target: Target

    @Flag(name: .customShort("R"), help: "Recurse into directories.")
    var recursive = false

    @Argument(help: "none, completeUntilFirstUserAuthentication, completeUnlessOpen, complete (or an Apple constant).")
    var protectionClass: String

    @Argument(help: "Files or directories on a keybagfs mount.")
    var paths: [String]

    func run() throws {
        guard let cls = ProtectionClass(name: protectionClass) else {
            throw ValidationError(
                "unknown class \"\(protectionClass)\" (none, completeUntilFirstUserAuthentication, "
                    + "completeUnlessOpen, complete)"
            )
        }
        let name = cls.name
        var total: Int? = nil
        if recursive && isatty(2) == 1 {
            var n = 0
            for p in paths {
                TreeWalk.walk(
                    p, recursive: true, visit: { _, st, _ in if Self.takesClass(st) { n += 1 } }, failed: { _, _ in })
            }
            total = n
        }
        let progress = ProgressLine("protect", total: total)
        var files = 0, dirs = 0, failures = 0
        for p in paths {
            TreeWalk.walk(
                p, recursive: recursive,
                visit: { path, st, depth in
                    guard Self.takesClass(st) else {
                        if depth == 0 {
                            failures += 1
                            FileHandle.standardError.write(
                                Data(
                                    ("keybagctl: \(path): only files and directories have a class "
                                        + "(symlinks are not followed)\n").utf8))
                        }
                        return
                    }
                    progress.tick()
                    if setxattr(path, "user.protection", name, name.utf8.count, 0) == 0 {
                        if st.st_mode & S_IFMT == S_IFDIR { dirs += 1 } else { files += 1 }
                    } else {
                        failures += 1
                        FileHandle.standardError.write(
                            Data("keybagctl: \(path): \(String(cString: strerror(errno)))\n".utf8))
                    }
                },
                failed: { path, err in
                    failures += 1
                    FileHandle.standardError.write(Data("keybagctl: \(path): \(String(cString: strerror(err)))\n".utf8))
                })
        }
        progress.finish()
        print("set \(name) on \(files) files and \(dirs) directories" + (failures > 0 ? "; \(failures) failed" : ""))
        if failures > 0 { throw ExitCode(1) }
    }

    /// Regular files and directories carry a class; symlinks and special files do not.
    static func takesClass(_ st: stat) -> Bool { st.st_mode & S_IFMT == S_IFREG || st.st_mode & S_IFMT == S_IFDIR }
}
