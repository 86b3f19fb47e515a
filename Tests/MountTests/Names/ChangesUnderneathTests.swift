import Foundation
import Glibc
import XCTest

/// Issue 25: a store that a sync engine changes while it is mounted. Two replicas of one
/// store (a `cp -a` copy: same device key and passcode) are mounted side by side; what the
/// other device writes through its mount is copied into this device's store the way
/// Syncthing does it (a `.syncthing.NAME.tmp` in the same folder, fsync, rename over; unlink;
/// mkdir; rename), and this device's mount must show it within seconds.
final class ChangesUnderneathTests: XCTestCase {
    /// A second device: a mount of a copy of `m`'s store, unlocked, closed with the test.
    private func otherDevice(of m: MountFixture) throws -> MountFixture {
        let other = try MountFixture(mount: false)
        addTeardownBlock { other.close() }
        try FileManager.default.removeItem(atPath: other.store)
        XCTAssertEqual(MountFixture.run("/bin/cp", ["-a", m.store, other.store]).code, 0)
        XCTAssertEqual(MountFixture.run("/bin/cp", ["-a", m.deviceKey, other.deviceKey]).code, 0)
        try other.mount()
        other.unlock()
        return other
    }

    /// This device's mount (unlocked, closed with the test; the daemon gets `environment` and
    /// `extra` arguments), filled by `fill` and synced to disk, and the other device's copy of
    /// it. The store is a Syncthing folder (`.stfolder`, which Syncthing makes in each folder it
    /// syncs) unless `marked` is false.
    private func twoDevices(
        environment: [String: String] = [:], marked: Bool = true, extra: [String] = [], _ fill: (MountFixture) -> Void
    ) throws -> (here: MountFixture, there: MountFixture) {
        let here = try MountFixture(mount: false)
        addTeardownBlock { here.close() }
        if marked { XCTAssertEqual(mkdir(here.store + "/.stfolder", 0o755), 0) }
        try here.mount(extra: extra, environment: environment)
        here.unlock()
        fill(here)
        sync()
        return (here, try otherDevice(of: here))
    }

    /// `path` relative to `store`.
    private func relative(_ path: String, in store: String) -> String { String(path.dropFirst(store.count + 1)) }

    /// The backing path of `rel` in `m`'s store, relative to the store.
    private func backingRel(_ m: MountFixture, _ rel: String) -> String { relative(m.backing(rel), in: m.store) }

    /// Copies one file into `to` as Syncthing does: a temporary in the same folder, synced,
    /// then renamed over the target. `during` runs while the temporary is there.
    private func syncthingCopy(_ from: String, _ to: String, during: ((String) -> Void)? = nil) throws {
        let dir = (to as NSString).deletingLastPathComponent, name = (to as NSString).lastPathComponent
        let tmp = dir + "/.syncthing." + name + ".tmp"
        let data = try Data(contentsOf: URL(fileURLWithPath: from))
        XCTAssertEqual(writeFile(tmp, Array(data)), 0)
        let fd = open(tmp, O_RDONLY)
        XCTAssertEqual(fsync(fd), 0)
        close(fd)
        during?(tmp)
        XCTAssertEqual(rename(tmp, to), 0)
    }

    /// Makes `here`'s data, xattrs and targets folders equal to `there`'s, as a sync engine
    /// does after the other device changed them: new folders made, new or changed files
    /// copied (`syncthingCopy`), what is gone deleted (deepest first). Returns what it changed.
    @discardableResult
    private func push(from there: String, to here: String, during: ((String) -> Void)? = nil) throws -> [String] {
        var changed: [String] = []
        let fm = FileManager.default
        for top in ["data", "xattrs", "targets"] {
            let src = there + "/" + top, dst = here + "/" + top
            let theirs = Set((fm.enumerator(atPath: src)?.allObjects as? [String]) ?? [])
            for rel in theirs.sorted() {
                var st = stat()
                XCTAssertEqual(lstat(src + "/" + rel, &st), 0)
                if st.st_mode & S_IFMT == S_IFDIR {
                    if !fm.fileExists(atPath: dst + "/" + rel) {
                        XCTAssertEqual(mkdir(dst + "/" + rel, st.st_mode & 0o7777), 0)
                        changed.append(top + "/" + rel)
                    }
                } else if st.st_mode & S_IFMT == S_IFREG {
                    if fm.contents(atPath: src + "/" + rel) != fm.contents(atPath: dst + "/" + rel) {
                        try syncthingCopy(src + "/" + rel, dst + "/" + rel, during: during)
                        changed.append(top + "/" + rel)
                    }
                }
            }
            let ours = (fm.enumerator(atPath: dst)?.allObjects as? [String]) ?? []
            for rel in ours.sorted(by: >) where !theirs.contains(rel) {
                XCTAssertNoThrow(try fm.removeItem(atPath: dst + "/" + rel))
                changed.append(top + "/" + rel)
            }
        }
        return changed
    }

    /// The errno of a stat of `path`, or 0.
    private func statErrno(_ path: String) -> Int32 {
        var st = stat()
        return stat(path, &st) == 0 ? 0 : errno
    }

