import CSystem
import Foundation
import Glibc
import KeybagProtocol
import Synchronization

/// A change of protected-data availability, as iOS posts them.
public enum ProtectedDataEvent: String, Sendable, Equatable {
    /// The device is about to lock (the grace period started): close `complete` files now.
    case willBecomeUnavailable
    /// The class keys are gone: `complete` files answer EACCES.
    case didBecomeUnavailable
    /// The device was unlocked.
    case didBecomeAvailable

    /// The event of a socket line's `event` field; nil for one Apple has no name for.
    init?(_ event: ProtectionEvent) {
        switch event {
        case .willBecomeUnavailable: self = .willBecomeUnavailable
        case .didBecomeUnavailable: self = .didBecomeUnavailable
        case .didBecomeAvailable: self = .didBecomeAvailable
        case .didReturnToBeforeFirstUnlock: return nil
        }
    }

    /// The notification posted for the event (Apple's names for the two Apple has).
    public var notificationName: Notification.Name {
        switch self {
        case .willBecomeUnavailable: return .protectedDataWillBecomeUnavailable
        case .didBecomeUnavailable: return .protectedDataDidBecomeUnavailable
        case .didBecomeAvailable: return .protectedDataDidBecomeAvailable
        }
    }
}

extension Notification.Name {
    /// Apple's `UIApplication.protectedDataWillBecomeUnavailableNotification`.
    public static let protectedDataWillBecomeUnavailable = Notification.Name(
        "UIApplicationProtectedDataWillBecomeUnavailable")
    /// Apple's `UIApplication.protectedDataDidBecomeAvailableNotification`.
    public static let protectedDataDidBecomeAvailable = Notification.Name(
        "UIApplicationProtectedDataDidBecomeAvailable")
    /// keybagfs only (iOS has no such notification): the keys are gone.
    public static let protectedDataDidBecomeUnavailable = Notification.Name("KeybagfsProtectedDataDidBecomeUnavailable")
}

/// Availability of protected data on a keybagfs mount: `UIApplication.isProtectedDataAvailable`
/// and its notifications, per mount.
public enum ProtectedData {
    /// The control socket of the keybagfs mount that holds `url`: `$KEYBAGFS_SOCKET` if set,
    /// else the default socket of the innermost keybagfs mount point above the path.
    public static func socketPath(for url: URL) throws -> String {
        if let s = ProcessInfo.processInfo.environment["KEYBAGFS_SOCKET"], !s.isEmpty { return s }
        guard let mount = ControlPaths.keybagfsMount(holding: url.path) else {
            throw CocoaError(
                .featureUnsupported,
                userInfo: [
                    NSFilePathErrorKey: url.path,
                    NSLocalizedDescriptionKey: "\(url.path) is not on a keybagfs mount",
                ])
        }
        return ControlPaths.defaultSocket(forMountpoint: mount)
    }

    /// The daemon's `status` object (its JSON fields as Foundation values), or nil when it
    /// cannot be reached.
    public static func status(socket: String) -> [String: Any]? {
        guard let line = statusLine(socket: socket), let data = line.data(using: .utf8) else { return nil }
        return (try? JSONSerialization.jsonObject(with: data)) as? [String: Any]
    }

    /// The daemon's `status` reply, typed; nil when it cannot be reached or is not a status.
    static func statusReply(socket: String) -> StatusReply? {
        statusLine(socket: socket).flatMap { ControlProtocol.decode(StatusReply.self, from: $0) }
    }

    /// The daemon's `status` line as it came.
    private static func statusLine(socket: String) -> String? {
        guard let fd = try? ControlClient.connect(path: socket) else { return nil }
        defer { close(fd) }
        var tv = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        guard (try? ControlClient.sendLine(fd, ControlCall.status.line)) != nil else { return nil }
        var buf: [UInt8] = []
        return ControlClient.readLine(fd, buffer: &buf)
    }

    /// Whether protected data (`complete` files) is available now, like
    /// `UIApplication.isProtectedDataAvailable`; false when the daemon cannot be reached.
    public static func isAvailable(for url: URL, socket: String? = nil) -> Bool {
        guard let s = socket ?? (try? socketPath(for: url)), let st = statusReply(socket: s) else { return false }
        return st.protectedDataAvailable
    }

