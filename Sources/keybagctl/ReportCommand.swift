import ArgumentParser
import Foundation
import Glibc
import KeybagCLI
import KeybagCore

/// `keybagctl report`.
struct Report: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract:
            "Count files and bytes per class, list what is unreadable now, and directories whose default differs "
            + "from their parent's.",
        discussion:
            "PATH defaults to the mount point. Symlinks are never followed and other file systems never entered. "
            + "Unreadable now: complete files unless unlocked; completeUnlessOpen files (to new opens) unless "
            + "unlocked; completeUntilFirstUserAuthentication files before the first unlock."
    )

    @OptionGroup var target: Target

    @Argument(help: "A directory on a keybagfs mount (default: the mount point).")
    var path: String?

    @Flag(help: "Print one JSON object.")
    var json = false

    @Option(
        help: "List at most this many unreadable files and differing directories (their counts are always complete).")
    var limit = 1000

    func run() throws {
        let root = try walkRoot()
        let status = try? statusSession(for: root).checked(.status, StatusReply.self)
        let policyReply = status == nil ? nil : try? statusSession(for: root).call(.policy, PolicyReply.self).0
        // An older daemon may not say its mount point or default class (empty here).
        let mountpoint = status.flatMap { $0.mountpoint.isEmpty ? nil : $0.mountpoint }
        let policy = mountpoint.flatMap { m -> PolicyView? in
            guard case .success(let reply)? = policyReply else { return nil }
            return PolicyView(rules: reply.rules, mountpoint: m, root: root)
        }
        var tally = ReportTally(
            limit: limit, state: status?.state.rawValue, policy: policy,
            mountpoint: mountpoint ?? "/",
            mountDefault: status.flatMap { $0.defaultClass.isEmpty ? nil : $0.defaultClass }
                ?? ProtectionClass.completeUntilFirstUserAuthentication.name)
        let started = Date()
        let progress = ProgressLine("report")
        TreeWalk.walk(
            root, recursive: true,
            visit: { p, st, depth in
                progress.tick()
                tally.visit(p, st, depth: depth)
            },
            failed: { p, err in
                tally.failures += 1
                FileHandle.standardError.write(Data("keybagctl: \(p): \(String(cString: strerror(err)))\n".utf8))
            })
        progress.finish()
        let seconds = Date().timeIntervalSince(started)
        if json {
            try printJSON(tally, root: root, seconds: seconds)
        } else {
            printText(
                tally, root: root,
                policyRefused: {
                    if case .failure(let r)? = policyReply { return r.error == .forbidden }; return false
                }(),
                entries: progress.count, seconds: seconds)
        }
        if tally.failures > 0 { throw ExitCode(1) }
    }

    /// The directory to walk: PATH, --mount, or the only keybagfs mount; made absolute
    /// without "." parts or a trailing slash ("mnt/link/" would make lstat follow a
    /// symlink); symlinks are not resolved.
    func walkRoot() throws -> String {
        var root: String
        if let path {
            root = path
        } else if let m = target.mount {
            root = m
        } else {
            let mounts = ControlPaths.keybagfsMounts()
            guard mounts.count == 1 else {
                throw ValidationError("give a PATH (found \(mounts.count) keybagfs mounts)")
            }
            root = mounts[0]
        }
        return URL(fileURLWithPath: root).standardized.path
    }

    /// The report as one JSON object.
    func printJSON(_ t: ReportTally, root: String, seconds: Double) throws {
        var o: [String: Any] = [
            "path": root, "seconds": (seconds * 1000).rounded() / 1000,
            "classes": t.byClass.mapValues { ["files": $0.files, "bytes": $0.bytes] },
            "directories": t.dirsByClass, "directoriesInheriting": t.inheriting, "otherEntries": t.other,
            "differingDirectories": t.differing, "differingDirectoryCount": t.differingCount,
            "failures": t.failures,
        ]
        if let state = t.state {
            o["state"] = state; o["unreadableNow"] = t.unreadable; o["unreadableNowCount"] = t.unreadableCount
        }
        if let policy = t.policy {
            o["policy"] = policy.policy.rules.map {
                [
                    "pattern": $0.pattern, "class": $0.protectionClass.name,
                    "directories": t.policyMatched[$0.pattern] ?? 0,
                ] as [String: Any]
            }
            o["offPolicyDirectories"] = t.offPolicy
            o["offPolicyDirectoryCount"] = t.offPolicyCount
        }
        let data = try JSONSerialization.data(withJSONObject: o, options: [.sortedKeys])
        print(String(decoding: data, as: UTF8.self))
    }

    /// The report as text.
    func printText(_ t: ReportTally, root: String, policyRefused: Bool, entries: Int, seconds: Double) {
        print("\(root)" + (t.state.map { " (state: \($0))" } ?? " (daemon not reached: readability not checked)"))
        let order = ["none", "completeUntilFirstUserAuthentication", "completeUnlessOpen", "complete", "unknown"]
        for c in order where t.byClass[c] != nil || t.dirsByClass[c] != nil {
            let n = t.byClass[c] ?? ReportTally.Count()
            let padded = c.padding(toLength: 38, withPad: " ", startingAt: 0)
            print(
                "  \(padded) "
                    + String(format: "%8d files %14lld bytes %6d directories", n.files, n.bytes, t.dirsByClass[c] ?? 0))
        }
        if t.state != nil {
            print("unreadable now: \(t.unreadableCount) files")
            for p in t.unreadable { print("  \(p)") }
            if t.unreadableCount > t.unreadable.count {
                print("  … and \(t.unreadableCount - t.unreadable.count) more")
            }
        }
        print("directories counted under the class they inherit (no default of their own): \(t.inheriting)")
        print("directories whose default differs from their parent's: \(t.differingCount)")
        for d in t.differing { print("  \(d["path"]!): \(d["class"]!) (parent \(d["parentClass"]!))") }
        if t.differingCount > t.differing.count { print("  … and \(t.differingCount - t.differing.count) more") }
        if let policy = t.policy {
            print("policy: \(policy.policy.rules.count) rules (the last match wins)")
            for r in policy.policy.rules {
                print("  \(r.pattern) → \(r.protectionClass.name): \(t.policyMatched[r.pattern] ?? 0) directories")
            }
            print("directories whose default is not the policy's: \(t.offPolicyCount)")
            for d in t.offPolicy {
                print("  \(d["path"]!): \(d["class"]!) (policy \(d["policyClass"]!) from \(d["pattern"]!))")
            }
            if t.offPolicyCount > t.offPolicy.count { print("  … and \(t.offPolicyCount - t.offPolicy.count) more") }
        } else if policyRefused {
            print("policy: not shown (only root and the mounting user may read it)")
        } else if t.state != nil {
            print("policy: none")
        }
        print(String(format: "%d entries in %.2f s", entries, seconds))
    }

    /// The daemon to ask: --socket/--mount, else the keybagfs mount that holds `root`.
    func statusSession(for root: String) throws -> Session {
        if target.socket != nil || target.mount != nil { return try target.connect() }
        guard let m = ControlPaths.keybagfsMount(holding: root) else {
            throw CtlFailure(code: 3, message: "\(root) is not on a keybagfs mount")
        }
        let socket = ControlPaths.defaultSocket(forMountpoint: m)
        do { return Session(fd: try ControlClient.connect(path: socket)) } catch {
            throw CtlFailure(code: 3, message: "cannot reach the daemon at \(socket): \(error)")
        }
    }

    /// Whether a file of class `cls` cannot be newly opened in lock state `state`.
    static func unreadable(_ cls: String, state: String) -> Bool {
        switch cls {
        case "complete", "completeUnlessOpen": return state != "unlocked"
        case "completeUntilFirstUserAuthentication": return state == "beforeFirstUnlock"
        default: return false
        }
    }
}