    /// The size stat gives `path`, or -1.
    private func size(_ path: String) -> Int {
        var st = stat()
        return stat(path, &st) == 0 ? Int(st.st_size) : -1
    }

    /// The names a listing of `path` in the mount shows.
    private func listing(_ path: String) -> Set<String> {
        Set((try? FileManager.default.contentsOfDirectory(atPath: path)) ?? ["<listing failed>"])
    }

    func testFilesWrittenReplacedAndDeletedUnderneathShowWithinSeconds() throws {
        var rng = SeededBytes(seed: 25)
        let old = rng.bytes(10_000), replaced = rng.bytes(50_000), fresh = rng.bytes(70_000)
        let (here, there) = try twoDevices { m in
            XCTAssertEqual(writeFile(m.path("kept.txt"), old), 0)
            XCTAssertEqual(writeFile(m.path("gone.txt"), bytes("to be deleted on the other device")), 0)
        }
        // What this mount caches before the other device changes anything: pages, attributes,
        // entries, and an fd of the file that will be replaced.
        XCTAssertEqual(try readFile(here.path("kept.txt")).get(), old)
        let oldFD = open(here.path("kept.txt"), O_RDONLY)
        XCTAssertEqual(try sysPread(oldFD, old.count, 0).get(), old)
        defer { close(oldFD) }
        XCTAssertEqual(statErrno(here.path("gone.txt")), 0)
        // Names looked up while absent: the kernel remembers that (negative entries, 30 s),
        // and the store watcher must make it forget them when another device brings them.
        let long = String(repeating: "l", count: 200) + ".txt"
        for name in ["new.txt", long, "newdir"] { XCTAssertEqual(statErrno(here.path(name)), ENOENT) }

        XCTAssertEqual(writeFile(there.path(long), bytes("long")), 0)
        XCTAssertEqual(mkdir(there.path("newdir"), 0o755), 0)
        XCTAssertEqual(writeFile(there.path("new.txt"), fresh), 0)
        XCTAssertEqual(writeFile(there.path("kept.txt"), replaced), 0)
        XCTAssertEqual(unlink(there.path("gone.txt")), 0)
        sync()
        try push(from: there.store, to: here.store)

        XCTAssertTrue(waitUntil(5) { (try? readFile(here.path("new.txt")).get()) == fresh }, "a new file appears")
        XCTAssertTrue(waitUntil(5) { size(here.path("kept.txt")) == replaced.count }, "the replaced file's new size")
        XCTAssertTrue((try? readFile(here.path("kept.txt")).get()) == replaced, "the replaced file's new bytes")
        XCTAssertTrue(waitUntil(5) { statErrno(here.path("gone.txt")) == ENOENT }, "a deleted file disappears")
        XCTAssertTrue(
            waitUntil(5) { (try? readFile(here.path(long)).get()) == bytes("long") }, "a new long name appears")
        XCTAssertTrue(waitUntil(5) { statErrno(here.path("newdir")) == 0 }, "a new folder appears")
        XCTAssertEqual(listing(here.mnt), ["kept.txt", "new.txt", long, "newdir"])
        // The fd opened before still reads the version it opened (its backing inode lives on).
        XCTAssertTrue((try? sysPread(oldFD, old.count + 10, 0).get()) == old, "the fd opened before")
        // Changes this mount makes itself still work as before.
        XCTAssertEqual(writeFile(here.path("mine.txt"), bytes("mine")), 0)
        XCTAssertEqual(try readFile(here.path("mine.txt")).get(), bytes("mine"))
    }

    /// Where another writer is expected, the kernel remembers a name's absence for a second at
    /// most: the watcher may not see every directory (a daemon that is not root cannot mark
    /// the directories made after it started; the failpoint stands for that), and a name
    /// another device brings into such a directory must still show within seconds, as it did
    /// before negative entries. (With the entry time of 30 s it stayed hidden for 30 s.)
    func testANameBroughtWhereTheWatcherIsBlindShowsWithinSeconds() throws {
        let (here, there) = try twoDevices(environment: [
            "KEYBAGFS_TEST_FAILPOINTS": "watcher-cannot-mark-new-directories=on"
        ]) { m in
            XCTAssertEqual(mkdir(m.path("fresh"), 0o755), 0)  // made after the watcher started: not marked
            XCTAssertEqual(writeFile(m.path("fresh/kept.txt"), bytes("kept")), 0)
        }
        XCTAssertEqual(statErrno(here.path("fresh/new.txt")), ENOENT, "looked up while absent")
        XCTAssertEqual(writeFile(there.path("fresh/new.txt"), bytes("new")), 0)
        sync()
        try push(from: there.store, to: here.store)
        XCTAssertTrue(
            waitUntil(5) { (try? readFile(here.path("fresh/new.txt")).get()) == bytes("new") },
            "a name another device brings shows within seconds")
    }

