import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// What the mount tells the kernel about names while another writer may be in the store
/// (`ChangesUnderneath`), and which ACL xattrs it keeps (`PosixACLs`).
final class ChangesUnderneathTests: XCTestCase {
    func testAbsentNamesAreRememberedAtMostASecondOnceAnotherWriterIsExpected() {
        let u = ChangesUnderneath()
        XCTAssertEqual(u.negativeEntrySeconds(normal: 30), 30, "the only writer: as long as an entry")
        XCTAssertFalse(u.anotherWriterExpected)
        u.expectAnotherWriter()
        XCTAssertTrue(u.anotherWriterExpected)
        XCTAssertEqual(u.negativeEntrySeconds(normal: 30), 1)
        XCTAssertEqual(u.negativeEntrySeconds(normal: 0.25), 0.25, "never longer than asked")
    }

    /// A lookup compares the counter before and after: a change in between shows.
    func testNameChangesAreCounted() {
        let u = ChangesUnderneath()
        let before = u.namesSeen
        u.namesChanged()
        u.namesChanged()
        XCTAssertEqual(u.namesSeen, before + 2)
    }

    func testACLXattrsAreKeptOnlyWhereTheKernelEnforcesThem() {
        let acls = PosixACLs()
        XCTAssertFalse(acls.isACL("system.posix_acl_access"), "without FUSE_POSIX_ACL they are ordinary xattrs")
        acls.enabled.store(true, ordering: .relaxed)
        XCTAssertTrue(acls.isACL("system.posix_acl_access"))
        XCTAssertTrue(acls.isACL("system.posix_acl_default"))
        XCTAssertFalse(acls.isACL("user.posix_acl_access"))
        XCTAssertFalse(acls.isACL("security.capability"))
    }

    func testAClassChangeStartsANewGeneration() {
        let c = ClassDefaults(mountDefault: .completeUntilFirstUserAuthentication, policy: ClassPolicy())
        let g = c.current
        c.changed()
        XCTAssertGreaterThan(c.current, g, "inherited classes cached before are computed again")
        XCTAssertEqual(c.mountDefault, .completeUntilFirstUserAuthentication)
    }
}
