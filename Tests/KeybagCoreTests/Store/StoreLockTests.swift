import Glibc
import KeybagCore
import XCTest

/// The store lock's reading of /proc: who holds a flock, and whether that process is exiting.
final class StoreLockTests: XCTestCase {
    func testTheHolderIsTheWriteFlockOnTheStoresDeviceAndInode() {
        let locks = """
            1: POSIX  ADVISORY  WRITE 700 fe:00:5 0 EOF
            2: FLOCK  ADVISORY  WRITE 1234 fe:00:16221233 0 EOF
            2: -> FLOCK  ADVISORY  WRITE 999 fe:00:16221233 0 EOF
            3: FLOCK  ADVISORY  WRITE 55 08:01:16221233 0 EOF
            """
        let dev = dev_t((0xfe << 8) | 0x00)
        XCTAssertEqual(StoreLock.holderPID(locks: locks, device: dev, inode: 16_221_233), 1234)
        XCTAssertEqual(StoreLock.holderPID(locks: locks, device: dev_t((8 << 8) | 1), inode: 16_221_233), 55)
        XCTAssertNil(StoreLock.holderPID(locks: locks, device: dev, inode: 5), "a POSIX lock is not the store lock")
        XCTAssertNil(StoreLock.holderPID(locks: "", device: dev, inode: 1))
    }

    func testTheStateLetterComesAfterTheCommandsLastParenthesis() {
        XCTAssertEqual(StoreLock.processState(stat: "10553 (python3) Z 1 10553"), "Z")
        XCTAssertEqual(StoreLock.processState(stat: "42 (a) b) (c) S 1 42"), "S")
        XCTAssertNil(StoreLock.processState(stat: "garbage"))
        XCTAssertFalse(StoreLock.isExiting(pid: getpid()), "this process is alive")
    }
}