    /// A change in a folder below the mount root, made underneath after the mount cached it.
    private func changeInAFolder(_ here: MountFixture, _ there: MountFixture) throws {
        XCTAssertEqual(try readFile(here.path("d/kept.txt")).get(), bytes("kept"))
        XCTAssertEqual(listing(here.path("d")), ["kept.txt"])
        XCTAssertEqual(writeFile(there.path("d/kept.txt"), bytes("replaced underneath")), 0)
        XCTAssertEqual(writeFile(there.path("d/new.txt"), bytes("new")), 0)
        sync()
        try push(from: there.store, to: here.store)
        XCTAssertTrue(
            waitUntil(5) { (try? readFile(here.path("d/kept.txt")).get()) == bytes("replaced underneath") },
            "the replaced file's new content")
        XCTAssertTrue(waitUntil(5) { self.listing(here.path("d")) == ["kept.txt", "new.txt"] }, "the new file")
    }

    /// The log of `m`'s daemon.
    private func daemonLog(_ m: MountFixture) -> String {
        (try? String(contentsOfFile: m.root + "/daemon.log", encoding: .utf8)) ?? ""
    }

    func testAStoreASyncEngineStartsOnWhileMountedIsWatchedFromItsFirstChange() throws {
        // No marker and one device: the daemon takes itself for the only writer and watches the
        // top level only. Syncthing, set up on the store later, makes `.stfolder` there first.
        let (here, there) = try twoDevices(marked: false) { m in
            XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
            XCTAssertEqual(writeFile(m.path("d/kept.txt"), bytes("kept")), 0)
        }
        XCTAssertTrue(daemonLog(here).contains("top level only"), daemonLog(here))
        XCTAssertEqual(mkdir(here.store + "/.stfolder", 0o755), 0)
        XCTAssertTrue(waitUntil(5) { self.daemonLog(here).contains("watching all of it") }, daemonLog(here))
        try changeInAFolder(here, there)
    }

    func testWatchStoreOnWatchesAStoreWithNoMarkerAndOffIsSaid() throws {
        // rclone or Unison leave no marker: `-o watch-store=on` watches anyway.
        let (here, there) = try twoDevices(marked: false, extra: ["-o", "watch-store=on"]) { m in
            XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
            XCTAssertEqual(writeFile(m.path("d/kept.txt"), bytes("kept")), 0)
        }
        try changeInAFolder(here, there)
        // A marked store with `--watch-store off` says so and is not watched (cache of 30 s).
        let (quiet, _) = try twoDevices(extra: ["--watch-store", "off"]) { _ in }
        XCTAssertTrue(daemonLog(quiet).contains("not watching the store"), daemonLog(quiet))
        let bad = MountFixture.run(
            MountFixture.binDir + "/keybagfs", ["mount", quiet.store, quiet.mnt, "-o", "watch-store=maybe"])
        XCTAssertNotEqual(bad.code, 0)
        XCTAssertTrue(bad.stderr.contains("watch-store=maybe: auto, on or off"), bad.stderr + bad.stdout)
    }

    func testChangesStillShowWhenTheWatcherLosesEvents() throws {
        var rng = SeededBytes(seed: 2526)
        let old = rng.bytes(10_000), replaced = rng.bytes(40_000), fresh = rng.bytes(5000)
        let (here, there) = try twoDevices(environment: ["KEYBAGFS_TEST_FAILPOINTS": "watcher-loses-events=on"]) { m in
            XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
            XCTAssertEqual(writeFile(m.path("d/kept.txt"), old), 0)
        }
        XCTAssertTrue((try? readFile(here.path("d/kept.txt")).get()) == old)
        XCTAssertEqual(size(here.path("d/kept.txt")), old.count)
        XCTAssertEqual(statErrno(here.path("d/new.txt")), ENOENT, "looked up while absent (a negative entry)")
        XCTAssertEqual(writeFile(there.path("d/kept.txt"), replaced), 0)
        XCTAssertEqual(writeFile(there.path("d/new.txt"), fresh), 0)
        sync()
        try push(from: there.store, to: here.store)
        // Every event is lost: the daemon drops all it may hold, names are looked up again.
        XCTAssertTrue(waitUntil(5) { size(here.path("d/kept.txt")) == replaced.count }, "the replaced file's new size")
        XCTAssertTrue((try? readFile(here.path("d/kept.txt")).get()) == replaced, "and its new bytes")
        XCTAssertTrue(waitUntil(5) { (try? readFile(here.path("d/new.txt")).get()) == fresh }, "the new file")
        XCTAssertEqual(writeFile(here.path("d/mine.txt"), bytes("mine")), 0, "the mount goes on working")
        XCTAssertEqual(listing(here.path("d")), ["kept.txt", "new.txt", "mine.txt"])
    }

