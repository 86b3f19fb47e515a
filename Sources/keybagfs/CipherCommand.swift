import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// `keybagfs cipher`: shows or changes the cipher of new files.
struct CipherCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "cipher",
        abstract: "Show the cipher new files get, or change it; the store must not be mounted to change it.",
        discussion: """
            Each file names its cipher in its header, so files keep theirs and keep reading. After a change, new \
            files and files saved by replacing them (how editors and most programs save) get the new one. \
            xaes256gcm and xchacha20poly1305 can replace each other; aes256gcm stores keep aes256gcm (its blocks \
            have another layout). The name is authenticated with the device key: a keybag edited offline is \
            refused at mount, and this command sets it again. A keybagfs older than xaes256gcm refuses to mount \
            a store set to it ("keybag field cipher: unknown cipher"); it changes nothing in the store.
            """)

    @Argument(help: "The store directory.")
    var store: String

    @Argument(help: "The cipher for new files: xaes256gcm or xchacha20poly1305.")
    var cipher: ContentCipher?

    @Option(
        help: "Device key file (default /var/lib/keybagfs/<store-id>.key): the cipher's name is authenticated with it.")
    var deviceKey: String?

    func run() throws {
        guard let cipher else {
            print(try Keybag.load(storePath: store).cipher.name)
            return
        }
        let lock = try lockUnmountedStore(store)
        defer { close(lock) }
        let storeID = try Keybag.load(storePath: store).file.storeID
        let dk = try DeviceKeyFile.load(from: deviceKey ?? DeviceKeyFile.defaultPath(storeID: storeID))
        defer { dk.wipe() }
        var kb = try Keybag.load(storePath: store, deviceKey: dk)
        try kb.unwrapDeviceKeySlot("D", deviceKey: dk).wipe()  // the right device key, or badDeviceKey
        let old = kb.cipher
        let authentic = try KeybagMACs.cipherIsAuthentic(kb.file, deviceKey: dk)
        // An edited name (its MAC fails) says nothing about the store's layout: any cipher may be set back.
        guard authentic == false || cipher.sharesLayout(with: old) else {
            throw KeybagError.invalid(
                "\(old.name) stores cannot change to \(cipher.name): their blocks have another layout; copy the "
                    + "files into a new store instead"
            )
        }
        guard cipher.isAvailable else { throw KeybagError.invalid("this CPU cannot run \(cipher.name)") }
        guard cipher != old || authentic != true else { print("new files already get \(cipher.name)"); return }
        try kb.setCipherOfNewFiles(cipher, deviceKey: dk)
        print("new files get \(cipher.name) (was \(old.name)); existing files keep theirs")
    }
}
