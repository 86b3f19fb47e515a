#!/usr/bin/env python3
"""keybagfs benchmark harness: filesystems side by side in one run, rounds interleaved.

Systems: plain (a folder on --on), passthrough (libfuse 3.14's example/passthrough_hp, the
FUSE limit: same round trips, no crypto; path in $PASSTHROUGH_HP), gocryptfs, keybagfs.
Every system is mounted fresh for every round, the order of the systems rotates from round to
round, and each round runs the same workloads on each system in turn.

Metric groups (--workloads, comma list; `canonical` and `apps` name the two sets):
  canonical: write read randwrite randread untar md5 ls rm
             (gocryptfs' published benchmark: 262 MB dd write with fsync, cold dd read, fio 4 KiB
             random write and read, tar -x of a Linux tree, md5sum -c of it on a cold cache,
             ls -lR, rm -rf)
  apps:      pgbench  PostgreSQL 15 data directory on the mount: pgbench -i (scale 10), TPC-B-like
                      and select-only runs (4 clients); checked: pgbench's failed transactions, the
                      TPC-B balance invariant, pg_amcheck (heap + all indexes), pg_checksums
             sqlite   sqlite3 in WAL mode: a scripted mix of small transactions, and a bulk load with
                      an index build; checked: PRAGMA integrity_check and the expected sums
             git      clone of a local repository of the tree, git status warm and cold, checkout
                      between two commits that touch thousands of files; checked: git fsck --full,
                      a clean status, and every file re-hashed against the commit
             build    make defconfig + make -j2 of part of the Linux source, objects on the mount;
                      checked: every object file identical to the other systems' in that round

For every metric: the value per round (wall clock), and for FUSE systems the daemon's own CPU
seconds (utime + stime of its process, /proc/PID/stat) during that step, reported per unit of
work (µs per MB written, per file, per transaction...). Daemon CPU is much steadier than wall time
on a shared machine. A failed correctness check records nan for the metric with a loud line; the
run goes on.

Needs root (mounts, dropping caches, running PostgreSQL as `postgres`). Use scripts/bench.sh,
which installs the Debian packages first.
"""

import argparse
import hashlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
PG_BIN = "/usr/lib/postgresql/15/bin"
LINUX_XZ = "/usr/src/linux-source-6.1.tar.xz"
TOP = "linux-source-6.1"
MEDIUM_PARTS = ["fs", "net", "kernel", "include", "sound", "lib", "mm", "crypto", "security", "block"]
QUICK_PARTS = ["fs"]

CANONICAL = ["write", "read", "randwrite", "randread", "untar", "md5", "ls", "rm"]
APPS = ["pgbench", "sqlite", "git", "build"]

# metric -> (group, higher is better, unit of work for the CPU column)
METRICS = {
    "write_MBps": ("write", True, "MB"),
    "read_MBps": ("read", True, "MB"),
    "randwrite_IOPS": ("randwrite", True, "IO"),
    "randread_IOPS": ("randread", True, "IO"),
    "untar_s": ("untar", False, "entry"),
    "md5_s": ("md5", False, "file"),
    "ls_s": ("ls", False, "entry"),
    "rm_s": ("rm", False, "entry"),
    "pg_init_s": ("pgbench", False, "row"),
    "pg_tpcb_tps": ("pgbench", True, "txn"),
    "pg_select_tps": ("pgbench", True, "txn"),
    "sqlite_mix_tps": ("sqlite", True, "txn"),
    "sqlite_bulk_s": ("sqlite", False, "row"),
    "git_clone_s": ("git", False, "file"),
    "git_status_warm_s": ("git", False, "file"),
    "git_status_cold_s": ("git", False, "file"),
    "git_checkout_s": ("git", False, "file"),
    "build_s": ("build", False, "object"),
}
NAN = float("nan")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def loud(msg):
    log("!" * 78)
    log("!! " + msg)
    log("!" * 78)


def run(argv, check=True, quiet=True, **kw):
    """Runs argv; returns CompletedProcess (stdout/stderr captured as text when quiet)."""
    if argv[0] == "runuser":
        kw.setdefault("cwd", "/")  # the postgres user may not enter the harness' folder
    if quiet:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    p = subprocess.run(argv, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))}: exit {p.returncode}: {(p.stderr or '')[-800:]}")
    return p


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        log(f"# cannot drop caches: {e}")


def proc_cpu(pid):
    """utime + stime of a process (all its threads), seconds; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def pids_with_arg(exe_name, arg):
    """Pids whose argv[0] ends in exe_name and who carry `arg` among their arguments."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == exe_name and arg in argv[1:]:
            out.append(int(d))
    return out


