import CSystem
import Foundation
import Glibc
import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// `NodeTable`, `OpenFile` and `DirHandle` on a folder of their own, looked up as the
/// handlers do (an `O_PATH` descriptor and its stat): the kernel's lookup counts, one node
/// per backing object, nodes that must not be mistaken for a new object with the same number.
final class NodeTableTests: TemporaryFolderTestCase {
    var table: NodeTable!

    override func tearDown() {
        table = nil  // XCTest keeps every test case: its root node's descriptor closes now
        super.tearDown()
    }

    override func setUpWithError() throws {
        try super.setUpWithError()
        table = try NodeTable(rootFD: dup(dirFD))  // the root node closes its descriptor
    }

    /// A file named `name` holding `text`.
    func make(_ name: String, _ text: String = "") {
        XCTAssertTrue(FileManager.default.createFile(atPath: dir + "/" + name, contents: Data(text.utf8)))
    }

    /// The `O_PATH` descriptor and stat of `name`, as a lookup opens it.
    func opened(_ name: String) -> (Int32, stat) {
        let fd = openat(dirFD, name, kbfs_O_PATH | O_NOFOLLOW | O_CLOEXEC)
        XCTAssertGreaterThanOrEqual(fd, 0, name)
        var st = stat()
        XCTAssertEqual(fstat(fd, &st), 0)
        return (fd, st)
    }

    /// A lookup of `name`: counts one.
    func lookup(_ name: String) -> Node {
        let (fd, st) = opened(name)
        return table.remember(fd: fd, stat: st)
    }

    /// The descriptor `n` lends for fchmod and the like: its newest open handle's.
    func lent(_ n: Node) throws -> Int32? { try n.withOpenFD { (fd: Int32) -> Int32 in fd } }

    func testLookupsAreCountedAndTheLastForgetDropsTheNode() {
        make("a")
        let n = lookup("a")
        XCTAssertTrue(lookup("a") === n, "one node per object")
        XCTAssertGreaterThan(n.id, 1)
        XCTAssertTrue(n.isRegular)
        table.forget(n.id, count: 1)
        XCTAssertTrue(table.node(n.id) === n, "the kernel still holds one lookup")
        table.forget(n.id, count: 1)
        XCTAssertNil(table.node(n.id))
        XCTAssertNil(table.node(dev: n.backingDev, ino: n.backingIno))
        XCTAssertNotEqual(lookup("a").id, n.id, "a forgotten id is not given again")
    }

    func testTheRootIsNeverForgotten() {
        table.forget(1, count: 1000)
        XCTAssertTrue(table.node(1) === table.root)
        XCTAssertTrue(table.root.isDirectory)
        XCTAssertEqual(table.allNodes().map(\.id), [1])
    }

    func testHardLinksShareANodeThatKeepsAHandleNotADescriptor() throws {
        make("a", "shared")
        XCTAssertEqual(link(dir + "/a", dir + "/b"), 0)
        let n = lookup("a")
        XCTAssertTrue(lookup("b") === n)
        XCTAssertTrue(table.node(dev: n.backingDev, ino: n.backingIno) === n)
        guard table.handlesWork else {
            return XCTFail(
                "the test folder's filesystem gives no file handles: this test cannot run (a failure, never a skip)")
        }
        XCTAssertEqual(n.fd, -1, "a cached file holds no descriptor (a big tree would use up the limit)")
        XCTAssertNotNil(n.handle)
        let fd = n.open(O_RDONLY)
        XCTAssertGreaterThanOrEqual(fd, 0, "reopened by its handle")
        defer { close(fd) }
        var buf = [UInt8](repeating: 0, count: 16)
        XCTAssertEqual(String(decoding: buf[0..<read(fd, &buf, buf.count)], as: UTF8.self), "shared")
    }

    func testARetiredNodeGivesWayToANewOneAndLivesUntilForgotten() {
        make("a")
        let old = lookup("a")
        table.retire(old)
        let new = lookup("a")
        XCTAssertFalse(new === old, "what the kernel holds of the old node is stale")
        XCTAssertTrue(table.node(old.id) === old, "the kernel may still name the old id")
        table.forget(old.id, count: 1)
        XCTAssertNil(table.node(old.id))
        XCTAssertTrue(table.node(dev: new.backingDev, ino: new.backingIno) === new, "forgetting the old keeps the new")
    }

