#!/usr/bin/env python3
"""The power-cut workload (runs in the guest, Tests/powercut/guest-workload.sh).

Makes a keybagfs store on the ext4 under test, mounts it, and runs what people run: files and
folders made durable the POSIX way (fsync of the file, then of its folder), renames over
existing files, overwrites in place, appends, truncates, hard links, symlinks, xattrs, long
names, class changes, `keybagctl protect -R`, a passcode change, SQLite in WAL and in rollback
journal mode. After each operation it was told is durable it writes a mark into the
dm-log-writes log (`dmsetup message lw 0 mark N`) and appends to the journal, off the disk under
test, what it was told: one JSON line per mark, {"mark": N, "op": ..., "facts": {...}}, each fact
the expected state of one path (or of the passcode, or of a database) from that mark on.

argv: KBIN (folder of keybagfs and keybagctl), DISK (the ext4 mount), MNT (keybagfs mount point),
RUN (the run folder: journal, device key, recovery key).
"""
import hashlib
import json
import os
import sqlite3
import subprocess
import sys

KBIN, DISK, MNT, RUN = sys.argv[1:5]
STORE = DISK + "/store"
SOCK = "/tmp/kb.sock"
JOURNAL = open(RUN + "/journal", "a")
marks = 0


def run(argv, stdin=None):
    r = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"guest: {' '.join(argv)}: {r.returncode} {r.stderr.strip()}")
    return r.stdout


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable(op, facts, rewrites=()):
    """Marks the log after an operation that was acknowledged as durable and records its facts;
    `rewrites`: the paths whose existing blocks the operation rewrote in place (a cut in the
    middle may leave such a block torn: counted, not a failure, until "Overwrites a power cut
    cannot tear")."""
    global marks
    marks += 1
    run(["dmsetup", "message", "lw", "0", "mark", str(marks)])
    JOURNAL.write(json.dumps({"mark": marks, "op": op, "facts": facts, "rewrites": list(rewrites)}) + "\n")
    JOURNAL.flush()


def sha(data):
    return hashlib.sha256(data).hexdigest()


def file_fact(rel, data, cls="completeUntilFirstUserAuthentication", xattrs=None):
    return {rel: {"type": "file", "sha": sha(data), "size": len(data), "class": cls, "xattrs": xattrs or {}}}


def write_file(rel, data, sync_dir=True):
    path = MNT + "/" + rel
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    if sync_dir:
        fsync_path(os.path.dirname(path), directory=True)


def pattern(tag, n):
    """n bytes that name their writer and position (each 16-byte cell: tag and offset)."""
    out = bytearray()
    while len(out) < n:
        out += f"{tag[:8]:<8}{len(out):08x}".encode()
    return bytes(out[:n])