    /// Whether EACCES on `path` comes from a locked class rather than permissions. A path
    /// that does not exist yet (a create) has the class its directory gives new files.
    static func isLockedClassDenial(path: String) -> Bool {
        var buf = [UInt8](repeating: 0, count: 128)
        var n = getxattr(path, protectionAttribute, &buf, buf.count)
        if n < 0 && errno == ENOENT {
            n = getxattr(PathText.parent(path), protectionAttribute, &buf, buf.count)
        }
        guard n > 0 else { return false }
        let name = String(decoding: buf[0..<n], as: UTF8.self)
        guard name == "complete" || name == "completeUnlessOpen" || name == "completeUntilFirstUserAuthentication"
        else { return false }
        let url = URL(fileURLWithPath: path)
        guard let s = try? socketPath(for: url), let st = statusReply(socket: s) else { return false }
        return !st.protectedDataAvailable
    }

    /// Availability changes of the mount that holds `url`, as an `AsyncStream`. Subscribes
    /// on the control socket; if the daemon goes away, reconnects with back-off (0.1 s
    /// doubling to 5 s) and, when the state changed meanwhile, yields the events that were
    /// missed (`didBecomeUnavailable` or `didBecomeAvailable`). Pass the availability the
    /// caller acted on as `assuming` to get the same for a change before the first subscribe.
    /// Ends when the consumer stops.
    public static func events(
        for url: URL, socket: String? = nil, assuming: Bool? = nil
    ) -> AsyncStream<ProtectedDataEvent> {
        let path = socket ?? (try? socketPath(for: url))
        return AsyncStream { continuation in
            guard let path else { continuation.finish(); return }
            let sub = Subscription(socket: path)
            continuation.onTermination = { _ in sub.cancel() }
            let thread = Thread {
                sub.run(assuming: assuming) { continuation.yield($0) }; continuation.finish()
            }
            thread.start()
        }
    }

    /// Posts each event of the mount that holds `url` on `center` (Apple's names), until
    /// the returned task is cancelled.
    public static func postNotifications(
        for url: URL, socket: String? = nil, center: NotificationCenter = .default
    ) -> Task<Void, Never> {
        let stream = events(for: url, socket: socket)
        let box = CenterBox(center: center)
        return Task {
            for await e in stream { box.center.post(name: e.notificationName, object: nil, userInfo: ["url": url]) }
        }
    }
}

/// Carries a `NotificationCenter` into a task. `@unchecked Sendable`: NotificationCenter
/// is thread-safe (posting from any thread is documented), but not marked Sendable on Linux.
private final class CenterBox: @unchecked Sendable {
    let center: NotificationCenter
    init(center: NotificationCenter) { self.center = center }
}

/// One subscriber connection with reconnection; `cancel` ends `run` from any thread.
final class Subscription: Sendable {
    let socket: String
    private struct State { var fd: Int32 = -1; var cancelled = false }
    private let state = Mutex(State())

    init(socket: String) { self.socket = socket }

    /// Stops: shuts the connection down so a blocked read returns.
    func cancel() {
        state.withLock { s in
            s.cancelled = true
            if s.fd >= 0 { shutdown(s.fd, Int32(SHUT_RDWR)) }
        }
    }

    private var cancelled: Bool { state.withLock { $0.cancelled } }

    /// Delivers events to `yield` until cancelled.
    func run(assuming: Bool?, _ yield: (ProtectedDataEvent) -> Void) {
        var available = assuming
        var delay = 0.1
        while !cancelled {
            guard let fd = try? ControlClient.connect(path: socket) else {
                usleep(useconds_t(delay * 1_000_000))
                delay = min(delay * 2, 5)
                continue
            }
            let keep = state.withLock { s -> Bool in
                guard !s.cancelled else { return false }
                s.fd = fd
                return true
            }
            defer {
                state.withLock { $0.fd = -1 }
                close(fd)
            }
            guard keep, (try? ControlClient.sendLine(fd, ControlCall.subscribe.line)) != nil else { continue }
            var buf: [UInt8] = []
            guard let line = ControlClient.readLine(fd, buffer: &buf),
                case .success(let reply)? = ControlProtocol.reply(StateReply.self, from: line)
            else { continue }
            delay = 0.1
            let nowAvailable = reply.state == .unlocked
            if let was = available, was != nowAvailable {
                yield(nowAvailable ? .didBecomeAvailable : .didBecomeUnavailable)
            }
            available = nowAvailable
            while let line = ControlClient.readLine(fd, buffer: &buf) {
                guard let o = ControlProtocol.decode(EventLine.self, from: line), let e = ProtectedDataEvent(o.event)
                else { continue }
                if e == .didBecomeAvailable { available = true }
                if e == .didBecomeUnavailable { available = false }
                yield(e)
            }
        }
    }
}