/// What `report` counts while it walks: files and bytes per class, directories per class,
/// what is unreadable now, directories whose default differs from their parent's or from
/// the policy's. Lists stop at `limit` entries; their counts do not.
struct ReportTally {
    /// Files and bytes of one class.
    struct Count { var files = 0; var bytes: Int64 = 0 }
    let limit: Int
    /// The daemon's lock state (nil: not reached).
    let state: String?
    let policy: PolicyView?
    let mountpoint: String
    /// The mount's `--default-class`.
    let mountDefault: String
    var byClass: [String: Count] = [:]
    var dirsByClass: [String: Int] = [:]
    var unreadable: [String] = [], unreadableCount = 0
    var differing: [[String: String]] = [], differingCount = 0
    var policyMatched: [String: Int] = [:]
    var offPolicy: [[String: String]] = [], offPolicyCount = 0
    var other = 0, failures = 0, inheriting = 0
    /// The class each directory walked so far gives new files.
    private var dirClass: [String: String] = [:]

    init(limit: Int, state: String?, policy: PolicyView?, mountpoint: String, mountDefault: String) {
        self.limit = limit; self.state = state; self.policy = policy
        self.mountpoint = mountpoint; self.mountDefault = mountDefault
    }

    /// Counts one walked entry.
    mutating func visit(_ p: String, _ st: stat, depth: Int) {
        let kind = st.st_mode & S_IFMT
        if kind != S_IFDIR, let policy, let rule = policy.rule(forPath: p) {
            // Something else where the policy wants a directory (a symlink there would
            // send new files elsewhere).
            noteOffPolicy([
                "path": p, "class": kind == S_IFLNK ? "symlink" : "not a directory",
                "policyClass": rule.protectionClass.name, "pattern": rule.pattern,
            ])
        }
        guard kind == S_IFREG || kind == S_IFDIR else { other += 1; return }
        let parent = PathText.parent(p)
        // A directory without its own default gives new files the one it inherits.
        let own = TreeWalk.protection(p)
        let cls = own ?? (kind == S_IFDIR ? dirClass[parent] ?? inheritedAtRoot(p) : "unknown")
        if kind == S_IFDIR {
            visitDirectory(p, cls: cls, own: own != nil, parentClass: depth > 0 ? dirClass[parent] : nil)
            return
        }
        byClass[cls, default: Count()].files += 1
        byClass[cls, default: Count()].bytes += Int64(st.st_size)
        if let state, Report.unreadable(cls, state: state) {
            unreadableCount += 1
            if unreadable.count < limit { unreadable.append(p) }
        }
    }