    func testDirectoriesMadeRenamedAndRemovedUnderneath() throws {
        let (here, there) = try twoDevices { m in
            for d in ["a", "b", "old-dir"] { XCTAssertEqual(mkdir(m.path(d), 0o755), 0) }
            XCTAssertEqual(writeFile(m.path("a/one.txt"), bytes("one")), 0)
            XCTAssertEqual(writeFile(m.path("b/two.txt"), bytes("two")), 0)
            XCTAssertEqual(writeFile(m.path("old-dir/x"), bytes("x")), 0)
        }
        XCTAssertEqual(listing(here.path("a")), ["one.txt"])
        XCTAssertEqual(listing(here.path("old-dir")), ["x"])
        XCTAssertEqual(statErrno(here.path("b/two.txt")), 0)
        XCTAssertEqual(statErrno(here.path("c")), ENOENT)

        // The other device renames a file across folders and a folder (Syncthing sees the
        // renames and makes them here as renames), makes a tree, removes a folder.
        let oneBefore = backingRel(there, "a/one.txt"), bBefore = backingRel(there, "b")
        XCTAssertEqual(rename(there.path("a/one.txt"), there.path("b/one-moved.txt")), 0)
        XCTAssertEqual(rename(there.path("b"), there.path("c")), 0)
        XCTAssertEqual(mkdir(there.path("new-dir"), 0o755), 0)
        XCTAssertEqual(mkdir(there.path("new-dir/sub"), 0o755), 0)
        XCTAssertEqual(writeFile(there.path("new-dir/sub/deep.txt"), bytes("deep")), 0)
        XCTAssertEqual(unlink(there.path("old-dir/x")), 0)
        XCTAssertEqual(rmdir(there.path("old-dir")), 0)
        sync()
        let oneMoved = backingRel(there, "c/one-moved.txt")
        let oneInB = bBefore + "/" + (oneMoved as NSString).lastPathComponent
        XCTAssertEqual(rename(here.store + "/" + oneBefore, here.store + "/" + oneInB), 0)
        XCTAssertEqual(rename(here.store + "/" + bBefore, here.store + "/" + backingRel(there, "c")), 0)
        try push(from: there.store, to: here.store)

        XCTAssertTrue(waitUntil(5) { statErrno(here.path("b")) == ENOENT }, "a renamed folder leaves its old name")
        XCTAssertTrue(waitUntil(5) { statErrno(here.path("a/one.txt")) == ENOENT }, "a moved file leaves")
        XCTAssertTrue(waitUntil(5) { statErrno(here.path("old-dir")) == ENOENT }, "a removed folder disappears")
        XCTAssertTrue(waitUntil(5) { (try? readFile(here.path("new-dir/sub/deep.txt")).get()) == bytes("deep") })
        XCTAssertEqual(try readFile(here.path("c/one-moved.txt")).get(), bytes("one"))
        XCTAssertEqual(try readFile(here.path("c/two.txt")).get(), bytes("two"))
        XCTAssertEqual(listing(here.mnt), ["a", "c", "new-dir"])
        XCTAssertEqual(listing(here.path("a")), [])
        XCTAssertEqual(rmdir(here.path("a")), 0)
        XCTAssertEqual(mkdir(here.path("new-dir/sub/mine"), 0o755), 0, "a folder made underneath takes new entries")
    }

    func testFolderArrivingBeforeItsMetadataIsNotGivenANewOne() throws {
        let (here, there) = try twoDevices { _ in }
        XCTAssertEqual(mkdir(there.path("album"), 0o755), 0)
        XCTAssertEqual(writeFile(there.path("album/a.jpg"), bytes("a photo")), 0)
        sync()
        // The engine makes the folder first; its .kbfs-dir and files come after.
        let rel = backingRel(there, "album")
        XCTAssertEqual(mkdir(here.store + "/" + rel, 0o755), 0)
        XCTAssertTrue(waitUntil(5) { statErrno(here.path("album")) == 0 }, "the folder appears")
        XCTAssertThrowsError(
            try FileManager.default.contentsOfDirectory(atPath: here.path("album")),
            "a folder without its metadata yet is not listed as empty")
        XCTAssertEqual(writeFile(here.path("album/b.jpg"), bytes("b")), EIO, "nor written into")
        XCTAssertFalse(
            FileManager.default.fileExists(atPath: here.store + "/" + rel + "/.kbfs-dir"),
            "the daemon gives it no name IV of its own")
        try push(from: there.store, to: here.store)
        XCTAssertTrue(waitUntil(5) { listing(here.path("album")) == ["a.jpg"] }, "\(listing(here.path("album")))")
        XCTAssertTrue((try? readFile(here.path("album/a.jpg")).get()) == bytes("a photo"))
        XCTAssertEqual(writeFile(here.path("album/b.jpg"), bytes("b")), 0)
    }