def is_mount(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


# ----------------------------------------------------------------------------- systems


class Mounted:
    """One system mounted for one round: `dir` is where the workloads run."""

    def __init__(self, name, base, harness, allow_other=False):
        self.name, self.base, self.h, self.allow_other = name, base, harness, allow_other
        self.dir = None
        self.mnt = None  # a FUSE mountpoint this harness made
        self.pids = []  # daemon processes whose CPU counts
        self.pg_data = None  # a PostgreSQL cluster running on it

    def cpu(self):
        if not self.pids:
            return None
        vals = [proc_cpu(p) for p in self.pids]
        return sum(v for v in vals if v is not None)

    def mount(self):
        os.makedirs(self.base)
        getattr(self, "_mount_" + self.name)()
        os.chmod(self.dir, 0o755)
        if self.mnt and not self.pids:
            log(f"# {self.name}: daemon pid not found; no CPU column for it")

    def _mount_plain(self):
        self.dir = os.path.join(self.base, "dir")
        os.mkdir(self.dir)

    def _fuse_dirs(self):
        s, m = os.path.join(self.base, "store"), os.path.join(self.base, "mnt")
        os.mkdir(s)
        os.mkdir(m)
        return s, m

    def _wait_mounted(self, m, what):
        for _ in range(200):
            if is_mount(m):
                return
            time.sleep(0.05)
        raise RuntimeError(f"{what}: {m} did not get mounted")

    def _mount_passthrough(self):
        s, m = self._fuse_dirs()
        # 3.14's example daemonizes unless --foreground; it mounts after its parent returned.
        self.mnt = m
        run([self.h.args.passthrough_hp, s, m], stdin=subprocess.DEVNULL)
        self._wait_mounted(m, "passthrough_hp")
        self.pids = pids_with_arg("passthrough_hp", m)
        self.dir = m

    def _mount_gocryptfs(self):
        s, m = self._fuse_dirs()
        run(["gocryptfs", "-q", "-init", "-extpass", "echo pw", s])
        self.mnt = m
        run(["gocryptfs", "-q"] + (["-allow_other"] if self.allow_other else []) + ["-extpass", "echo pw", s, m])
        self._wait_mounted(m, "gocryptfs")
        self.pids = pids_with_arg("gocryptfs", m)
        self.dir = m

    def _mount_before(self):
        """keybagfs from the binaries of --keybagfs-before: a change measured against the code before it."""
        self._mount_keybagfs(self.h.args.keybagfs_before)

    def _mount_keybagfs(self, bindir=None):
        s, m = self._fuse_dirs()
        kb, ctl = self.h.kb_bin("keybagfs", bindir), self.h.kb_bin("keybagctl", bindir)
        dk, sock = os.path.join(self.base, "device.key"), os.path.join(self.base, "sock")
        run([kb, "init", s, "--passcode-stdin", "--device-key", dk, "--kdf", "interactive",
             "--no-recovery-key", "--tpm2", "off"], input="pw\n")
        argv = [kb, "mount", s, m, "--device-key", dk, "--socket", sock, "--grace", "0"]
        if self.allow_other:
            argv += ["-o", "allow_other"]
        if self.h.args.keybagfs_class:
            argv += ["--default-class", self.h.args.keybagfs_class]
        self.mnt = m
        run(argv)
        self._wait_mounted(m, "keybagfs")
        run([ctl, "--socket", sock, "unlock", "--passcode-stdin"], input="pw\n")
        st = json.loads(run([ctl, "--socket", sock, "status", "--json"]).stdout)
        self.pids = [int(st["pid"])]
        self.dir = m

    def teardown(self):
        """Stops what runs on it, unmounts it, ends its daemons and deletes its folders."""
        if self.pg_data:
            self.h.pg_stop(self.pg_data, "immediate")
            self.pg_data = None
        if self.mnt and is_mount(self.mnt):
            for attempt in range(20):
                if run(["fusermount3", "-u", self.mnt], check=False).returncode == 0:
                    break
                time.sleep(0.25)
            else:
                log(f"# {self.name}: {self.mnt} busy, lazy unmount")
                run(["umount", "-l", self.mnt], check=False)
        deadline = time.monotonic() + 10
        for pid in self.pids:
            while proc_cpu(pid) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc_cpu(pid) is not None:
                log(f"# {self.name}: daemon {pid} still running after unmount, killing it")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.pids = []
        if self.mnt and is_mount(self.mnt):
            log(f"# {self.name}: {self.mnt} is still mounted; leaving its folder")
            return
        shutil.rmtree(self.base, ignore_errors=True)


# ----------------------------------------------------------------------------- harness


class Harness:
    def __init__(self, args):
        self.args = args
        self.groups = args.groups
        self.results = {}  # (system, metric) -> {round: (value, cpu_s or None, units)}
        self.live = []  # Mounted objects to tear down on exit
        self.work = None
        self.pg_port = 54329 + os.getpid() % 500

    def kb_bin(self, name, bindir=None):
        return os.path.join(bindir or self.args.keybagfs, name)

    # --- recording -----------------------------------------------------------------------
    def record(self, m, metric, rnd, value, cpu, units):
        self.results.setdefault((m.name, metric), {})[rnd] = (value, cpu, units)
        c = "" if cpu is None else f"   daemon {cpu:.2f} s CPU ({cpu_per_unit(cpu, units, metric)})"
        log(f"  r{rnd} {m.name:<12} {metric:<18} {fmt_num(value):>10}{c}")

    def fail(self, m, rnd, metrics, why):
        loud(f"{m.name}, round {rnd}: CHECK FAILED ({why}); recorded nan for {', '.join(metrics)}")
        for metric in metrics:
            old = self.results.get((m.name, metric), {}).get(rnd)
            self.results.setdefault((m.name, metric), {})[rnd] = (NAN, old[1] if old else None, old[2] if old else 0)

    def timed(self, m, argv, **kw):
        """Runs argv on the mount; returns (seconds, daemon CPU seconds or None, CompletedProcess)."""
        c0 = m.cpu()
        t0 = time.monotonic()
        p = run(argv, check=False, **kw)
        t1 = time.monotonic()
        c1 = m.cpu()
        return t1 - t0, (None if c0 is None or c1 is None else c1 - c0), p

    # --- shared inputs ---------------------------------------------------------------------
    def prepare(self):
        a = self.args
        self.work = tempfile.mkdtemp(prefix="kbbench.", dir=a.on)
        os.chmod(self.work, 0o755)  # PostgreSQL runs as its own user under here
        g = set(self.groups)
        tree_parts = {"quick": QUICK_PARTS, "medium": MEDIUM_PARTS, "full": None}
        need_canon = bool(g & set(CANONICAL))
        git_tree = "quick" if a.quick_apps else "medium"
        # one xz pass: the union of what the workloads need
        want = []
        if "build" in g or (need_canon and a.tree == "full"):
            want = None
        else:
            if need_canon:
                want += tree_parts[a.tree]
            if "git" in g:
                want += tree_parts[git_tree]
        self.src = os.path.join(self.work, "src")
        if want is None or want:
            os.mkdir(self.src)
            log(f"# unpacking {LINUX_XZ} ({'all' if want is None else ' '.join(sorted(set(want)))})")
            members = [] if want is None else [f"{TOP}/{p}" for p in sorted(set(want))]
            sh(f"xz -dc {LINUX_XZ} | tar -C {shlex.quote(self.src)} -xf - " + " ".join(map(shlex.quote, members)))
        if need_canon:
            self.prepare_tree(tree_parts[a.tree])
        if "git" in g:
            self.prepare_git(tree_parts[git_tree])
        if "sqlite" in g:
            self.prepare_sqlite()
        if "build" in g and a.build_targets is None:
            a.build_targets = "scripts" if a.quick_apps else "lib/ kernel/"
        if "pgbench" in g:
            self.pgsock = os.path.join(self.work, "pgsock")
            os.mkdir(self.pgsock)
            shutil.chown(self.pgsock, "postgres", "postgres")
        if "build" not in g:
            shutil.rmtree(self.src, ignore_errors=True)

    def prepare_tree(self, parts):
        """The canonical tree as an uncompressed tar (xz must not count in untar), with reference
        md5sums and the line count of ls -lR."""
        self.tar = os.path.join(self.work, "tree.tar")
        members = [TOP] if parts is None else [f"{TOP}/{p}" for p in parts]
        run(["tar", "-C", self.src, "-cf", self.tar] + members)
        ref = os.path.join(self.work, "ref")
        os.mkdir(ref)
        run(["tar", "-C", ref, "-xf", self.tar])
        self.md5sums = os.path.join(self.work, "md5sums")
        sh(f"cd {shlex.quote(ref)} && find . -type f -print0 | sort -z | xargs -0 md5sum > {shlex.quote(self.md5sums)}")
        self.tree_files = sum(1 for _ in open(self.md5sums))
        self.tree_entries = int(run(["sh", "-c", f"tar -tf {shlex.quote(self.tar)} | wc -l"]).stdout)
        self.ls_lines = int(run(["sh", "-c", f"cd {shlex.quote(ref)} && ls -lR {TOP} | wc -l"]).stdout)
        shutil.rmtree(ref)
        log(f"# canonical tree: {self.tree_entries} entries, {self.tree_files} files, "
            f"{os.path.getsize(self.tar) / 1e6:.0f} MB tar")

    def prepare_git(self, parts):
        """A local repository: commit A = the tree, commit B = A with every 4th file edited, every 40th
        deleted and 300 added; HEAD at B, packed."""
        repo = self.git_src = os.path.join(self.work, "gitsrc")
        os.mkdir(repo)
        for p in parts:
            shutil.copytree(os.path.join(self.src, TOP, p), os.path.join(repo, p), symlinks=True)
        # gc.auto=0: a commit of the medium tree would start an automatic gc in the background,
        # which then holds gc.pid and makes the explicit gc below fail.
        g = ["git", "-C", repo, "-c", "user.name=bench", "-c", "user.email=bench@localhost",
             "-c", "commit.gpgsign=false", "-c", "gc.auto=0", "-c", "maintenance.auto=false"]
        run(g + ["init", "-q", "-b", "main"])
        run(g + ["add", "-A"])
        run(g + ["commit", "-q", "-m", "A"])
        run(g + ["tag", "A"])
        files = sorted(run(g + ["ls-files"]).stdout.splitlines())
        for i, f in enumerate(files):
            path = os.path.join(repo, f)
            if os.path.islink(path):
                continue
            if i % 40 == 7:
                os.unlink(path)
            elif i % 4 == 1:
                with open(path, "a") as fh:
                    fh.write(f"\n/* kbbench edit {i} */\n")
        os.mkdir(os.path.join(repo, "kbbench-new"))
        for i in range(300):
            with open(os.path.join(repo, "kbbench-new", f"f{i:03}.c"), "w") as fh:
                fh.write(f"int kbbench_{i}(void) {{ return {i}; }}\n" * (1 + i % 20))
        run(g + ["add", "-A"])
        run(g + ["commit", "-q", "-m", "B"])
        run(g + ["tag", "B"])
        run(g + ["gc", "-q"])
        self.git_files = len(run(g + ["ls-files"]).stdout.splitlines())
        self.git_changed = len(run(g + ["diff", "--name-only", "A", "B"]).stdout.splitlines())
        log(f"# git repository: {self.git_files} files at B, {self.git_changed} files differ between A and B")

    def prepare_sqlite(self):
        """The transaction mix as one SQL script and its expected outcome, computed here."""
        a = self.args
        self.sq_accounts = 10000
        self.sq_txns = 2000 if a.quick_apps else 20000
        self.sq_rows = 100000 if a.quick_apps else 1000000
        rnd = random.Random(42)
        bal = [0] + [1000] * self.sq_accounts
        log_rows, writes = 0, 0
        lines = ["PRAGMA journal_mode=WAL;", "PRAGMA synchronous=FULL;", "PRAGMA busy_timeout=10000;"]
        for i in range(self.sq_txns):
            k = i % 10
            if k < 6:  # transfer: two updates and a log row
                x, y = rnd.randint(1, self.sq_accounts), rnd.randint(1, self.sq_accounts)
                amt = rnd.randint(1, 100)
                bal[x] -= amt
                bal[y] += amt
                log_rows += 1
                lines.append(f"BEGIN; UPDATE accounts SET balance=balance-{amt} WHERE id={x}; "
                             f"UPDATE accounts SET balance=balance+{amt} WHERE id={y}; "
                             f"INSERT INTO log(a,b,amount,note) VALUES({x},{y},{amt},'transfer {i}'); COMMIT;")
            elif k < 8:  # read-only
                x = rnd.randint(1, self.sq_accounts - 50)
                lines.append(f"BEGIN; SELECT sum(balance) FROM accounts WHERE id BETWEEN {x} AND {x + 50}; COMMIT;")
            elif k == 8:  # delete the oldest log row
                log_rows -= 1
                lines.append("BEGIN; DELETE FROM log WHERE id=(SELECT min(id) FROM log); COMMIT;")
            else:  # rewrite a note
                lines.append(f"BEGIN; UPDATE log SET note='edited {i} ' || note WHERE id=(SELECT max(id) FROM log); COMMIT;")
            writes += k != 6 and k != 7
        self.sq_mix = os.path.join(self.work, "sqlite-mix.sql")
        with open(self.sq_mix, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.sq_expect = (sum(bal), sum(i * b for i, b in enumerate(bal)), log_rows)
        n = self.sq_rows
        self.sq_bulk_expect = (n, sum((x * 7919) % 1000003 for x in range(1, n + 1)))

    # --- PostgreSQL ------------------------------------------------------------------------
    def as_pg(self, argv, **kw):
        return ["runuser", "-u", "postgres", "--"] + argv

    def pg_stop(self, data, mode="fast"):
        run(self.as_pg([f"{PG_BIN}/pg_ctl", "-D", data, "-m", mode, "-w", "stop"]), check=False)

    # --- workloads -------------------------------------------------------------------------
    def canonical(self, m, r):
        g, d = set(self.groups), m.dir
        mb = 2000 * 131072 / 1e6
        if g & {"write", "read"}:
            t, c, p = self.timed(m, ["dd", "if=/dev/zero", "of=zero", "bs=131072", "count=2000", "conv=fsync"], cwd=d)
            if "write" in g:
                self.record(m, "write_MBps", r, mb / t if p.returncode == 0 else NAN, c, mb)
                if p.returncode:
                    self.fail(m, r, ["write_MBps"], f"dd write: {p.stderr.strip()[-200:]}")
            if "read" in g:
                run(["dd", "if=zero", "iflag=nocache", "count=0", "status=none"], cwd=d, check=False)
                drop_caches()
                t, c, p = self.timed(m, ["dd", "if=zero", "of=/dev/null", "bs=131072", "count=2000"], cwd=d)
                self.record(m, "read_MBps", r, mb / t, c, mb)
                ok = p.returncode == 0 and run(["cmp", "-n", str(2000 * 131072), "zero", "/dev/zero"],
                                               cwd=d, check=False).returncode == 0 \
                    and os.path.getsize(os.path.join(d, "zero")) == 2000 * 131072
                if not ok:
                    self.fail(m, r, ["read_MBps"], "the file read back is not the 262 MB of zeros written")
            os.unlink(os.path.join(d, "zero"))
        if g & {"randwrite", "randread"}:  # laid out untimed: the random runs then only overwrite and read
            run(["fio", "--name=rw", "--filename=fio.dat", "--size=128m", "--create_only=1"], cwd=d)
        for kind, metric, field in (("randwrite", "randwrite_IOPS", 48), ("randread", "randread_IOPS", 7)):
            if kind not in g:
                continue
            if kind == "randread":
                drop_caches()
            t, c, p = self.timed(m, ["fio", "--name=rw", "--filename=fio.dat", "--size=128m", "--bs=4k",
                                     f"--rw={kind}", "--ioengine=psync", f"--runtime={self.args.fio_seconds}",
                                     "--time_based", "--output-format=terse", "--terse-version=3"], cwd=d)
            try:
                f = p.stdout.strip().splitlines()[-1].split(";")
                iops, kb, err = float(f[field]), float(f[field - 2]), int(f[4])
            except (IndexError, ValueError):
                iops, kb, err = NAN, 0, -1
            self.record(m, metric, r, iops, c, kb / 4)
            if p.returncode or err:
                self.fail(m, r, [metric], f"fio exit {p.returncode}, error {err}: {p.stderr.strip()[-200:]}")
        if "randread" in g or "randwrite" in g:
            try:
                os.unlink(os.path.join(d, "fio.dat"))
            except FileNotFoundError:
                pass
        if not g & {"untar", "md5", "ls", "rm"}:
            return
        tree_metrics = [x for x in ("untar_s", "md5_s", "ls_s", "rm_s") if METRICS[x][0] in g]
        t, c, p = self.timed(m, ["tar", "-xf", self.tar], cwd=d)
        if "untar" in g:
            self.record(m, "untar_s", r, t, c, self.tree_entries)
        if p.returncode:
            log(f"# {m.name}: tar exit {p.returncode} ({p.stderr.strip().splitlines()[-1][:160] if p.stderr.strip() else ''}); "
                "the md5 check decides whether the tree came out intact")
        drop_caches()
        t, c, p = self.timed(m, ["md5sum", "--quiet", "-c", self.md5sums], cwd=d)
        if "md5" in g:
            self.record(m, "md5_s", r, t, c, self.tree_files)
        if p.returncode:
            bad = [x for x in tree_metrics if x in ("untar_s", "md5_s")]
            self.fail(m, r, bad, f"md5sum -c: {len(p.stdout.splitlines())} files differ or are missing "
                                 f"(e.g. {p.stdout.splitlines()[0] if p.stdout else p.stderr.strip()[:120]})")
        t, c, p = self.timed(m, ["ls", "-lR", TOP], cwd=d)
        if "ls" in g:
            self.record(m, "ls_s", r, t, c, self.tree_entries)
            lines = p.stdout.count("\n")
            if p.returncode or lines != self.ls_lines:
                self.fail(m, r, ["ls_s"], f"ls -lR printed {lines} lines, expected {self.ls_lines}")
        t, c, p = self.timed(m, ["rm", "-rf", TOP], cwd=d)
        if "rm" in g:
            self.record(m, "rm_s", r, t, c, self.tree_entries)
            if p.returncode or os.path.lexists(os.path.join(d, TOP)):
                self.fail(m, r, ["rm_s"], f"rm -rf left the tree behind: {p.stderr.strip()[:160]}")
        shutil.rmtree(os.path.join(d, TOP), ignore_errors=True)

    def pgbench(self, m, r):
        a, d = self.args, m.dir
        names = ["pg_init_s", "pg_tpcb_tps", "pg_select_tps"]
        pgdir = os.path.join(d, "pg")
        os.mkdir(pgdir)
        shutil.chown(pgdir, "postgres", "postgres")
        data = os.path.join(pgdir, "data")
        p = run(self.as_pg([f"{PG_BIN}/initdb", "-D", data, "-k", "-A", "trust", "-U", "postgres", "-E", "UTF8",
                            "--locale=C", "--no-instructions", "-N"]), check=False)
        if p.returncode:
            return self.fail(m, r, names, f"initdb: {p.stderr.strip()[-300:]}")
        logf = os.path.join(self.work, f"pg-{m.name}-{r}.log")
        open(logf, "w").close()
        shutil.chown(logf, "postgres", "postgres")
        opts = f"-c listen_addresses='' -k {self.pgsock} -p {self.pg_port} -c max_connections=20"
        p = run(self.as_pg([f"{PG_BIN}/pg_ctl", "-D", data, "-l", logf, "-o", opts, "-w", "-t", "120", "start"]),
                check=False)
        if p.returncode:
            return self.fail(m, r, names, f"pg_ctl start: {p.stderr.strip()[-300:]} (log {logf})")
        m.pg_data = data
        conn = ["-h", self.pgsock, "-p", str(self.pg_port), "-U", "postgres"]
        pgb = [f"{PG_BIN}/pgbench"] + conn
        t, c, p = self.timed(m, self.as_pg(pgb + ["-i", "-s", "10", "-q", "postgres"]))
        self.record(m, "pg_init_s", r, t, c, 1000000)
        problems = [] if p.returncode == 0 else [f"pgbench -i: {p.stderr.strip()[-200:]}"]
        processed = {}
        for metric, extra in (("pg_tpcb_tps", []), ("pg_select_tps", ["-S"])):
            t, c, p = self.timed(m, self.as_pg(pgb + extra + ["-c", "4", "-j", "2", "-T", str(a.pg_seconds),
                                                              "-n", "postgres"]))
            tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", p.stdout)
            n = re.search(r"number of transactions actually processed: (\d+)", p.stdout)
            failed = re.search(r"number of failed transactions: (\d+)", p.stdout)
            processed[metric] = int(n.group(1)) if n else 0
            self.record(m, metric, r, float(tps.group(1)) if tps else NAN, c, processed[metric])
            if p.returncode or not tps or (failed and int(failed.group(1))):
                problems.append(f"{metric}: pgbench exit {p.returncode}, "
                                f"failed {failed.group(1) if failed else '?'}: {p.stderr.strip()[-200:]}")
        # TPC-B invariant: every transaction adds the same delta to one account, teller, branch
        # and a history row
        q = ("SELECT (SELECT sum(abalance) FROM pgbench_accounts), (SELECT sum(tbalance) FROM pgbench_tellers), "
             "(SELECT sum(bbalance) FROM pgbench_branches), (SELECT coalesce(sum(delta),0) FROM pgbench_history), "
             "(SELECT count(*) FROM pgbench_history), (SELECT count(*) FROM pgbench_accounts)")
        p = run(self.as_pg([f"{PG_BIN}/psql"] + conn + ["-XAtq", "-F", " ", "-c", q, "postgres"]), check=False)
        try:
            acc, tel, bra, hist, nhist, nacc = map(int, p.stdout.split())
            if not (acc == tel == bra == hist) or nhist != processed["pg_tpcb_tps"] or nacc != 1000000:
                problems.append(f"TPC-B invariant broken: accounts {acc}, tellers {tel}, branches {bra}, "
                                f"history {hist} ({nhist} rows for {processed['pg_tpcb_tps']} transactions), "
                                f"{nacc} accounts")
        except ValueError:
            problems.append(f"invariant query: {p.stderr.strip()[-200:]}")
        p = run(self.as_pg([f"{PG_BIN}/pg_amcheck"] + conn + ["--install-missing", "--heapallindexed",
                                                                "-d", "postgres"]), check=False)
        if p.returncode:
            problems.append(f"pg_amcheck exit {p.returncode}: {(p.stdout + p.stderr).strip()[-300:]}")
        self.pg_stop(data)
        m.pg_data = None
        p = run(self.as_pg([f"{PG_BIN}/pg_checksums", "--check", "-D", data]), check=False)
        if p.returncode:
            problems.append(f"pg_checksums exit {p.returncode}: {(p.stdout + p.stderr).strip()[-300:]}")
        if problems:
            self.fail(m, r, names, "; ".join(problems))
        shutil.rmtree(pgdir, ignore_errors=True)

    def sqlite(self, m, r):
        d = os.path.join(m.dir, "sqlite")
        os.mkdir(d)
        db = os.path.join(d, "mix.db")
        setup = ("PRAGMA journal_mode=WAL; CREATE TABLE accounts(id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);"
                 "CREATE TABLE log(id INTEGER PRIMARY KEY, a INT, b INT, amount INT, note TEXT);"
                 f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<{self.sq_accounts}) "
                 "INSERT INTO accounts SELECT x, 1000 FROM c;")
        run(["sqlite3", "-bail", db], input=setup)
        with open(self.sq_mix) as f:
            t, c, p = self.timed(m, ["sqlite3", "-bail", db], stdin=f, stdout=subprocess.DEVNULL)
        self.record(m, "sqlite_mix_tps", r, self.sq_txns / t, c, self.sq_txns)
        chk = run(["sqlite3", db], check=False,
                  input="PRAGMA integrity_check; SELECT sum(balance), sum(id*balance) FROM accounts; "
                        "SELECT count(*) FROM log;")
        want = f"ok\n{self.sq_expect[0]}|{self.sq_expect[1]}\n{self.sq_expect[2]}"
        if p.returncode or chk.returncode or chk.stdout.strip() != want:
            self.fail(m, r, ["sqlite_mix_tps"], f"sqlite3 exit {p.returncode}; check (exit {chk.returncode}) gave "
                                                f"{chk.stdout.strip()!r} {chk.stderr.strip()[:200]}, expected {want!r}")
        bulk = os.path.join(d, "bulk.db")
        n = self.sq_rows
        script = ("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; BEGIN;"
                  "CREATE TABLE t(id INTEGER PRIMARY KEY, k INTEGER NOT NULL, v TEXT NOT NULL);"
                  f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<{n}) "
                  "INSERT INTO t SELECT x, (x*7919) % 1000003, printf('%060d', x) FROM c;"
                  "COMMIT; CREATE INDEX t_k ON t(k, v); PRAGMA wal_checkpoint(TRUNCATE);")
        t, c, p = self.timed(m, ["sqlite3", "-bail", bulk], input=script)
        self.record(m, "sqlite_bulk_s", r, t, c, n)
        chk = run(["sqlite3", bulk], check=False,
                  input="PRAGMA integrity_check; SELECT count(*), sum(k) FROM t INDEXED BY t_k WHERE k >= 0;")
        want = f"ok\n{self.sq_bulk_expect[0]}|{self.sq_bulk_expect[1]}"
        if p.returncode or chk.returncode or chk.stdout.strip() != want:
            self.fail(m, r, ["sqlite_bulk_s"], f"sqlite3 exit {p.returncode} {p.stderr.strip()[:200]}; check (exit "
                                               f"{chk.returncode}) gave {chk.stdout.strip()!r} "
                                               f"{chk.stderr.strip()[:200]}, expected {want!r}")
        shutil.rmtree(d, ignore_errors=True)

    def git(self, m, r):
        repo = os.path.join(m.dir, "repo")
        g = ["git", "-c", "safe.directory=*", "-C", repo]
        names = ["git_clone_s", "git_status_warm_s", "git_status_cold_s", "git_checkout_s"]
        t, c, p = self.timed(m, ["git", "clone", "-q", "--no-hardlinks", self.git_src, repo])
        self.record(m, "git_clone_s", r, t, c, self.git_files)
        if p.returncode:
            return self.fail(m, r, names, f"git clone: {p.stderr.strip()[-300:]}")
        # Files written in the same second as the index are "racily clean": every status would
        # re-read them until an index is written later. Wait a second, then a status that refreshes
        # and rewrites the index (and warms the caches).
        time.sleep(1.1)
        run(g + ["status", "--porcelain"], check=False)
        run(g + ["status", "--porcelain"], check=False)
        for metric, cold in (("git_status_warm_s", False), ("git_status_cold_s", True)):
            if cold:
                drop_caches()
            t, c, p = self.timed(m, g + ["status", "--porcelain"])
            self.record(m, metric, r, t, c, self.git_files)
            if p.returncode or p.stdout.strip():
                self.fail(m, r, [metric], f"git status not clean: {(p.stdout + p.stderr).strip()[:300]}")
        c_tot, t_tot, bad = 0.0, 0.0, []
        for rev in ("A", "B"):
            t, c, p = self.timed(m, g + ["checkout", "-q", rev])
            t_tot += t
            c_tot = None if c is None or c_tot is None else c_tot + c
            if p.returncode:
                bad.append(f"checkout {rev}: {p.stderr.strip()[-200:]}")
        self.record(m, "git_checkout_s", r, t_tot, c_tot, 2 * self.git_changed)
        p = run(g + ["fsck", "--full", "--strict", "--no-progress"], check=False)
        if p.returncode:
            bad.append(f"git fsck: {(p.stdout + p.stderr).strip()[-300:]}")
        # every file of the work tree re-hashed: an index without stat data makes status read them all
        os.unlink(os.path.join(repo, ".git", "index"))
        run(g + ["read-tree", "HEAD"], check=False)
        p = run(g + ["status", "--porcelain", "--untracked-files=all"], check=False)
        if p.returncode or p.stdout.strip():
            bad.append(f"work tree differs from commit B: {(p.stdout + p.stderr).strip()[:300]}")
        if bad:
            self.fail(m, r, ["git_clone_s", "git_checkout_s"], "; ".join(bad))
        shutil.rmtree(repo, ignore_errors=True)

    def build(self, m, r):
        obj = os.path.join(m.dir, "kobj")
        src = os.path.join(self.src, TOP)
        env = dict(os.environ, LC_ALL="C", KBUILD_BUILD_TIMESTAMP="2024-01-01", KBUILD_BUILD_USER="bench",
                   KBUILD_BUILD_HOST="bench", ARCH="x86_64")
        env.pop("MAKEFLAGS", None)
        targets = self.args.build_targets.split()
        c0, t0 = m.cpu(), time.monotonic()
        p1 = run(["make", "-s", "-C", src, f"O={obj}", "defconfig"], check=False, env=env)
        p2 = run(["make", "-s", "-C", src, f"O={obj}", "-j2"] + targets, check=False, env=env) \
            if p1.returncode == 0 else p1
        t, c1 = time.monotonic() - t0, m.cpu()
        # Object files without their debug sections (objtool is built with -g, whose DWARF names
        # the output folder): everything else must come out byte for byte the same everywhere.
        digests = {}
        tmp = os.path.join(self.work, "stripped.o")
        for root, _, files in os.walk(obj):
            for f in files:
                if f.endswith(".o"):
                    path = os.path.join(root, f)
                    q = run(["objcopy", "--strip-debug", path, tmp], check=False)
                    with open(tmp if q.returncode == 0 else path, "rb") as fh:
                        digests[os.path.relpath(path, obj)] = hashlib.md5(fh.read()).hexdigest()
        if os.path.exists(tmp):
            os.unlink(tmp)
        self.record(m, "build_s", r, t, None if c0 is None else c1 - c0, len(digests))
        if p2.returncode or not digests:
            return self.fail(m, r, ["build_s"], f"make exit {p2.returncode}: {p2.stderr.strip()[-400:]}")
        ref = self.build_ref.get(r)
        if ref is None:
            self.build_ref[r] = (m.name, digests)
        else:
            diff = sorted(k for k in set(ref[1]) | set(digests) if ref[1].get(k) != digests.get(k))
            if diff:
                self.fail(m, r, ["build_s"], f"{len(diff)} object files differ from {ref[0]}'s build "
                                             f"(e.g. {', '.join(diff[:3])})")
        shutil.rmtree(obj, ignore_errors=True)

    # --- rounds ----------------------------------------------------------------------------
    def run_all(self):
        a = self.args
        self.build_ref = {}
        for r in range(1, a.rounds + 1):
            k = (r - 1) % len(a.systems)
            order = a.systems[k:] + a.systems[:k]
            log(f"# round {r}/{a.rounds}: {' '.join(order)}  ({time.strftime('%H:%M:%S')})")
            g = set(self.groups)
            # PostgreSQL runs as its own user, so its mount needs allow_other; that option costs
            # gocryptfs much (as root it then chowns every new file to its creator: tar -x ~2x
            # slower), so the other workloads get a mount without it.
            phases = [p for p in (("main", g - {"pgbench"}, False), ("pg", g & {"pgbench"}, True)) if p[1]]
            for name in order:
                for phase, groups, allow_other in phases:
                    if phase == "pg" and name == "passthrough":
                        log("# passthrough: pgbench skipped (libfuse 3.14's passthrough_hp mounts without "
                            "allow_other, so the postgres user cannot use it)")
                        continue
                    m = Mounted(name, os.path.join(self.work, f"{name}-r{r}-{phase}"), self, allow_other)
                    self.live.append(m)
                    try:
                        m.mount()
                        if groups & set(CANONICAL):
                            self.canonical(m, r)
                        for app in APPS:
                            if app in groups:
                                getattr(self, app)(m, r)
                    except Exception as e:  # one system's trouble must not end the run
                        loud(f"{name}, round {r}: {type(e).__name__}: {e}")
                    finally:
                        m.teardown()
                        self.live.remove(m)

    def write_csv(self, path):
        with open(path, "w") as f:
            f.write("system,metric,round,value,daemon_cpu_s,units\n")
            for (s, mt), per in self.results.items():
                for r, (v, c, u) in sorted(per.items()):
                    f.write(f"{s},{mt},{r},{'nan' if math.isnan(v) else repr(round(v, 6))},"
                            f"{'' if c is None else f'{c:.3f}'},{u:g}\n")

    def cleanup(self):
        for m in list(self.live):
            try:
                m.teardown()
            except Exception as e:  # keep going: the other mounts must come down too
                log(f"# teardown of {m.name}: {e}")
        self.live = []
        if self.work and os.path.isdir(self.work):
            busy = [l.split()[4] for l in open("/proc/self/mountinfo") if l.split()[4].startswith(self.work + "/")]
            if busy:
                log(f"# still mounted, {self.work} kept: {' '.join(busy)}")
            else:
                shutil.rmtree(self.work, ignore_errors=True)


