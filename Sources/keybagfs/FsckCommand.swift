import ArgumentParser
import CSystem
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// `keybagfs fsck`.
struct Fsck: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Check an unmounted store; with --repair, fix what can be fixed.",
        discussion: """
            Checks the keybag, every directory's metadata, names and long-name side files, every file header \
            (both slots), every block of files whose class key is at hand, and the xattr and symlink-target \
            folders. Without the passcode, classes A, B and C are checked for structure only. --repair fixes \
            what loses no data; repairs that drop data (torn or damaged blocks) also need --yes. \
            Exit status: 0 clean, 1 problems found (or the check failed), 2 usage.
            """)

    @OptionGroup var target: UnmountedStore

    @Flag(help: "Read the passcode as one line from standard input, to check the contents of classes A, B and C.")
    var passcodeStdin = false

    @Flag(help: "Ask for the passcode on the terminal.")
    var askPasscode = false

    @Flag(help: "Repair what can be repaired without losing data.")
    var repair = false

    @Flag(help: "With --repair: also repairs that drop data (cut torn tails, zero damaged blocks).")
    var yes = false

    @Flag(help: "Print the result as JSON.")
    var json = false

    /// Replays the store's overwrite journal, as a mount would; with `--repair` a journal that
    /// cannot be replayed is set aside (its records are lost; the next mount makes a new one).
    func replayJournal(_ kb: Keybag, _ dk: SecureKey) throws {
        let deviceID = try DeviceIdentity.id(deviceKey: dk, storeID: kb.file.storeID)
        let say = { (line: String) in FileHandle.standardError.write(Data(("keybagfs: " + line + "\n").utf8)) }
        do {
            try JournalReplay.replay(storePath: target.store, deviceID: deviceID, log: say)
        } catch  where repair {
            // A journal that cannot be replayed (a damaged superblock, a crafted one that needs
            // more descriptors than there are): set aside, its records lost; the next mount
            // makes a new one.
            try JournalReplay.setAside(storePath: target.store, deviceID: deviceID)
            say("\(error): set aside as \(JournalReplay.fileName(deviceID: deviceID)).damaged")
        }
    }

    func run() throws {
        let lock = try lockUnmountedStore(target.store)
        defer { close(lock) }
        let kb = try Keybag.load(storePath: target.store)
        let dk = try DeviceKeyFile.load(from: target.deviceKeyPath(kb))
        defer { dk.wipe() }
        // What a power cut left in the overwrite journal goes into its files first, as at a mount
        // (each file written into stays open until the end).
        _ = kbfs_raise_nofile()
        try replayJournal(kb, dk)
        let passcode: SecureKey? =
            passcodeStdin || askPasscode ? try PasscodeInput.read(fromStdin: passcodeStdin, prompt: "Passcode: ") : nil
        defer { passcode?.wipe() }
        let check = try StoreCheck(
            storePath: target.store, deviceKey: dk, passcode: passcode,
            options: .init(repair: repair, dropData: repair && yes), tcti: target.tpm2Device)
        defer { check.wipe() }
        if isatty(2) == 1 && !json {
            check.progress = { FileHandle.standardError.write(Data("\rchecked \($0) files…".utf8)) }
        }
        try check.run()
        if isatty(2) == 1 && !json && check.files >= 500 { FileHandle.standardError.write(Data("\r\u{1b}[K".utf8)) }
        if json {
            let o: [String: Any] = [
                "clean": check.isClean, "directories": check.directories, "files": check.files, "blocks": check.blocks,
                "filesWithoutKey": check.keyless,
                "problems": check.problems.map { p -> [String: Any] in
                    var d: [String: Any] = ["kind": p.kind, "path": p.path, "detail": p.detail, "repair": p.repair]
                    if let n = p.name { d["name"] = n }
                    return d
                },
            ]
            let data = try JSONSerialization.data(withJSONObject: o, options: [.sortedKeys])
            print(String(decoding: data, as: UTF8.self))
        } else {
            for p in check.problems {
                print("\(p.kind): \(p.path)\(p.name.map { " (\($0))" } ?? ""): \(p.detail) [\(p.repair)]")
            }
            let summary =
                "\(check.directories) directories, \(check.files) files, \(check.blocks) blocks checked"
                + (check.keyless > 0
                    ? "; \(check.keyless) files of classes A/B/C checked for structure only (no passcode)" : "")
            if check.isClean {
                print("clean: " + summary)
            } else {
                let fixed = check.problems.filter { $0.repair == "repaired" }.count
                print("\(check.problems.count) problem(s), \(fixed) repaired: " + summary)
            }
        }
        if !check.isClean { throw ExitCode(1) }
    }
}