def main():
    os.makedirs(MNT, exist_ok=True)
    run([KBIN + "/keybagfs", "init", STORE, "--passcode-stdin", "--device-key", RUN + "/dk", "--kdf",
         "interactive", "--tpm2", "off", "--recovery-key-file", RUN + "/rk"], stdin="pw1\n")
    os.sync()
    durable("init", {"passcode": "pw1", "recovery": "rk"})
    # allow_other: PostgreSQL runs as its own user.
    run([KBIN + "/keybagfs", "mount", STORE, MNT, "--device-key", RUN + "/dk", "--socket", SOCK, "-o",
         "allow_other"])
    ctl = [KBIN + "/keybagctl", "--socket", SOCK]
    run(ctl + ["unlock", "--passcode-stdin"], stdin="pw1\n")

    a = pattern("create", 10000)
    write_file("created.txt", a)
    durable("create + fsync + fsync of the folder", file_fact("created.txt", a))

    os.mkdir(MNT + "/docs")
    fsync_path(MNT, directory=True)
    b = pattern("nested", 5000)
    write_file("docs/nested.txt", b)
    durable("mkdir, create in it, fsync both folders", {"docs": {"type": "dir"}, **file_fact("docs/nested.txt", b)})

    long = "L" * 200 + ".txt"
    c = pattern("longname", 3000)
    write_file(long, c)
    durable("a 200-byte name", file_fact(long, c))

    os.mkdir(MNT + "/vault")
    os.setxattr(MNT + "/vault", "user.protection", b"complete")
    fsync_path(MNT + "/vault", directory=True)
    fsync_path(MNT, directory=True)
    d = pattern("classA", 9000)
    write_file("vault/secret.txt", d)
    durable("a complete folder and a file in it", file_fact("vault/secret.txt", d, cls="complete"))

    os.setxattr(MNT + "/created.txt", "user.note", b"kept on fsync")
    fsync_path(MNT + "/created.txt")
    durable("setxattr + fsync of the file",
            file_fact("created.txt", a, xattrs={"user.note": "kept on fsync"}))

    e = pattern("renamed", 7000)
    write_file("docs/.tmp-new", e, sync_dir=False)
    os.rename(MNT + "/docs/.tmp-new", MNT + "/docs/nested.txt")
    fsync_path(MNT + "/docs", directory=True)
    durable("rename over an existing file + fsync of the folder",
            {**file_fact("docs/nested.txt", e), "docs/.tmp-new": {"type": "absent"}})

    f = pattern("blocks-v1", 3 * 4096)
    write_file("inplace.bin", f)
    durable("a three-block file", file_fact("inplace.bin", f))
    for version in range(2, 5):
        g = bytearray(f)
        g[4096:8192] = pattern(f"blocks-v{version}", 4096)
        fd = os.open(MNT + "/inplace.bin", os.O_WRONLY)
        os.pwrite(fd, bytes(g[4096:8192]), 4096)
        os.fsync(fd)
        os.close(fd)
        f = bytes(g)
        durable(f"overwrite the middle block in place, version {version}", file_fact("inplace.bin", f),
                rewrites=["inplace.bin"])

    rewrites()

    h = pattern("append", 2500)
    write_file("log.txt", h)
    for i in range(3):
        more = pattern(f"app{i}", 3000)
        fd = os.open(MNT + "/log.txt", os.O_WRONLY | os.O_APPEND)
        os.write(fd, more)
        os.fsync(fd)
        os.close(fd)
        h += more
        durable(f"append {i}", file_fact("log.txt", h), rewrites=["log.txt"])
    fd = os.open(MNT + "/log.txt", os.O_WRONLY)
    os.ftruncate(fd, 4100)
    os.fsync(fd)
    os.close(fd)
    h = h[:4100]
    durable("truncate", file_fact("log.txt", h), rewrites=["log.txt"])

    # Made durable by a directory fsync alone (the files' own fsyncs are long past).
    os.mkdir(MNT + "/empty-folder")
    fsync_path(MNT, directory=True)
    durable("mkdir + fsync of the parent folder", {"empty-folder": {"type": "dir"}})
    os.rename(MNT + "/created.txt", MNT + "/docs/moved.txt")
    fsync_path(MNT + "/docs", directory=True)
    fsync_path(MNT, directory=True)
    durable("rename into another folder + fsync of both",
            {"created.txt": {"type": "absent"},
             **file_fact("docs/moved.txt", a, xattrs={"user.note": "kept on fsync"})})
    os.unlink(MNT + "/" + long)
    fsync_path(MNT, directory=True)
    durable("unlink + fsync of the folder", {long: {"type": "absent"}})

    os.link(MNT + "/inplace.bin", MNT + "/docs/hardlink.bin")
    fsync_path(MNT + "/docs", directory=True)
    durable("hard link", file_fact("docs/hardlink.bin", f))

    os.symlink("docs/moved.txt", MNT + "/created.txt")
    os.symlink("docs/moved.txt", MNT + "/link-to-moved")
    fsync_path(MNT, directory=True)
    durable("symlinks + fsync of the folder", {"link-to-moved": {"type": "symlink", "target": "docs/moved.txt"},
                                               "created.txt": {"type": "symlink", "target": "docs/moved.txt"}})

    k = pattern("classB", 5000)
    write_file("moved-to-b.txt", k)
    os.setxattr(MNT + "/moved-to-b.txt", "user.protection", b"completeUnlessOpen")
    durable("class change", file_fact("moved-to-b.txt", k, cls="completeUnlessOpen"))

    os.mkdir(MNT + "/tree")
    for i in range(3):
        write_file(f"tree/t{i}.txt", pattern(f"tree{i}", 1000 + i))
    fsync_path(MNT, directory=True)
    run(ctl + ["protect", "-R", "complete", MNT + "/tree"])
    durable("keybagctl protect -R",
            {f"tree/t{i}.txt": file_fact(f"tree/t{i}.txt", pattern(f"tree{i}", 1000 + i), "complete")[f"tree/t{i}.txt"]
             for i in range(3)})

    run(ctl + ["passwd", "--passcode-stdin"], stdin="pw1\npw2\n")
    durable("passwd", {"passcode": "pw2"})

    for mode in ("wal", "delete"):
        db = sqlite3.connect(MNT + f"/{mode}.db", isolation_level=None)
        db.execute(f"PRAGMA journal_mode={mode}")
        # EXTRA: in rollback-journal mode SQLite then syncs the folder after deleting the journal
        # (the commit); FULL leaves the last commit to the next sync (SQLite's documentation).
        db.execute("PRAGMA synchronous=EXTRA")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        fsync_path(MNT, directory=True)
        for i in range(1, 13):
            db.execute("BEGIN")
            db.execute("INSERT INTO t VALUES (?, ?)", (i, pattern(f"row{i}", 300 + 40 * i).decode()))
            db.execute("COMMIT")
            durable(f"sqlite {mode} commit {i}", {f"{mode}.db": {"type": "sqlite", "rows": i}},
                    rewrites=[f"{mode}.db", f"{mode}.db-wal", f"{mode}.db-journal"])
        db.close()  # WAL: the checkpoint rewrites the database's pages in place
        durable(f"sqlite {mode} closed", {f"{mode}.db": {"type": "sqlite", "rows": 12}},
                rewrites=[f"{mode}.db", f"{mode}.db-wal", f"{mode}.db-journal"])

    postgres()
    run(["fusermount3", "-u", MNT])
    keybag_ops()
    print(f"guest: {marks} marks")


