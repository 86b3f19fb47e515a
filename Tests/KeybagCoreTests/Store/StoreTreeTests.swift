import Foundation
import Glibc
import XCTest

@testable import KeybagCore

/// `StoreTree`, the one walk of a store's tree (fsck, rewrap, the journal's finder): folders
/// depth first and names in order, each entry's kind and lstat; a symlink to a folder is not
/// followed and a FIFO never opened, whatever the visitor asks; a tree deeper than the limit is
/// reported, not walked; an entry gone since the listing comes without a stat.
final class StoreTreeTests: TempDirTestCase {
    /// Every entry the walk shows under `root` (path, and whether it was a folder), descending
    /// wherever `descend` says.
    func walked(_ root: String, descend: (StoreTree.Entry) -> Bool = { _ in true }) throws
        -> (entries: [String], unopenable: [String: Int32])
    {
        let fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        XCTAssertGreaterThanOrEqual(fd, 0)
        defer { close(fd) }
        var seen: [String] = [], failed: [String: Int32] = [:]
        StoreTree.walk(
            fd, path: "", (), enter: { _, _ in },
            visit: { _, e, _ -> Void? in
                seen.append(e.path + (e.isFolder ? "/" : ""))
                return descend(e) ? () : nil
            }, unopenable: { e, _, err in failed[e.path] = err })
        return (seen, failed)
    }

    func testFoldersDepthFirstNamesInOrderKindsGiven() throws {
        let root = dir + "/data"
        for d in ["b", "a", "a/z", "a/y"] {
            try FileManager.default.createDirectory(atPath: root + "/" + d, withIntermediateDirectories: true)
        }
        for f in ["a/y/file", "b/.kbfs-dir", "c", "a/z/kbl.abc.name"] {
            XCTAssertTrue(FileManager.default.createFile(atPath: root + "/" + f, contents: Data([1])))
        }
        XCTAssertEqual(
            try walked(root).entries, ["a/", "a/y/", "a/y/file", "a/z/", "a/z/kbl.abc.name", "b/", "b/.kbfs-dir", "c"])
        XCTAssertEqual(
            try walked(root) { $0.name != "a" }.entries, ["a/", "b/", "b/.kbfs-dir", "c"],
            "a folder not asked for is not walked")
        let fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        defer { close(fd) }
        var kinds: [String: BackingKind] = [:]
        StoreTree.walk(
            fd, path: "data", (), enter: { _, _ in },
            visit: { _, e, _ -> Void? in
                kinds[e.path] = e.kind
                return ()
            }, unopenable: { _, _, _ in })
        XCTAssertEqual(kinds["data/b/.kbfs-dir"], .directoryMeta)
        XCTAssertEqual(kinds["data/a/z/kbl.abc.name"], BackingKind.of("kbl.abc.name"))
    }

    func testNoSymlinkIsFollowedAndNoFIFOOpened() throws {
        let root = dir + "/data", outside = dir + "/outside"
        try FileManager.default.createDirectory(atPath: root, withIntermediateDirectories: true)
        try FileManager.default.createDirectory(atPath: outside, withIntermediateDirectories: true)
        XCTAssertTrue(FileManager.default.createFile(atPath: outside + "/secret", contents: Data([1])))
        XCTAssertEqual(symlink(outside, root + "/link"), 0)
        XCTAssertEqual(mkfifo(root + "/fifo", 0o600), 0)
        let w = try walked(root)  // asks to descend into everything
        XCTAssertEqual(w.entries, ["fifo", "link"], "the link's target is not walked; the FIFO did not block")
        XCTAssertEqual(w.unopenable, [:])
    }

    func testATreeDeeperThanTheLimitIsReportedNotWalked() throws {
        let root = dir + "/data"
        var path = root
        for _ in 0..<(StoreTree.maxDepth + 2) { path += "/d" }
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
        let w = try walked(root)
        XCTAssertEqual(w.entries.count, StoreTree.maxDepth)
        XCTAssertEqual(Array(w.unopenable.values), [ELOOP])
        XCTAssertEqual(w.unopenable.keys.first?.split(separator: "/").count, StoreTree.maxDepth)
    }

    func testAnEntryGoneSinceTheListingComesWithoutAStat() throws {
        let root = dir + "/data"
        try FileManager.default.createDirectory(atPath: root, withIntermediateDirectories: true)
        for f in ["a", "b"] { XCTAssertTrue(FileManager.default.createFile(atPath: root + "/" + f, contents: nil)) }
        let fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        defer { close(fd) }
        var stats: [String: Bool] = [:]
        StoreTree.walk(
            fd, path: "", (), enter: { _, _ in unlink(root + "/b") },
            visit: { _, e, _ -> Void? in
                stats[e.name] = e.stat != nil
                return nil
            }, unopenable: { _, _, _ in })
        XCTAssertEqual(stats, ["a": true, "b": false])
    }
}
