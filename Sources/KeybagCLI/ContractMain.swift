import ArgumentParser
import Foundation
import Glibc
import KeybagCore

/// A refusal or failure with the exit code the contract gives it (1 refused, 2 usage,
/// 3 cannot reach the daemon).
public struct ToolFailure: Error {
    public let code: Int32
    public let message: String
    public init(code: Int32, message: String) { self.code = code; self.message = message }
}

extension ParsableCommand {
    /// Parses and runs with the contract's exit codes: usage errors exit 2 (not
    /// ArgumentParser's 64), `ToolFailure` its own code, `KeybagError` 1; help exits 0.
    public static func runWithContractExitCodes(tool: String, arguments: [String]? = nil) -> Never {
        do {
            var command = try parseAsRoot(arguments)
            try command.run()
            Glibc.exit(0)
        } catch let f as ToolFailure {
            FileHandle.standardError.write(Data("\(tool): \(f.message)\n".utf8))
            Glibc.exit(f.code)
        } catch let e as KeybagError {
            FileHandle.standardError.write(Data("\(tool): \(e)\n".utf8))
            Glibc.exit(1)
        } catch {
            let code = exitCode(for: error)
            if code != .success && (code.rawValue == 64 || code == .validationFailure) {
                FileHandle.standardError.write(Data((fullMessage(for: error) + "\n").utf8))
                Glibc.exit(2)
            }
            exit(withError: error)
        }
    }
}