    func testFileRewrittenInPlaceAndChmodUnderneathShowNewContentAndMode() throws {
        var rng = SeededBytes(seed: 52)
        let old = rng.bytes(12_000), new = rng.bytes(33_000)
        let (here, there) = try twoDevices { XCTAssertEqual(writeFile($0.path("db.bin"), old, mode: 0o644), 0) }
        // The other device saves a new version (a new file, so a new header and file key)...
        XCTAssertEqual(writeFile(there.path("db.new"), new), 0)
        XCTAssertEqual(rename(there.path("db.new"), there.path("db.bin")), 0)
        sync()
        // ...while this mount holds the old one's pages, attributes, header and key, and an fd.
        XCTAssertTrue((try? readFile(here.path("db.bin")).get()) == old)
        let fd = open(here.path("db.bin"), O_RDONLY)
        defer { close(fd) }
        XCTAssertTrue((try? sysPread(fd, 100, 0).get()) == Array(old.prefix(100)))
        // An engine that writes in place (rsync --inplace): same backing inode, new bytes.
        let rel = backingRel(here, "db.bin")
        let theirs = try XCTUnwrap(
            FileManager.default.contents(atPath: there.store + "/" + backingRel(there, "db.bin")))
        XCTAssertEqual(writeFile(here.store + "/" + rel, Array(theirs)), 0)
        XCTAssertTrue(waitUntil(5) { (try? readFile(here.path("db.bin")).get()) == new }, "the new content and size")
        let viaOld = sysPread(fd, 100, 0)
        XCTAssertTrue(
            (try? viaOld.get()) == Array(new.prefix(100)) || errnoOf(viaOld) == EIO,
            "an fd opened before reads the new version or EIO: \(viaOld)")
        // The engine copies a mode change.
        XCTAssertEqual(chmod(here.store + "/" + rel, 0o600), 0)
        XCTAssertTrue(
            waitUntil(5) {
                var st = stat()
                return stat(here.path("db.bin"), &st) == 0 && st.st_mode & 0o777 == 0o600
            }, "the new mode")
    }

    func testTransfersNeverListedClassChangesShowAndFsckNamesSyncFiles() throws {
        var rng = SeededBytes(seed: 2525)
        let photo = rng.bytes(9000), big = rng.bytes(300_000)
        let (here, there) = try twoDevices { XCTAssertEqual(writeFile($0.path("photo.jpg"), photo), 0) }
        XCTAssertEqual(writeFile(there.path("big.bin"), big), 0)
        sync()
        var seenDuring: [Set<String>] = []
        try push(from: there.store, to: here.store) { tmp in
            XCTAssertTrue(FileManager.default.fileExists(atPath: tmp))
            seenDuring.append(self.listing(here.mnt))
            XCTAssertEqual(self.statErrno(here.path((tmp as NSString).lastPathComponent)), ENOENT)
        }
        XCTAssertFalse(seenDuring.isEmpty)
        for names in seenDuring {
            XCTAssertTrue(names.isSubset(of: ["photo.jpg", "big.bin"]), "listed during a transfer: \(names)")
        }
        XCTAssertTrue(waitUntil(5) { (try? readFile(here.path("big.bin")).get()) == big })

        // A class change on the other device (a header rewrite: Syncthing brings a new file).
        // An open fd keeps the old version's backing inode, and so its node, alive here.
        XCTAssertEqual(try getXattr(here.path("photo.jpg")).get(), "completeUntilFirstUserAuthentication")
        let held = open(here.path("photo.jpg"), O_RDONLY)
        XCTAssertEqual(setXattr(there.path("photo.jpg"), "complete"), 0)
        XCTAssertEqual(setXattr(there.path("photo.jpg"), "blue", "user.tag"), 0)
        sync()
        try push(from: there.store, to: here.store)
        XCTAssertTrue(
            waitUntil(5) { (try? getXattr(here.path("photo.jpg")).get()) == "complete" }, "the class change shows")
        XCTAssertEqual(try getXattr(here.path("photo.jpg"), "user.tag").get(), "blue")
        XCTAssertEqual(try readFile(here.path("photo.jpg")).get(), photo)
        close(held)

        // A transfer in progress, and Syncthing's own files at the folder root (the store, or
        // only its data folder), are no entries of the mount and no damage to fsck.
        let data = here.store + "/data"
        let partial = data + "/.syncthing." + (backingRel(here, "big.bin") as NSString).lastPathComponent + "2.tmp"
        XCTAssertEqual(writeFile(partial, Array(big.prefix(5000))), 0)
        for root in [here.store, data] {
            XCTAssertTrue(mkdir(root + "/.stfolder", 0o755) == 0 || errno == EEXIST)
            XCTAssertEqual(writeFile(root + "/.stignore", bytes("// nothing\n")), 0)
            XCTAssertEqual(mkdir(root + "/.stversions", 0o755), 0)
            XCTAssertEqual(writeFile(root + "/.stversions/old~20261125-101010", bytes("an old version")), 0)
        }
        XCTAssertEqual(writeFile(data + "/~syncthing~other.tmp", bytes("windows")), 0)
        let photoBacking = (backingRel(here, "photo.jpg") as NSString).lastPathComponent
        XCTAssertEqual(writeFile(data + "/" + photoBacking + ".XyZ123.partial", bytes("rclone")), 0)
        XCTAssertEqual(listing(here.mnt), ["photo.jpg", "big.bin"])
        here.unmount()
        let log = (try? String(contentsOfFile: here.root + "/daemon.log", encoding: .utf8)) ?? ""
        XCTAssertFalse(log.contains("does not decrypt"), "a sync engine's files are not logged as damage: \(log)")
        let check = here.fsck()
        XCTAssertEqual(check.code, 0, "\(check.out)")
        XCTAssertEqual(Set(check.problems.map(\.kind)), ["sync-engine-file"], "\(check.out)")
        let repaired = here.fsck(["--repair", "--yes"])
        XCTAssertEqual(repaired.code, 0, "\(repaired.out)")
        XCTAssertTrue(FileManager.default.fileExists(atPath: partial), "a repair leaves a transfer in progress alone")
        XCTAssertTrue(FileManager.default.fileExists(atPath: data + "/.stfolder"))
        try here.mount()
        here.unlock()
        XCTAssertEqual(listing(here.mnt), ["photo.jpg", "big.bin"])
        XCTAssertEqual(try readFile(here.path("big.bin")).get(), big)
    }