def sh(cmd):
    return run(["bash", "-o", "pipefail", "-c", cmd])


# ----------------------------------------------------------------------------- report


def fmt_num(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if abs(v) >= 1000:
        return f"{v:.0f}"
    if abs(v) >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def cpu_unit(metric):
    return f"µs/{METRICS[metric][2]}"


def cpu_per_unit(cpu, units, metric):
    if cpu is None or not units:
        return "nan"
    return f"{cpu * 1e6 / units:.3g} {cpu_unit(metric)}"


def summary(vals):
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    if not vals:
        return None
    return statistics.median(vals), min(vals), max(vals)


def cell(s):
    return "-" if s is None else f"{fmt_num(s[0])} ({fmt_num(s[1])}-{fmt_num(s[2])})"


def table(title, header, rows, note=None):
    print()
    print(f"## {title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    fmt = lambda row: "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
    print(fmt(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))
    if note:
        print(note)


def report(h):
    a = h.args
    systems = a.systems
    metrics = [mt for mt in METRICS if any((s, mt) in h.results for s in systems)]
    rows = []
    for mt in metrics:
        unit = "higher better" if METRICS[mt][1] else "lower better"
        rows.append([mt] + [cell(summary(v[0] for v in h.results.get((s, mt), {}).values())) for s in systems] + [unit])
    table(f"median (min-max) over {a.rounds} round(s)", ["metric"] + systems + [""], rows)

    def per_round_ratio(mt, other, idx):
        """keybagfs against `other`, per round; above 1 = keybagfs better (faster, or less CPU)."""
        out = []
        kb, ot = h.results.get(("keybagfs", mt), {}), h.results.get((other, mt), {})
        for r in sorted(set(kb) & set(ot)):
            x, y = kb[r], ot[r]
            if idx == 0:
                a_, b_ = x[0], y[0]
                if METRICS[mt][1]:
                    a_, b_ = b_, a_  # rates: kb/other; times: other/kb
            else:  # CPU per unit of work: other/kb
                if x[1] is None or y[1] is None or not x[2] or not y[2]:
                    continue
                a_, b_ = x[1] / x[2], y[1] / y[2]
                if math.isnan(x[0]) or math.isnan(y[0]):
                    continue
            if a_ is None or b_ is None or math.isnan(a_) or math.isnan(b_) or a_ == 0:
                continue
            out.append(b_ / a_)
        return summary(out)

    others = [o for o in ("passthrough", "gocryptfs", "before") if o in systems]
    if "keybagfs" in systems and others:
        rows = [[mt] + [cell(per_round_ratio(mt, o, 0)) for o in others] for mt in metrics]
        table("keybagfs speed ratio, per round: median (min-max); above 1 = keybagfs faster",
              ["metric"] + [f"kb/{o}" for o in others], rows)

    fuse = [s for s in systems if s != "plain"]
    if fuse:
        rows = []
        for mt in metrics:
            row = [mt, cpu_unit(mt)]
            for s in fuse:
                vals = [v[1] * 1e6 / v[2] for v in h.results.get((s, mt), {}).values()
                        if v[1] is not None and v[2] and not math.isnan(v[0])]
                row.append(cell(summary(vals)))
            if "keybagfs" in systems:
                row += [cell(per_round_ratio(mt, o, 1)) for o in others]
            rows.append(row)
        hdr = ["metric", "unit"] + fuse + ([f"{o}/kb" for o in others] if "keybagfs" in systems else [])
        table("daemon CPU (user + system, /proc) per unit of work: median (min-max); "
              "ratios above 1 = keybagfs uses less", hdr, rows)


# ----------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    pt = os.environ.get("PASSTHROUGH_HP", "")
    p.add_argument("--systems", default=",".join(["plain"] + (["passthrough"] if pt else []) +
                                                 ["gocryptfs", "keybagfs"]),
                   help="comma list of plain,passthrough,gocryptfs,keybagfs (passthrough needs $PASSTHROUGH_HP)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tree", choices=["quick", "medium", "full"], default="medium",
                   help="canonical tree: quick = fs/ (~2.2k entries), medium = ten top folders (~15k), full (84k)")
    p.add_argument("--on", default="/dev/shm", help="where stores, mounts and inputs live (default /dev/shm)")
    p.add_argument("--workloads", default="canonical,apps",
                   help="canonical, apps, or metric groups: " + ",".join(CANONICAL + APPS))
    p.add_argument("--csv", help="write every measurement here (system,metric,round,value,daemon_cpu_s,units)")
    p.add_argument("--keybagfs", default=".build/release", help="folder with keybagfs and keybagctl")
    p.add_argument("--keybagfs-class", help="keybagfs --default-class (default: keybagfs' own default)")
    p.add_argument("--keybagfs-before", help="folder with an earlier build's keybagfs and keybagctl: the system "
                                             "`before`, side by side with `keybagfs` (a change's before/after; added to --systems)")
    p.add_argument("--quick-apps", action="store_true",
                   help="smoke run: pgbench 5 s, 2,000 SQLite transactions / 100k rows, git on the quick tree, "
                        "make scripts only")
    p.add_argument("--pg-seconds", type=int, help="length of each pgbench run (default 60, 5 with --quick-apps)")
    p.add_argument("--fio-seconds", type=int, default=8)
    p.add_argument("--build-targets", help="make targets of the build workload (default 'lib/ kernel/', "
                                           "'scripts' with --quick-apps)")
    a = p.parse_args(argv)
    a.passthrough_hp = pt
    a.systems = [s for s in a.systems.split(",") if s]
    for s in a.systems:
        if s not in ("plain", "passthrough", "gocryptfs", "keybagfs", "before"):
            p.error(f"unknown system {s}")
    if "before" in a.systems and not a.keybagfs_before:
        p.error("the system before needs --keybagfs-before DIR")
    if a.keybagfs_before:
        a.keybagfs_before = os.path.realpath(a.keybagfs_before)
        if "before" not in a.systems:  # given the earlier build, it is measured (beside keybagfs)
            a.systems.insert(a.systems.index("keybagfs") if "keybagfs" in a.systems else len(a.systems), "before")
    if "passthrough" in a.systems and not (pt and os.access(pt, os.X_OK)):
        p.error(f"passthrough needs PASSTHROUGH_HP=/path/to/passthrough_hp (got {pt!r})")
    groups = []
    for w in a.workloads.split(","):
        add = CANONICAL if w == "canonical" else APPS if w == "apps" else [w]
        for x in add:
            if x not in CANONICAL + APPS:
                p.error(f"unknown workload {x}")
            if x not in groups:
                groups.append(x)
    a.groups = groups
    if a.pg_seconds is None:
        a.pg_seconds = 5 if a.quick_apps else 60
    a.keybagfs = os.path.realpath(a.keybagfs)
    if "keybagfs" in a.systems:
        for b in ("keybagfs", "keybagctl"):
            if not os.access(os.path.join(a.keybagfs, b), os.X_OK):
                p.error(f"{a.keybagfs}/{b} missing: swift build -c release --product keybagfs && "
                        "swift build -c release --product keybagctl")
    return a


def versions(a):
    def first(argv):
        try:
            out = run(argv, check=False)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except (OSError, IndexError):
            return "?"
    v = [f"kernel {os.uname().release}"]
    if "gocryptfs" in a.systems:
        v.append(first(["gocryptfs", "-version"]).split(";")[0])
    if "keybagfs" in a.systems:
        v.append("keybagfs " + first(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe",
                                      "--always", "--dirty"]))
    if "passthrough" in a.systems:
        v.append(f"passthrough_hp {a.passthrough_hp}")
    if "pgbench" in a.groups:
        v.append(first([f"{PG_BIN}/postgres", "--version"]))
    if "sqlite" in a.groups:
        v.append("sqlite " + first(["sqlite3", "--version"]).split()[0])
    if "git" in a.groups:
        v.append(first(["git", "--version"]))
    if "build" in a.groups:
        v.append(first(["gcc", "--version"]))
    return "; ".join(v)


def main(argv):
    a = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("needs root (mounts, dropping caches, running PostgreSQL as postgres)")
    h = Harness(a)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_term)  # also when started with SIGINT ignored (a background job)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    t0 = time.monotonic()
    interrupted = False
    try:
        mem = int(open("/proc/meminfo").read().split()[1]) / 1048576
        fstype = run(["stat", "-f", "-c", "%T", a.on]).stdout.strip()
        print(f"# {os.cpu_count()} cores, {mem:.0f} GiB, on {a.on} ({fstype}); {a.rounds} round(s); "
              f"systems {','.join(a.systems)}; workloads {','.join(a.groups)}; tree {a.tree}"
              f"{'; quick apps' if a.quick_apps else ''}")
        print(f"# {versions(a)}", flush=True)
        h.prepare()
        log(f"# inputs ready after {time.monotonic() - t0:.0f} s")
        h.run_all()
    except KeyboardInterrupt:
        interrupted = True
        log("# interrupted: tearing down, then the tables of what was measured")
    finally:
        h.cleanup()
    report(h)
    if a.csv:
        h.write_csv(a.csv)
    print(f"\n# {time.monotonic() - t0:.0f} s in all{' (interrupted)' if interrupted else ''}"
          f"{'; CSV in ' + a.csv if a.csv else ''}")
    failed = sum(1 for v in h.results.values() for x in v.values() if math.isnan(x[0]))
    if failed:
        print(f"# {failed} measurement(s) are nan: a correctness check failed (see the lines marked !!)")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
