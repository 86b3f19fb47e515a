import Foundation

/// Where a component's notes for the operator go: the daemon's standard error (a journal
/// line under systemd), or a test's recorder. Components take one when they are made, so
/// nothing below the daemon's entry point decides where a line is written.
public struct EventLog: Sendable {
    /// Receives one line (no trailing newline, no prefix).
    private let sink: @Sendable (String) -> Void

    /// A log that hands each line to `sink`.
    public init(_ sink: @escaping @Sendable (String) -> Void) { self.sink = sink }

    /// Writes one line.
    public func callAsFunction(_ line: String) { sink(line) }

    /// Standard error, each line prefixed `keybagfs: `.
    public static let standardError = EventLog { line in
        FileHandle.standardError.write(Data(("keybagfs: " + line + "\n").utf8))
    }

    /// A log that keeps its lines in memory (tests), and the means to read them.
    public static func recording() -> (EventLog, @Sendable () -> [String]) {
        let lines = Locked<[String]>([])
        return (EventLog { line in lines.withLock { $0.append(line) } }, { lines.withLock { $0 } })
    }
}