    /// Brings the backing folder `from` into `to` as Syncthing does when the same folder was
    /// made on two devices apart: what `to` lacks is copied in (folders made), and a
    /// `.kbfs-dir` that differs arrives as a conflict copy, the one already there winning.
    private func mergeFolder(from: String, to: String, conflictStamp: String) throws {
        let fm = FileManager.default
        for name in try fm.contentsOfDirectory(atPath: from).sorted() {
            let src = from + "/" + name, dst = to + "/" + name
            var st = stat()
            XCTAssertEqual(lstat(src, &st), 0)
            if st.st_mode & S_IFMT == S_IFDIR {
                if !fm.fileExists(atPath: dst) { XCTAssertEqual(mkdir(dst, st.st_mode & 0o7777), 0) }
                try mergeFolder(from: src, to: dst, conflictStamp: conflictStamp)
            } else if !fm.fileExists(atPath: dst) {
                try syncthingCopy(src, dst)
            } else if fm.contents(atPath: src) != fm.contents(atPath: dst) {
                XCTAssertEqual(name, ".kbfs-dir", "only the folder's metadata differs under the same name")
                try syncthingCopy(src, to + "/.sync-conflict-" + conflictStamp + ".kbfs-dir")
            }
        }
    }

    func testAFolderMadeOnTwoDevicesApartShowsTheNamesOfBoth() throws {
        var rng = SeededBytes(seed: 2525)
        let mine = rng.bytes(9000), theirs = rng.bytes(7000), long = String(repeating: "l", count: 200) + ".txt"
        let (here, there) = try twoDevices { _ in }
        // The same folder made on each device before they sync: two random name IVs.
        XCTAssertEqual(mkdir(here.path("docs"), 0o755), 0)
        XCTAssertEqual(writeFile(here.path("docs/mine.txt"), mine), 0)
        XCTAssertEqual(writeFile(here.path("docs/same.txt"), bytes("made here")), 0)
        XCTAssertEqual(mkdir(there.path("docs"), 0o755), 0)
        XCTAssertEqual(writeFile(there.path("docs/theirs.txt"), theirs), 0)
        XCTAssertEqual(writeFile(there.path("docs/same.txt"), bytes("made there")), 0)
        XCTAssertEqual(writeFile(there.path("docs/" + long), bytes("a long name")), 0)
        XCTAssertEqual(mkdir(there.path("docs/sub"), 0o755), 0)
        XCTAssertEqual(writeFile(there.path("docs/sub/deep.txt"), bytes("deep")), 0)
        XCTAssertEqual(writeFile(there.path("docs/photo.jpg"), bytes("jpeg")), 0)
        XCTAssertEqual(setXattr(there.path("docs/photo.jpg"), "complete"), 0)
        sync()
        XCTAssertEqual(statErrno(here.path("docs/theirs.txt")), ENOENT)  // a negative entry the kernel may keep
        XCTAssertEqual(listing(here.path("docs")), ["mine.txt", "same.txt"])
        let hereDocs = here.backing("docs"), thereDocs = there.backing("docs")
        XCTAssertEqual((hereDocs as NSString).lastPathComponent, (thereDocs as NSString).lastPathComponent)

        // Each side gets the other's entries; here's metadata wins, there's is kept as a copy.
        let stamp = "20261125-101010-HOSTB27"
        try mergeFolder(from: thereDocs, to: hereDocs, conflictStamp: stamp)
        let expected: Set<String> = [
            "mine.txt", "same.txt", "theirs.txt", "same (conflict 2026-11-25 101010 HOSTB27).txt", long, "sub",
            "photo.jpg",
        ]
        XCTAssertTrue(waitUntil(5) { self.listing(here.path("docs")) == expected }, "\(listing(here.path("docs")))")
        XCTAssertEqual(try readFile(here.path("docs/theirs.txt")).get(), theirs)
        XCTAssertEqual(try readFile(here.path("docs/mine.txt")).get(), mine)
        XCTAssertEqual(try readFile(here.path("docs/same.txt")).get(), bytes("made here"))
        XCTAssertEqual(
            try readFile(here.path("docs/same (conflict 2026-11-25 101010 HOSTB27).txt")).get(), bytes("made there"))
        XCTAssertEqual(try readFile(here.path("docs/" + long)).get(), bytes("a long name"))
        XCTAssertEqual(try readFile(here.path("docs/sub/deep.txt")).get(), bytes("deep"))
        XCTAssertEqual(try getXattr(here.path("docs/photo.jpg")).get(), "complete")
        // A sync engine's copy of a file under the copy's IV shows, reads and goes like any.
        let theirsBacking = here.backing("docs/theirs.txt")
        XCTAssertEqual(
            MountFixture.run("/bin/cp", [theirsBacking, theirsBacking + ".sync-conflict-20261126-080000-HOSTC27"]).code,
            0)
        let fileCopy = "docs/theirs (conflict 2026-11-26 080000 HOSTC27).txt"
        XCTAssertTrue(
            waitUntil(5) { (try? readFile(here.path(fileCopy)).get()) == theirs }, "\(listing(here.path("docs")))")
        XCTAssertTrue(listing(here.path("docs")).contains((fileCopy as NSString).lastPathComponent))
        XCTAssertEqual(unlink(here.path(fileCopy)), 0)
        // The mount goes on working in the folder: new names, renames, removals.
        XCTAssertEqual(writeFile(here.path("docs/new.txt"), bytes("new")), 0)
        XCTAssertEqual(rename(here.path("docs/theirs.txt"), here.path("docs/theirs-renamed.txt")), 0)
        XCTAssertEqual(try readFile(here.path("docs/theirs-renamed.txt")).get(), theirs)
        XCTAssertEqual(unlink(here.path("docs/same (conflict 2026-11-25 101010 HOSTB27).txt")), 0)
        XCTAssertEqual(
            listing(here.path("docs")),
            ["mine.txt", "same.txt", "theirs-renamed.txt", long, "sub", "photo.jpg", "new.txt"])

        // The device whose metadata lost gets the winner's, and keeps its own as the copy.
        try syncthingCopy(hereDocs + "/.kbfs-dir", thereDocs + "/.kbfs-dir")
        try syncthingCopy(
            hereDocs + "/.sync-conflict-" + stamp + ".kbfs-dir",
            thereDocs + "/.sync-conflict-" + stamp + ".kbfs-dir")
        for name in ["mine.txt", "same.txt"] {
            let b = (here.backing("docs/" + name) as NSString).lastPathComponent
            try syncthingCopy(hereDocs + "/" + b, thereDocs + "/" + b)
        }
        XCTAssertTrue(
            waitUntil(5) { (try? readFile(there.path("docs/mine.txt")).get()) == mine }, "the winner's names show there"
        )
        XCTAssertEqual(try readFile(there.path("docs/theirs.txt")).get(), theirs, "and its own still do")
        XCTAssertEqual(try readFile(there.path("docs/same.txt")).get(), bytes("made here"))
        XCTAssertEqual(try readFile(there.path("docs/sub/deep.txt")).get(), bytes("deep"))

        for m in [here, there] {
            m.unmount()
            let check = m.fsck()
            XCTAssertEqual(check.code, 0, "\(check.out)")
            XCTAssertEqual(Set(check.problems.map(\.kind)), ["sync-engine-file"], "\(check.out)")
        }
    }

