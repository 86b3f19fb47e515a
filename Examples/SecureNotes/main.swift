// SecureNotes: the FileProtection library's example, written the way an iOS app keeps a
// `complete` file. While the device is unlocked the notes file (class complete) stays open;
// when the device is about to lock it is closed; new entries made while locked go to an
// inbox as completeUnlessOpen files (creatable while locked); on unlock the notes file is
// reopened and the inbox merged into it.
//
//   SecureNotes DIR [--socket PATH]      then commands on stdin: add TEXT | list | quit
import FileProtection
import Foundation
import Glibc
import Synchronization

/// Writes one line to stdout at once (no buffering: other programs read it as it happens).
func say(_ line: String) {
    let bytes = Array((line + "\n").utf8)
    _ = bytes.withUnsafeBytes { Glibc.write(1, $0.baseAddress!, $0.count) }
}

/// The notes store: the open notes file (or none while locked) and the inbox counter.
final class Notes: Sendable {
    let dir: URL
    var notesPath: String { dir.appendingPathComponent("notes.txt").path }
    var inbox: URL { dir.appendingPathComponent("inbox") }
    private struct State { var fd: Int32 = -1; var queued = 0 }
    private let state = Mutex(State())

    init(dir: URL) { self.dir = dir }

    /// Creates the notes file (complete) and the inbox (completeUnlessOpen) if missing.
    func prepare() throws {
        let fm = FileManager.default
        if !fm.fileExists(atPath: notesPath) {
            try Data().write(to: URL(fileURLWithPath: notesPath), protection: .complete)
        }
        if !fm.fileExists(atPath: inbox.path) {
            try fm.createDirectory(at: inbox, withIntermediateDirectories: false)
            try fm.setProtection(.completeUnlessOpen, ofItemAtPath: inbox.path)
        }
    }

    /// Opens the notes file for appending and merges the inbox into it.
    func open() {
        state.withLock { s in
            guard s.fd < 0 else { return }
            s.fd = Glibc.open(notesPath, O_WRONLY | O_APPEND | O_CLOEXEC)
            guard s.fd >= 0 else { return say("cannot open notes: \(String(cString: strerror(errno)))") }
            var merged = 0
            let names = ((try? FileManager.default.contentsOfDirectory(atPath: inbox.path)) ?? []).filter {
                $0.hasPrefix("entry-")
            }.sorted()
            for name in names {
                let p = inbox.appendingPathComponent(name).path
                guard let d = FileManager.default.contents(atPath: p) else { continue }
                append(d, fd: s.fd)
                unlink(p)
                merged += 1
            }
            fsync(s.fd)
            say("opened notes (complete); merged \(merged) queued entries")
        }
    }

    /// Closes the notes file before the device locks.
    func close(reason: String) {
        state.withLock { s in
            guard s.fd >= 0 else { return }
            fsync(s.fd)
            Glibc.close(s.fd)
            s.fd = -1
            say("closed notes: \(reason)")
        }
    }

    private func append(_ data: Data, fd: Int32) {
        _ = data.withUnsafeBytes { Glibc.write(fd, $0.baseAddress!, $0.count) }
    }

    /// Adds an entry: to the notes if open, else to the inbox as a completeUnlessOpen file.
    func add(_ text: String) {
        state.withLock { s in
            let line = Data((text + "\n").utf8)
            if s.fd >= 0 {
                append(line, fd: s.fd)
                fsync(s.fd)
                return say("added to notes")
            }
            s.queued += 1
            let name = String(format: "entry-%010.0f-%04d.txt", Date().timeIntervalSince1970, s.queued)
            do {
                try line.write(to: inbox.appendingPathComponent(name), protection: .completeUnlessOpen)
                say("queued while locked: \(name) (completeUnlessOpen)")
            } catch {
                say("cannot queue the entry: \(error.localizedDescription)")
            }
        }
    }

    /// Prints the notes, or says why they are unavailable.
    func list() {
        do {
            let text = try String(contentsOfFile: notesPath, encoding: .utf8)
            say("notes: " + text.split(separator: "\n").joined(separator: " | "))
        } catch let e as CocoaError where e.code == .fileReadNoPermission {
            say("notes unavailable (device locked)")
        } catch {
            say("notes unavailable: \(error.localizedDescription)")
        }
    }
}

var args = Array(CommandLine.arguments.dropFirst())
var socket: String? = nil
if let i = args.firstIndex(of: "--socket"), i + 1 < args.count {
    socket = args[i + 1]; args.removeSubrange(i...(i + 1))
}
guard let dirArg = args.first else {
    FileHandle.standardError.write(Data("usage: SecureNotes DIR [--socket PATH]\n".utf8))
    exit(2)
}
let dir = URL(fileURLWithPath: dirArg)
let notes = Notes(dir: dir)
do { try notes.prepare() } catch {
    FileHandle.standardError.write(Data("SecureNotes: \(error.localizedDescription)\n".utf8))
    exit(1)
}
let available = ProtectedData.isAvailable(for: dir, socket: socket)
if available { notes.open() } else { say("device locked: entries go to the inbox") }
// A lock between the check above and the subscription still arrives, as didBecomeUnavailable.
let events = ProtectedData.events(for: dir, socket: socket, assuming: available)

// Commands from stdin, on their own thread.
Thread.detachNewThread {
    while let line = readLine() {
        if line == "quit" { notes.close(reason: "quitting"); exit(0) }
        if line == "list" { notes.list() }
        if line.hasPrefix("add ") { notes.add(String(line.dropFirst(4))) }
    }
    exit(0)
}

say("ready")
for await event in events {
    switch event {
    case .willBecomeUnavailable: notes.close(reason: "protected data will become unavailable")
    case .didBecomeUnavailable: notes.close(reason: "protected data became unavailable"); say("locked")
    case .didBecomeAvailable: notes.open()
    }
}
