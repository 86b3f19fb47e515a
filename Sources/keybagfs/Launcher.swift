import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore
import KeybagDaemon

/// Starts the daemon as a child process and waits until it reports the mount live.
enum Launcher {
    /// Closes descriptors above stderr that a detached daemon inherited by accident
    /// (they would hold the launching program's pipes open).
    static func closeInheritedDescriptors(keeping keep: Int32) {
        let fds =
            (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/fd"))?.compactMap { Int32($0) } ?? []
        for fd in fds where fd > 2 && fd != keep { close(fd) }
    }

    static func spawnDaemon(arguments: [String]) throws {
        var fds: [Int32] = [0, 0]
        guard pipe(&fds) == 0 else { throw KeybagError.system("pipe", errno) }
        _ = fcntl(fds[0], F_SETFD, FD_CLOEXEC)
        _ = fcntl(fds[1], F_SETFD, FD_CLOEXEC)
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_adddup2(&actions, fds[1], 3)
        posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0)
        posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0)
        posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0)
        let exe =
            (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/exe")) ?? CommandLine.arguments[0]
        let argv = ([exe] + arguments).map { strdup($0) } + [nil]
        defer { argv.forEach { free($0) } }
        var pid: pid_t = 0
        let rc = posix_spawn(&pid, exe, &actions, nil, argv, environ)
        close(fds[1])
        guard rc == 0 else { close(fds[0]); throw KeybagError.system("cannot start the daemon", rc) }
        var buffer: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 512)
        while true {
            let n = read(fds[0], &chunk, chunk.count)
            if n < 0 && errno == EINTR { continue }
            if n <= 0 { break }
            buffer += chunk[0..<n]
        }
        close(fds[0])
        let line = String(decoding: buffer, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        if line == "OK" { return }
        var status: Int32 = 0
        waitpid(pid, &status, 0)
        if line.hasPrefix("ERR ") { throw KeybagError.invalid(String(line.dropFirst(4))) }
        throw KeybagError.invalid("the daemon exited before the mount was ready (status \(status))")
    }
}
