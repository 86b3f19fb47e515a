import KeybagCore
import XCTest

/// The block geometry of plaintext ranges, against a byte-by-byte count.
final class PlainRangeTests: XCTestCase {
    let B = BlockLayout.plainBlockSize

    func testPartsOfARangeCoverItsBytesOnceInOrder() {
        for (offset, end) in [(0, 1), (0, 4096), (1, 4096), (4095, 4097), (100, 3 * 4096 + 7), (8192, 12288)] {
            let r = PlainRange(offset: offset, end: end)
            XCTAssertEqual(r.blocks, (offset / B)...((end - 1) / B))
            var next = offset
            for b in r.blocks {
                let p = r.part(ofBlock: b)
                XCTAssertEqual(b * B + p.lo, next, "block \(b) of \(offset)..<\(end) starts where the last ended")
                XCTAssertEqual(p.atInRange, next - offset)
                XCTAssertGreaterThan(p.count, 0)
                next += p.count
            }
            XCTAssertEqual(next, end)
            XCTAssertEqual(r.part(ofBlock: r.blocks.upperBound + 1).count, 0, "a block past the range has no part")
        }
    }

    func testAPartCoversAWholeBlockOnlyWhenItHasAllOfItsBytes() {
        let r = PlainRange(offset: 4096, end: 8192 + 10)
        XCTAssertTrue(r.part(ofBlock: 1).coversAll(ofLength: B))
        XCTAssertFalse(r.part(ofBlock: 2).coversAll(ofLength: B))
        XCTAssertTrue(r.part(ofBlock: 2).coversAll(ofLength: 10), "the file's short last block of 10 bytes")
        XCTAssertFalse(PlainRange(offset: 4097, end: 8192).part(ofBlock: 1).coversAll(ofLength: B))
    }

    func testBlockLengthsAndTheirCiphertext() {
        XCTAssertEqual(BlockLayout.lastBlock(ofSize: 0), -1)
        XCTAssertEqual(BlockLayout.lastBlock(ofSize: 4096), 0)
        XCTAssertEqual(BlockLayout.lastBlock(ofSize: 4097), 1)
        XCTAssertEqual(BlockLayout.length(ofBlock: 1, inFileOf: 4097), 1)
        XCTAssertEqual(BlockLayout.length(ofBlock: 2, inFileOf: 4097), 0)
        for cipher in ContentCipher.allCases {
            let layout = BlockLayout(cipher: cipher)
            for size in [1, 4096, 4097, 3 * 4096 + 5] {
                let all = 0...BlockLayout.lastBlock(ofSize: size)
                let sealed = layout.cipherRange(of: all, inFileOf: size)
                XCTAssertEqual(sealed, FileHeader.size..<layout.backingSize(plainSize: size), "\(cipher) \(size)")
                XCTAssertEqual(layout.plainSize(backingSize: sealed.upperBound), size)
                XCTAssertEqual(layout.cipherRange(ofWhole: all).count, all.count * layout.cipherBlockSize)
            }
        }
    }
}
