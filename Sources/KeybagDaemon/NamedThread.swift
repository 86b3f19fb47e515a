import CSystem
import Foundation

/// A background thread the kernel knows by name (`ps -L`, `top -H`, perf, gdb, /proc):
/// Foundation's `Thread.name` does not reach the kernel on Linux, so the thread names itself.
enum NamedThread {
    /// Starts `body` on a new thread named `name` (at most 15 bytes: the kernel's limit).
    static func start(_ name: String, _ body: @escaping @Sendable () -> Void) {
        precondition(name.utf8.count <= 15, "a thread name has at most 15 bytes")
        Thread {
            _ = kbfs_name_this_thread(name)
            body()
        }.start()
    }
}