    func testPlantedFifosAndExtraMetadataCopiesNeitherHangNorHideTheFolder() throws {
        let long = String(repeating: "n", count: 220)
        let (here, _) = try twoDevices { m in
            XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
            XCTAssertEqual(writeFile(m.path("d/kept.txt"), bytes("kept")), 0)
            XCTAssertEqual(writeFile(m.path("d/" + long), bytes("long")), 0)
            XCTAssertEqual(mkdir(m.path("empty"), 0o755), 0)
        }
        // Someone who can write the store puts FIFOs where the daemon reads small files: a copy
        // of the folder's metadata, and a long name's side file. Opening one would block.
        let d = here.backing("d"), longBacking = here.backing("d/" + long)
        XCTAssertEqual(mkfifo(d + "/.sync-conflict-20261125-101010-FIFOAAA.kbfs-dir", 0o644), 0)
        XCTAssertEqual(unlink(longBacking + ".name"), 0)
        XCTAssertEqual(mkfifo(longBacking + ".name", 0o644), 0)
        let ls = MountFixture.run("/usr/bin/timeout", ["10", "/bin/ls", here.path("d")])
        XCTAssertEqual(ls.code, 0, "the listing returns: \(ls.stderr)")
        XCTAssertEqual(
            ls.stdout.split(separator: "\n").map(String.init), ["kept.txt"], "the long name has no readable side file")
        XCTAssertEqual(try readFile(here.path("d/kept.txt")).get(), bytes("kept"))
        // A folder holding only its metadata and a copy of it is empty: rmdir works.
        let empty = here.backing("empty")
        XCTAssertEqual(
            MountFixture.run("/bin/cp", [d + "/.kbfs-dir", empty + "/.sync-conflict-20261125-101010-HOSTB27.kbfs-dir"])
                .code, 0)
        XCTAssertEqual(rmdir(here.path("empty")), 0, String(cString: strerror(errno)))
        here.unmount()
        let check = MountFixture.run(
            "/usr/bin/timeout",
            ["20", MountFixture.binDir + "/keybagfs", "fsck", here.store, "--device-key", here.deviceKey, "--json"])
        XCTAssertNotEqual(check.code, 124, "fsck returns")
        XCTAssertTrue(check.stdout.contains("side-file"), check.stdout)
    }