def rewrites():
    """Blocks rewritten in place, as databases do: a 24-block file, then 45 writes of one or two
    aligned blocks or an unaligned 6,000-byte span, fsync after every third. Every write is a new
    version of the bytes it covers (each 16-byte cell names the write), so each block's content
    names which writes made it. Each mark's fact: the sha of every block as acknowledged, and per
    block the shas it had after each write since the mark before (what a cut in that window may
    show; never EIO, never anything else)."""
    n, bs = 24, 4096
    path = MNT + "/rewrite.bin"
    data = bytearray(pattern("rw-v0", n * bs))
    write_file("rewrite.bin", bytes(data))

    def shas():
        return [sha(bytes(data[b * bs:(b + 1) * bs])) for b in range(n)]

    since = [[] for _ in range(n)]
    durable("rewrite: a 24-block file", {"rewrite.bin": {"type": "blocks", "blocks": n, "acked": shas(),
                                                          "since": since}})
    import random
    r = random.Random(43)
    fd = os.open(path, os.O_WRONLY)
    for w in range(1, 46):
        kind = r.randrange(3)
        if kind == 0:
            off, ln = r.randrange(n) * bs, bs
        elif kind == 1:
            off, ln = r.randrange(n - 1) * bs, 2 * bs
        else:
            off, ln = r.randrange(n * bs - 6000), 6000
        new = pattern(f"rw-v{w}", ln)
        os.pwrite(fd, new, off)
        data[off:off + ln] = new
        for b in range(off // bs, (off + ln - 1) // bs + 1):
            since[b].append(sha(bytes(data[b * bs:(b + 1) * bs])))
        if w % 3 == 0:
            os.fsync(fd)
            durable(f"rewrite: writes {w - 2}-{w} in place + fsync",
                    {"rewrite.bin": {"type": "blocks", "blocks": n, "acked": shas(), "since": since}})
            since = [[] for _ in range(n)]
    os.close(fd)


PG = "/usr/lib/postgresql/15/bin"


def as_pg(argv):
    return ["runuser", "-u", "postgres", "--"] + argv


def postgres():
    """PostgreSQL on the mount (fsync on, synchronous_commit on): numbered rows, each INSERT a
    transaction of its own, marked once psql has its acknowledgement."""
    os.mkdir(MNT + "/pg")
    os.chown(MNT + "/pg", *pg_ids())
    run(as_pg([PG + "/initdb", "-D", MNT + "/pg/data", "-A", "trust", "-U", "postgres", "-E", "UTF8",
               "--locale=C", "--no-instructions"]))
    fsync_path(MNT + "/pg", directory=True)
    fsync_path(MNT, directory=True)
    os.makedirs("/tmp/pgsock", exist_ok=True)
    os.chown("/tmp/pgsock", *pg_ids())
    run(as_pg([PG + "/pg_ctl", "-D", MNT + "/pg/data", "-l", "/tmp/pg.log", "-w", "-t", "300", "-o",
               "-c listen_addresses='' -k /tmp/pgsock -c fsync=on -c synchronous_commit=on", "start"]))
    psql = as_pg(["/usr/bin/psql", "-h", "/tmp/pgsock", "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-qc"])
    run(psql + ["CREATE TABLE t (id int PRIMARY KEY, v text)"])
    durable("postgres: initdb and a table", {"pg": {"type": "postgres", "rows": 0}})
    for i in range(1, 9):
        run(psql + [f"INSERT INTO t VALUES ({i}, repeat('row {i} ', 50))"])
        durable(f"postgres commit {i}", {"pg": {"type": "postgres", "rows": i}}, rewrites=["pg"])
    run(as_pg([PG + "/pg_ctl", "-D", MNT + "/pg/data", "-m", "fast", "-w", "stop"]))
    durable("postgres stopped (checkpoint)", {"pg": {"type": "postgres", "rows": 8}}, rewrites=["pg"])


def pg_ids():
    import pwd
    p = pwd.getpwnam("postgres")
    return p.pw_uid, p.pw_gid


def keybag_ops():
    """The keybag's own writes, on the unmounted store: a new recovery key, a second device
    added (its keybag in devices/), then removed (a new key set, its record)."""
    kb = KBIN + "/keybagfs"
    run([kb, "recovery-key", "rotate", STORE, "--device-key", RUN + "/dk", "--passcode-stdin",
         "--recovery-key-file", RUN + "/rk2"], stdin="pw2\n")
    durable("recovery-key rotate", {"recovery": "rk2"})
    run([kb, "device", "add", STORE, "--device-key", RUN + "/dk2", "--recovery-key-file", RUN + "/rk2", "--stdin",
         "--kdf", "interactive", "--tpm2", "off", "--name", "second"], stdin="second device\n")
    dev = run([kb, "device", "id", STORE, "--device-key", RUN + "/dk2"]).strip()
    durable("device add", {"device:dk2": {"type": "device", "passcode": "second device", "present": True}})
    run([kb, "device", "remove", STORE, dev, "--device-key", RUN + "/dk", "--stdin",
         "--recovery-key-file", RUN + "/rk2"], stdin="pw2\n")
    durable("device remove", {"device:dk2": {"type": "device", "passcode": "second device", "present": False}})


main()
