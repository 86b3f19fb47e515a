import Foundation
import Glibc
import XCTest

/// Real programs on the mount: git, tar + diff, rsync, sqlite, a C build, sparse copies,
/// and stress-ng's filesystem stressors.
final class WorkloadTests: XCTestCase {
    /// Runs a shell command in `dir`; fails the test on a non-zero exit.
    @discardableResult
    func sh(_ script: String, in dir: String, file: StaticString = #filePath, line: UInt = #line) -> ToolResult {
        let r = MountFixture.run("/bin/bash", ["-c", "set -euo pipefail; cd \"$0\"; " + script, dir], timeout: 600)
        XCTAssertEqual(
            r.code, 0, "\(script)\nstdout: \(r.stdout.suffix(2000))\nstderr: \(r.stderr.suffix(2000))", file: file,
            line: line)
        return r
    }

    func testGitTarRsyncAndCBuild() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        let src = m.root + "/src"
        sh(
            """
            mkdir -p src/lib src/docs && for i in $(seq 1 60); do seq 1 $((i * 40)) > src/lib/file$i.txt; done
            printf '#include <stdio.h>\\nint main(void){printf("built on keybagfs\\\\n");return 0;}\\n' > src/hello.c
            head -c 300000 /dev/urandom > src/docs/blob.bin; ln -s ../hello.c src/docs/link.c
            """, in: m.root)
        // tar extract, then diff -r against the source.
        sh("tar -C \(m.root) -cf \(m.root)/src.tar src && tar -xf \(m.root)/src.tar && diff -r \(src) src", in: m.mnt)
        // git init/add/commit/status/gc.
        sh(
            """
            cd src && git init -q && git config user.email t@example.com && git config user.name t
            git add -A && git commit -qm one && echo change >> lib/file1.txt && git commit -qam two
            test -z "$(git status --porcelain)" && git gc -q && git fsck --no-progress && test "$(git log --oneline | wc -l)" = 2
            """, in: m.mnt)
        // rsync in and out.
        sh("rsync -a \(src)/ rs-in/ && rsync -a rs-in/ \(m.root)/rs-out/ && diff -r \(src) \(m.root)/rs-out", in: m.mnt)
        // Build and run a C program on the mount.
        let r = sh("gcc -O1 -o hello src/hello.c && ./hello", in: m.mnt)
        XCTAssertEqual(r.stdout, "built on keybagfs\n")
    }

    func testSqliteTransactionsAndIntegrity() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("db"), 0o755), 0)
        XCTAssertEqual(setXattr(m.path("db"), "completeUnlessOpen"), 0)
        var sql = "PRAGMA journal_mode=WAL; CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT);\n"
        for i in 0..<10_000 {
            sql += "BEGIN; INSERT INTO t(v) VALUES('row \(i) \(String(repeating: "x", count: i % 50))'); COMMIT;\n"
        }
        try sql.write(toFile: m.root + "/load.sql", atomically: true, encoding: .utf8)
        sh("sqlite3 db/test.db < \(m.root)/load.sql >/dev/null", in: m.mnt)
        let r = sh("sqlite3 db/test.db 'PRAGMA integrity_check; SELECT count(*) FROM t;'", in: m.mnt)
        XCTAssertEqual(r.stdout, "ok\n10000\n")
        XCTAssertEqual(try getXattr(m.path("db/test.db")).get(), "completeUnlessOpen")
    }

    func testSparseCopyKeepsHoles() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        sh(
            "truncate -s 64M \(m.root)/sparse && printf end >> \(m.root)/sparse && cp --sparse=always \(m.root)/sparse s1 && cp --sparse=always s1 \(m.root)/back && cmp \(m.root)/sparse \(m.root)/back",
            in: m.mnt)
        var st = stat()
        XCTAssertEqual(stat(m.backing("s1"), &st), 0)
        XCTAssertLessThan(Int(st.st_blocks) * 512, 4 << 20, "holes stay holes in the store")
        XCTAssertEqual(stat(m.path("s1"), &st), 0)
        XCTAssertEqual(st.st_size, (64 << 20) + 3)
    }

    func testStressNgFilesystemStressors() throws {
        let m = try MountFixture()
        addTeardownBlock { m.close() }
        m.unlock()
        XCTAssertEqual(mkdir(m.path("stress"), 0o777), 0)
        let r = sh(
            """
            stress-ng --temp-path . --timeout 4 --metrics-brief \
              --dir 1 --dentry 1 --rename 1 --xattr 1 --fallocate 1 --seek 1 --hdd 1 --hdd-bytes 4M --verify 2>&1
            """, in: m.path("stress"))
        XCTAssertFalse(r.stdout.contains("failed: 1") || r.stdout.lowercased().contains("fail:"), r.stdout)
        XCTAssertTrue(r.stdout.contains("successful run completed") || r.stdout.contains("passed"), r.stdout)
    }
}