    func testAClassChangedInPlaceBeforeTheFullWatchStartsIsSeenWhenItDoes() throws {
        // A store nothing marks: the top level only is watched. Another writer rewrites a file's
        // header in place (the other device made it `complete`) below the data root.
        let (here, there) = try twoDevices(marked: false) { m in
            XCTAssertEqual(mkdir(m.path("d"), 0o755), 0)
            XCTAssertEqual(writeFile(m.path("d/secret.txt"), bytes("secret")), 0)
        }
        XCTAssertEqual(try readFile(here.path("d/secret.txt")).get(), bytes("secret"))
        let held = open(here.path("d/secret.txt"), O_RDONLY)  // its node keeps the header it read
        defer { close(held) }
        XCTAssertEqual(try sysPread(held, 6, 0).get(), bytes("secret"))
        XCTAssertEqual(setXattr(there.path("d/secret.txt"), "complete"), 0)
        sync()
        let theirs = try Data(contentsOf: URL(fileURLWithPath: there.backing("d/secret.txt")))
        let fd = open(here.backing("d/secret.txt"), O_WRONLY)
        XCTAssertEqual(theirs.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) }, theirs.count)
        close(fd)
        // Syncthing starts on the store: the full watch, and what was missed is found.
        XCTAssertEqual(mkdir(here.store + "/.stfolder", 0o755), 0)
        XCTAssertTrue(waitUntil(5) { self.daemonLog(here).contains("watching all of it") }, daemonLog(here))
        here.lock()
        XCTAssertTrue(
            waitUntil(5) { errnoOf(readFile(here.path("d/secret.txt"))) == EACCES },
            "a complete file is unreadable once locked, whatever this device cached before")
        XCTAssertNotEqual(try? sysPread(held, 6, 0).get(), bytes("secret"), "so is it through a descriptor held since")
    }

    func testHalfSyncedFileReadsAsTheOldOrNewVersionOrEIOAndFsckNamesIt() throws {
        var rng = SeededBytes(seed: 250)
        let old = rng.bytes(20_000), new = rng.bytes(30_000)
        let (here, there) = try twoDevices { XCTAssertEqual(writeFile($0.path("doc.bin"), old), 0) }
        XCTAssertEqual(writeFile(there.path("doc.bin"), new), 0)
        sync()
        let rel = backingRel(there, "doc.bin")
        let whole = try XCTUnwrap(FileManager.default.contents(atPath: there.store + "/" + rel))
        // An engine that writes in place (or a copy that was cut off) leaves the new version
        // cut short: mid-block, at a block boundary, or with only part of the header. Cut to
        // exactly its header it is an empty file (what an empty file is): a known limit,
        // checked apart below.
        let blockSize = 4096 + 40, header = 320
        for cut in [whole.count - 1000, header + 2 * blockSize, header + blockSize + 7, 100] {
            XCTAssertEqual(try readFile(here.path("doc.bin")).get().count > 0, true)
            let staged = here.root + "/staged"
            _ = FileManager.default.createFile(atPath: staged, contents: whole.prefix(cut))
            try syncthingCopy(staged, here.store + "/" + rel)
            var seen: [String] = []
            XCTAssertTrue(
                waitUntil(5) {
                    switch readFile(here.path("doc.bin")) {
                    case .success(let b) where b == old: seen.append("old"); return false
                    case .success(let b) where b == new: seen.append("new"); return false
                    case .success(let b): seen.append("garbage of \(b.count) bytes"); return true
                    case .failure(let e): seen.append("errno \(e.rawValue)"); return e.rawValue == EIO
                    }
                }, "cut at \(cut): \(seen.suffix(3))")
            XCTAssertFalse(seen.contains { $0.hasPrefix("garbage") }, "cut at \(cut): \(seen)")
            here.unmount()
            let check = here.fsck()
            XCTAssertEqual(check.code, 1, "cut at \(cut): \(check.out)")
            let problems = check.out["problems"] as? [[String: Any]] ?? []
            XCTAssertTrue(problems.contains { ($0["name"] as? String)?.hasSuffix("doc.bin") == true }, "\(check.out)")
            XCTAssertTrue(
                problems.contains { ($0["detail"] as? String)?.contains("sync") == true },
                "fsck says a half-synced file may be the reason: \(check.out)")
            try syncthingCopy(there.store + "/" + rel, here.store + "/" + rel)
            try here.mount()
            here.unlock()
            XCTAssertTrue((try? readFile(here.path("doc.bin")).get()) == new)
        }
        // The limit: only the header arrived. It reads as the old or new version or as empty,
        // never as other bytes.
        _ = FileManager.default.createFile(atPath: here.root + "/staged", contents: whole.prefix(header))
        try syncthingCopy(here.root + "/staged", here.store + "/" + rel)
        XCTAssertTrue(
            waitUntil(5) { (try? readFile(here.path("doc.bin")).get()) == [] }, "a header alone is an empty file")
    }
}
