import Foundation
import Glibc
import XCTest

/// Syncthing instances (Debian's `syncthing`), two or more, that share one folder, each a
/// store replica of its own. All run inside a network namespace the test makes, which has nothing but
/// its own loopback: no route out, so no packet can leave the machine whatever Syncthing
/// tries. Discovery, relays, NAT traversal, STUN, usage reporting, crash reporting and
/// upgrades are also off in each configuration before the first start; the peers know each
/// other only by static addresses.
final class SyncthingGroup {
    /// One Syncthing instance.
    struct Peer {
        let name: String
        let home: String
        let folder: String
        let port: Int
        var id = ""
        var process: Process?
    }

    let netns: String
    private(set) var peers: [Peer]
    private var closed = false

    /// Generates every identity and configuration (not started). `folders`: the store paths, one per peer.
    init(root: String, folders: [String]) throws {
        guard FileManager.default.isExecutableFile(atPath: "/usr/bin/syncthing") else {
            throw NSError(
                domain: "syncthing is missing: run scripts/install-deps.sh (the test fails rather than skips)", code: 1)
        }
        netns = "kbfs-sync-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        peers = folders.enumerated().map { i, f in
            Peer(
                name: "host-" + String(UnicodeScalar(UInt8(97 + i))), home: root + "/syncthing-\(i)", folder: f,
                port: 22001 + i)
        }
        try check(MountFixture.run("/usr/bin/ip", ["netns", "add", netns]), "ip netns add")
        try check(MountFixture.run("/usr/bin/ip", ["-n", netns, "link", "set", "lo", "up"]), "ip link set lo up")
        for i in peers.indices {
            try check(
                MountFixture.run(
                    "/usr/bin/syncthing",
                    ["generate", "--home=\(peers[i].home)", "--no-default-folder", "--skip-port-probing"]),
                "syncthing generate")
            let r = MountFixture.run("/usr/bin/syncthing", ["--home=\(peers[i].home)", "--device-id"])
            try check(r, "syncthing --device-id")
            peers[i].id = r.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
            mkdir(peers[i].folder, 0o700)
            mkdir(peers[i].folder + "/.stfolder", 0o700)
        }
        for i in peers.indices { try configure(i) }
    }

    deinit { close() }

    private func check(_ r: ToolResult, _ what: String) throws {
        guard r.code == 0 else { throw NSError(domain: "\(what) failed: \(r.stderr)", code: Int(r.code)) }
    }

    /// Rewrites peer `i`'s generated config.xml: private listen address, every outward
    /// feature off, no GUI, the other peers at their static addresses, the shared folder.
    private func configure(_ i: Int) throws {
        let me = peers[i], others = peers.indices.filter { $0 != i }.map { peers[$0] }
        let path = me.home + "/config.xml"
        var xml = try String(contentsOfFile: path, encoding: .utf8)
        func set(_ tag: String, _ value: String) throws {
            guard let r = xml.range(of: "<\(tag)>[^<]*</\(tag)>", options: .regularExpression) else {
                throw NSError(domain: "config.xml has no <\(tag)>", code: 1)
            }
            xml.replaceSubrange(r, with: "<\(tag)>\(value)</\(tag)>")
        }
        try set("listenAddress", "tcp://127.0.0.1:\(me.port)")
        try set("globalAnnounceServer", "")
        for off in [
            "globalAnnounceEnabled", "localAnnounceEnabled", "relaysEnabled", "natEnabled", "startBrowser",
            "crashReportingEnabled", "restartOnWakeup",
        ] {
            try set(off, "false")
        }
        try set("urAccepted", "-1")
        try set("autoUpgradeIntervalH", "0")
        try set("stunKeepaliveStartS", "0")
        try set("stunServer", "")
        try set("releasesURL", "")
        try set("urURL", "")
        try set("crashReportingURL", "")
        xml = xml.replacingOccurrences(of: "<gui enabled=\"true\"", with: "<gui enabled=\"false\"")
        let deviceEntries = others.map { other in
            """
                <device id="\(other.id)" name="\(other.name)" compression="metadata" introducer="false" skipIntroductionRemovals="false" introducedBy="">
                    <address>tcp://127.0.0.1:\(other.port)</address>
                    <paused>false</paused>
                    <autoAcceptFolders>false</autoAcceptFolders>
                </device>

            """
        }.joined()
        let folderDevices = others.map { "            <device id=\"\($0.id)\" introducedBy=\"\"></device>\n" }.joined()
        let shared =
            deviceEntries + """
                    <folder id="kbfs-store" label="kbfs-store" path="\(me.folder)" type="sendreceive" rescanIntervalS="5" fsWatcherEnabled="true" fsWatcherDelayS="1" ignorePerms="false" autoNormalize="true">
                        <filesystemType>basic</filesystemType>
                        <device id="\(me.id)" introducedBy=""></device>
                \(folderDevices)        <minDiskFree unit="%">0</minDiskFree>
                        <maxConflicts>10</maxConflicts>
                        <markerName>.stfolder</markerName>
                    </folder>

                """
        guard let end = xml.range(of: "    <gui ") else { throw NSError(domain: "config.xml has no <gui>", code: 1) }
        xml.insert(contentsOf: shared, at: end.lowerBound)
        try xml.write(toFile: path, atomically: true, encoding: .utf8)
    }

    /// Starts peer `i` inside the namespace (its log in its home).
    func start(_ i: Int) throws {
        let p = Process()
        p.executableURL = URL(fileURLWithPath: "/usr/bin/ip")
        p.arguments = [
            "netns", "exec", netns, "/usr/bin/syncthing", "serve", "--home=\(peers[i].home)", "--no-browser",
            "--no-restart", "--no-upgrade",
        ]
        var env = ProcessInfo.processInfo.environment
        env["STNORESTART"] = "1"
        env["STNOUPGRADE"] = "1"
        env["HOME"] = peers[i].home
        p.environment = env
        _ = FileManager.default.createFile(atPath: peers[i].home + "/serve.log", contents: nil)
        let log = Foundation.FileHandle(forWritingAtPath: peers[i].home + "/serve.log")
        p.standardOutput = log
        p.standardError = log
        p.standardInput = Foundation.FileHandle.nullDevice
        try p.run()
        peers[i].process = p
    }

    /// Stops peer `i` (SIGTERM, SIGKILL after 10 s), the monitor Syncthing starts and its
    /// child alike: the link is cut until it starts again.
    func stop(_ i: Int) {
        guard let p = peers[i].process else { return }
        for sig in [SIGTERM, SIGKILL] {
            let pids = processes(of: peers[i].home)
            if pids.isEmpty { break }
            for pid in pids { kill(pid, sig) }
            _ = waitUntil(10) { processes(of: peers[i].home).isEmpty }
        }
        if p.isRunning { kill(p.processIdentifier, SIGKILL) }
        p.waitUntilExit()
        peers[i].process = nil
    }

    /// The processes inside the namespace whose command line names `home` (all of them for nil).
    private func processes(of home: String?) -> [pid_t] {
        let r = MountFixture.run("/usr/bin/ip", ["netns", "pids", netns])
        return r.stdout.split(separator: "\n").compactMap { pid_t($0.trimmingCharacters(in: .whitespaces)) }.filter {
            pid in
            guard let home else { return true }
            let cmd = (try? Data(contentsOf: URL(fileURLWithPath: "/proc/\(pid)/cmdline"))) ?? Data()
            return String(decoding: cmd, as: UTF8.self).contains(home)
        }
    }

    /// Every TCP/UDP socket inside the namespace, as `ss` lists them (for the no-route check).
    func sockets() -> String {
        MountFixture.run("/usr/bin/ip", ["netns", "exec", netns, "/usr/bin/ss", "-tuan"]).stdout
    }

    /// The last lines of every peer's log (for failure messages).
    func logs(lines: Int = 25) -> String {
        peers.map { p in
            let text = (try? String(contentsOfFile: p.home + "/serve.log", encoding: .utf8)) ?? ""
            return "--- \(p.name):\n" + text.split(separator: "\n").suffix(lines).joined(separator: "\n")
        }.joined(separator: "\n")
    }

    /// The namespace's routes (none but loopback's own).
    func routes() -> String { MountFixture.run("/usr/bin/ip", ["-n", netns, "route", "show"]).stdout }

    /// Stops every peer and deletes the namespace.
    func close() {
        guard !closed else { return }
        closed = true
        for i in peers.indices { stop(i) }
        for pid in processes(of: nil) { kill(pid, SIGKILL) }
        _ = waitUntil(10) { processes(of: nil).isEmpty }
        _ = MountFixture.run("/usr/bin/ip", ["netns", "delete", netns])
    }
}
