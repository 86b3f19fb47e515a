import Foundation
import KeybagCore
import KeybagProtocol

extension FuzzTarget {
    /// The control socket's lines, both ways, and the mount table the commands read.
    static let controlTargets: [FuzzTarget] = [
        // A line a local user sends the daemon's socket: parsed, its op and its arguments
        // checked as the server checks them (the passcodes land in guarded memory).
        FuzzTarget(name: "control-request") { input in
            input.withUnsafeBytes { line in
                guard case .success(let request) = ControlRequest.parsed(line) else { return }
                if case .success(let op) = request.operation() {
                    _ = op.refusalForOthers
                    _ = request.command(op)
                }
            }
        },
        // A line the daemon answers (what keybagctl and the FileProtection library decode),
        // and /proc/self/mountinfo as the commands read it to find mounts.
        FuzzTarget(name: "control-reply") { input in
            let line = String(decoding: input, as: UTF8.self)
            _ = ControlProtocol.decode(StatusReply.self, from: line)
            _ = ControlProtocol.decode(EventLine.self, from: line)
            _ = ControlProtocol.reply(StateReply.self, from: line)
            _ = ControlProtocol.reply(DoneReply.self, from: line)
            _ = ControlPaths.keybagfsMounts(mountinfo: line)
            _ = ControlPaths.unescapeMountinfo(line)
        },
        // A recovery key as a user types it (`recover`, `device add`).
        FuzzTarget(name: "recovery-key") { input in
            let text = SecureKey(count: input.count) { $0.copyBytes(from: input) }
            defer { text.wipe() }
            if let key = try? RecoveryKey.parse(text) {
                (try? key.text())?.wipe()
                key.wipe()
            }
        },
    ]
}