    /// Counts a directory of class `cls` (its own default when `own`).
    private mutating func visitDirectory(_ p: String, cls: String, own: Bool, parentClass: String?) {
        dirsByClass[cls, default: 0] += 1
        if !own { inheriting += 1 }
        dirClass[p] = cls
        if let policy, let rule = policy.rule(forPath: p) {
            policyMatched[rule.pattern, default: 0] += 1
            if cls != rule.protectionClass.name {
                noteOffPolicy([
                    "path": p, "class": cls, "policyClass": rule.protectionClass.name,
                    "pattern": rule.pattern,
                ])
            }
        }
        if let pc = parentClass, pc != cls {
            differingCount += 1
            if differing.count < limit { differing.append(["path": p, "class": cls, "parentClass": pc]) }
        }
    }

    /// Notes an entry the policy disagrees with.
    private mutating func noteOffPolicy(_ entry: [String: String]) {
        offPolicyCount += 1
        if offPolicy.count < limit { offPolicy.append(entry) }
    }

    /// The class the walk's top directory inherits: its nearest ancestor's own default,
    /// else the mount's (`--default-class`).
    private func inheritedAtRoot(_ p: String) -> String {
        var d = PathText.parent(p)
        while d.hasPrefix(mountpoint) && d.count >= mountpoint.count {
            if let c = TreeWalk.protection(d) { return c }
            if d == mountpoint || d == "/" { break }
            d = PathText.parent(d)
        }
        return mountDefault
    }
}

/// The mount's class policy as `report` applies it: rules from the daemon, and how a
/// walked path maps to a path from the mount root.
struct PolicyView {
    let policy: ClassPolicy
    /// Names from the mount root to the walk's root.
    let rootNames: [String]
    /// The walk's root as given (paths below it start with it).
    let root: String

    /// Nil when there are no rules or `root` is not below `mountpoint`.
    init?(rules: [PolicyReply.Rule], mountpoint: String, root: String) {
        guard !rules.isEmpty else { return nil }
        var p = ClassPolicy()
        for r in rules {
            guard (try? p.add("\(r.pattern)=\(r.protectionClass)")) != nil else { return nil }
        }
        guard let m = realpath(mountpoint, nil), let r = realpath(root, nil) else { return nil }
        defer { free(m); free(r) }
        let mount = String(cString: m), real = String(cString: r)
        guard real == mount || real.hasPrefix(mount == "/" ? "/" : mount + "/") else { return nil }
        policy = p
        rootNames = real.dropFirst(mount.count).split(separator: "/").map(String.init)
        self.root = root
    }

    /// The rule that applies to the directory at walked path `path`, if any.
    func rule(forPath path: String) -> ClassPolicy.Rule? {
        let below = path.dropFirst(root.count).split(separator: "/").map(String.init)
        let names = rootNames + below
        return names.isEmpty ? nil : policy.rule(tail: names, fromRoot: true)
    }
}
