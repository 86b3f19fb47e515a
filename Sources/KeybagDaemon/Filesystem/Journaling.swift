import CSystem
import Foundation
import Glibc
import KeybagCore

/// The store's overwrite journal as the file operations use it: each file's identity in its
/// records (inode, file id, path in the store as a hint) made once per inode.
final class Journaling: Sendable {
    let journal: OverwriteJournal
    /// The store's path with a trailing slash (path hints are relative to it).
    let storePrefix: String

    /// Every `commitInterval`, and at once when the ring passes a quarter full, blocks still
    /// pending (written, never synced) are made durable and put in place, so the store's own
    /// copy of a file is whole again soon after a write, and the records of blocks durable in
    /// place are retired (writers rarely meet a full ring); false stops it (at unmount).
    let committing = Locked(true)
    static let commitInterval: UInt32 = 2_000_000

    /// Where notes go.
    let log: EventLog

    init(journal: OverwriteJournal, storePath: String, log: EventLog) {
        self.journal = journal
        self.log = log
        Thread.detachNewThread { [journal, committing, log] in
            var slept: UInt32 = 0
            while committing.withLock({ $0 }) {
                let filling = journal.filling.wait(timeout: .now() + .milliseconds(100)) == .success
                slept += filling ? 0 : 100_000
                let due = slept >= Self.commitInterval && (journal.pendingBlocks > 0 || journal.hasLiveRecords)
                guard filling || due else { continue }
                slept = 0
                do {
                    if Failpoint.journalKeepsRecords.isOn {
                        try journal.sync()
                        try journal.apply()
                    } else {
                        try journal.retire()
                    }
                } catch {
                    log("overwrite journal: pending blocks not put in place yet: \(error)")
                }
            }
        }
        let real = URL(fileURLWithPath: storePath).resolvingSymlinksInPath().path
        storePrefix = real.hasSuffix("/") ? real : real + "/"
    }

    /// `node`'s file as the journal writes it, through descriptor `fd`.
    func file(_ node: Node, _ state: FileState, fd: Int32, key: FileContentKey) -> JournaledFile {
        file(node, state, fd: fd, fileID: key.fileID)
    }

    /// `node`'s file (of header file id `fileID`) as the journal writes it, through `fd`. Its
    /// path in the store is the descriptor's, else (a file made unnamed and linked: its
    /// descriptor keeps the unnamed name) the node's own; it is kept once known.
    func file(_ node: Node, _ state: FileState, fd: Int32, fileID: [UInt8]) -> JournaledFile {
        let id = state.journalID.withLock { id -> JournalFileID in
            if let id, id.fileID == fileID, !id.path.isEmpty { return id }
            var path = pathHint(fd)
            if path.isEmpty {
                let f = node.open(kbfs_O_PATH)
                if f >= 0 {
                    path = pathHint(f)
                    close(f)
                }
            }
            let made = JournalFileID(
                ino: node.backingIno, stamp: id?.fileID == fileID ? id!.stamp : kbfs_inode_stamp(fd), fileID: fileID,
                path: path)
            id = made
            return made
        }
        return JournaledFile(journal: journal, id: id)
    }

    /// A file just created under the name `path` (its creator's descriptor `fd` is unnamed):
    /// its identity in records, with that path.
    func created(_ state: FileState, ino: UInt64, fd: Int32, fileID: [UInt8], path: String) {
        guard !path.isEmpty else { return }
        let id = JournalFileID(ino: ino, stamp: kbfs_inode_stamp(fd), fileID: fileID, path: path)
        state.journalID.withLock { $0 = id }
    }

    /// The store-relative path of the backing object of `fd` ("" when it is elsewhere).
    func path(of fd: Int32) -> String { pathHint(fd) }

    /// After `node` was renamed: its path in records is looked up again at its next write.
    func renamed(_ state: FileState) {
        state.journalID.withLock { id in
            if let old = id { id = JournalFileID(ino: old.ino, stamp: old.stamp, fileID: old.fileID, path: "") }
        }
    }

    /// After a name of a regular file (inode `ino`) went: where no handle has the file open,
    /// the journal lets a deleted file go (its space comes back); an open one goes at its
    /// last release.
    func nameRemoved(ino: UInt64, table: NodeTable, dev: UInt64) {
        if let n = table.node(dev: dev, ino: ino), let f = n.file, !f.openFDs.withLock({ $0.isEmpty }) { return }
        journal.forgetDeleted(ino: ino)
    }

    /// The backing file's path relative to the store ("" when it is elsewhere).
    private func pathHint(_ fd: Int32) -> String {
        var buf = [CChar](repeating: 0, count: Int(PATH_MAX) + 1)
        let n = readlink("/proc/self/fd/\(fd)", &buf, buf.count - 1)
        guard n > 0 else { return "" }
        let path = String(decoding: buf[0..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self)
        // A file made unnamed (O_TMPFILE) and linked keeps its "/#INO (deleted)" name here.
        guard path.hasPrefix(storePrefix), !path.hasSuffix(" (deleted)") else { return "" }
        return String(path.dropFirst(storePrefix.count))
    }
}
