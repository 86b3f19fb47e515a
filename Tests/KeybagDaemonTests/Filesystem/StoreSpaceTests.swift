import XCTest

@testable import KeybagCore
@testable import KeybagDaemon

/// The thresholds of a tight mount (`StoreSpace.Thresholds`) against the promise in
/// docs/FORMAT.md, "The end of the space": a write(2) of up to min(4 MiB, size/16) bytes,
/// accepted while the kernel may hold up to `tightDirty` dirty bytes (and goes over that
/// limit by as much again before it throttles), is never lost for want of space.
final class StoreSpaceTests: XCTestCase {
    /// Bytes the store takes for `plain` bytes of content, with the costlier cipher's
    /// per-block overhead (nonce and tag) and a partly filled last page.
    func backing(_ plain: Int) -> Int {
        let layout = BlockLayout(cipher: .xchacha20poly1305)
        let blocks = (plain + BlockLayout.plainBlockSize - 1) / BlockLayout.plainBlockSize
        return blocks * layout.cipherBlockSize + 4096
    }

    /// Every write(2) the promise covers fits in what a check let through: the refusal
    /// threshold holds the sealed bytes of the write and of twice the dirty limit. (The old
    /// threshold, dirty limit + promised size, counted plaintext: a 16 MiB store lost the
    /// tail of a 1 MiB write when the kernel held its 512 KiB of dirty pages at the check.)
    func testTheRefusalThresholdHoldsAPromisedWriteAndTheDirtyPagesSealed() {
        for size in [16 << 20, 32 << 20, 100 << 20, 256 << 20, 1 << 30, 1 << 40] {
            for dirty in [1_000_000, 2_000_000, 4_000_000, 47 << 20] {
                let t = StoreSpace.Thresholds(size: size, dirty: dirty, canLowerDirty: true)
                let promised = min(4 << 20, size / 16)
                XCTAssertGreaterThanOrEqual(
                    t.refuseBelow, backing(promised + 2 * t.tightDirty), "store of \(size) bytes")
                // The loose limit is soft too (a 1 MiB write(2) may be one large folio): the
                // old threshold, sealed(dirty) + refuseBelow, lost 1 MiB at a 1-4 MB limit.
                XCTAssertGreaterThanOrEqual(
                    t.tightBelow, backing(2 * dirty + promised) + t.refuseBelow - t.tightDirty,
                    "turns tight while twice the loose dirty pages and a write(2) still fit (\(size), \(dirty))")
                XCTAssertGreaterThan(t.looseAbove, t.tightBelow, "no flapping between the states (\(size))")
            }
        }
    }

    /// A daemon that cannot lower the dirty limit still refuses with the promised write's
    /// sealed size to spare, and only a failed write makes its mount tight.
    func testWithoutALowerDirtyLimitOnlyAFailedWriteTurnsTight() {
        let t = StoreSpace.Thresholds(size: 1 << 30, dirty: 47 << 20, canLowerDirty: false)
        XCTAssertEqual(t.tightDirty, 0)
        XCTAssertEqual(t.tightBelow, 0)
        XCTAssertGreaterThanOrEqual(t.refuseBelow, backing(4 << 20))
    }
}