    /// A directory node keeps its descriptor; once its directory is gone, a new directory
    /// that got the same inode number is a new node (the old node's attributes and cached
    /// class are not the new directory's).
    func testADirectoryRemovedUnderneathIsNotTakenForANewOneWithItsNumber() {
        XCTAssertEqual(mkdir(dir + "/d", 0o755), 0)
        let (fd, st) = opened("d")
        let d = table.remember(fd: fd, stat: st)
        XCTAssertGreaterThanOrEqual(d.fd, 0)
        let (again, _) = opened("d")
        XCTAssertTrue(table.remember(fd: again, stat: st) === d, "still there: the same node")
        XCTAssertEqual(rmdir(dir + "/d"), 0)
        XCTAssertEqual(mkdir(dir + "/e", 0o755), 0)
        let (e, _) = opened("e")
        // The new directory, given the old one's number (a filesystem that reuses it at once).
        let reused = table.remember(fd: e, stat: st)
        XCTAssertFalse(reused === d)
        XCTAssertTrue(reused.stillLinked)
        XCTAssertFalse(d.stillLinked)
    }

    func testOpenHandlesLendTheirDescriptorUntilTheyClose() throws {
        make("f", "content")
        let n = lookup("f")
        let file = try XCTUnwrap(n.file)
        XCTAssertNil(try lent(n), "no handle open")
        var first: OpenFile? = OpenFile(node: n, file: file, fd: n.open(O_RDONLY), writable: false)
        var second: OpenFile? = OpenFile(node: n, file: file, fd: n.open(O_RDWR), writable: true)
        let (fd1, fd2) = (first!.fd, second!.fd)
        XCTAssertEqual(try lent(n), fd2)
        second = nil
        XCTAssertEqual(try lent(n), fd1, "the other handle's descriptor, not a closed one")
        XCTAssertEqual(try n.withPathFD { (fd: Int32) -> Int32 in fd }, fd1, "and the descriptor for path calls")
        first = nil
        XCTAssertNil(try lent(n))
        XCTAssertEqual(
            try n.withPathFD { (fd: Int32) -> Int32 in
                var st = stat(); return fstat(fd, &st)
            }, 0,
            "without a handle, path calls reach the file by its handle")
    }

    func testRegularFilesAreListedForEvictionAndNothingElse() {
        make("f")
        XCTAssertEqual(mkdir(dir + "/d", 0o755), 0)
        XCTAssertEqual(symlink("f", dir + "/l"), 0)
        let f = lookup("f"), d = lookup("d"), l = lookup("l")
        XCTAssertTrue(l.isSymlink)
        XCTAssertTrue(d.isDirectory)
        XCTAssertEqual(table.regularFiles().map(\.node.id), [f.id])
        XCTAssertEqual(Set(table.allNodes().map(\.id)), [1, f.id, d.id, l.id])
    }

    /// A listing is taken when a read starts at offset 0 (opendir, rewinddir) and kept for
    /// the pages that follow, so entries do not shift under a reader between pages.
    func testADirectoryListingIsTakenAgainOnlyFromOffsetZero() {
        let h = DirHandle()
        var listings = 0
        func list() -> [DirHandle.Entry] {
            listings += 1
            return (0..<listings).map { DirHandle.Entry(name: "n\($0)", backing: "b\($0)", ino: UInt64($0), type: 8) }
        }
        XCTAssertEqual(h.entries(from: 5, list: list).count, 1, "a first read at an offset still lists")
        XCTAssertEqual(h.entries(from: 0, list: list).count, 2)
        XCTAssertEqual(h.entries(from: 1, list: list).count, 2, "the snapshot the listing started with")
        XCTAssertEqual(h.entries(from: 2, list: list).map(\.name), ["n0", "n1"])
        XCTAssertEqual(listings, 2)
        XCTAssertEqual(h.entries(from: 0, list: list).count, 3, "a rewind lists again")
    }
}
