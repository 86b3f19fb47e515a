#!/usr/bin/env python3
"""Replays a dm-log-writes log into crash states and checks keybagfs in each (Tests/powercut/run.sh).

The log format is the kernel's (Documentation/admin-guide/device-mapper/log-writes.rst): a super
block in sector 0 (magic, version, entry count, sector size), then one entry per sector (the
target sector, the sector count, flags: FLUSH 1, FUA 2, DISCARD 4, MARK 8, METADATA 16, and the
data length), a write's data in the sectors after its entry, a mark's name inside its entry.

States (each a disk image the kernel could have left at a power cut):
  - prefix states: every entry up to a mark, or up to a flush or FUA write;
  - reordered states: every entry up to a flush, then a random subset of the writes of the window
    before the next flush (the disk may write them in any order);
  - torn states: the same window with one write cut at a 512-byte or a 4 KiB boundary.
For each: the ext4 mounts (its journal replays) and e2fsck -fn is clean; the store mounts (its
overwrite journal replays) and unlocks with the passcode in force; every fact of every mark the
state includes reads back (a path an operation in flight changes may read as before or after; a
file of blocks rewritten in place reads, block by block, as acknowledged or as a write since
made it); no read fails with EIO (a block torn by the cut: issue "Overwrites a power cut cannot
tear"; counted in the summary too); `keybagfs fsck --json` lists only kinds docs/FORMAT.md allows
after a crash, and `fsck --repair` then leaves it clean.
"""
import argparse
import re
import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time

FLUSH, FUA, DISCARD, MARK = 1, 2, 4, 8
MAGIC = 0x6A736677736872
# What docs/FORMAT.md ("What a crash may leave") allows fsck to find after a power cut.
ALLOWED = {"torn-tail", "torn-fragment", "end-not-sealed", "header-superseded-slot", "side-file-orphan", "xattr-set-damaged",
           "temporary", "xattr-orphan", "target-orphan", "no-header"}


class Log:
    """The entries of a dm-log-writes log device."""

    def __init__(self, path):
        self.f = open(path, "rb")
        magic, version, n, self.ss = struct.unpack("<QQQI", self.f.read(28))
        if magic != MAGIC:
            raise SystemExit(f"FAIL: {path} is not a dm-log-writes log (magic {magic:#x})")
        self.entries = []  # (sector, nr_sectors, flags, data offset in the log, mark name)
        pos = 1
        for _ in range(n):
            self.f.seek(pos * self.ss)
            head = self.f.read(self.ss)
            sector, nr, flags, dlen = struct.unpack("<QQQQ", head[:32])
            if flags & MARK:
                self.entries.append((sector, 0, flags, 0, head[32:32 + dlen].decode(errors="replace")))
                pos += 1
            elif flags & DISCARD:
                self.entries.append((sector, nr, flags, 0, None))
                pos += 1
            else:
                self.entries.append((sector, nr, flags, (pos + 1) * self.ss, None))
                pos += 1 + nr

    def data(self, i):
        sector, nr, flags, off, _ = self.entries[i]
        self.f.seek(off)
        return self.f.read(nr * self.ss)


class Image:
    """The data disk as the log rebuilds it, entry by entry."""

    def __init__(self, log, path, size):
        self.log, self.path, self.at = log, path, 0
        with open(path, "wb") as f:
            f.truncate(size)
        self.f = open(path, "r+b")

    def apply(self, i, cut=None):
        sector, nr, flags, off, mark = self.log.entries[i]
        if mark is not None or nr == 0:
            return
        self.f.seek(sector * self.log.ss)
        if flags & DISCARD:
            self.f.write(bytes(nr * self.log.ss))
        else:
            data = self.log.data(i)
            self.f.write(data if cut is None else data[:cut])

    def advance(self, upto):
        """Applies every entry before index `upto`."""
        while self.at < upto:
            self.apply(self.at)
            self.at += 1
        self.f.flush()

    def copy(self, dest):
        self.f.flush()
        shutil.copyfile(self.path, dest)


def sha(b):
    return hashlib.sha256(b).hexdigest()


def sh(argv, stdin=None, check=False, timeout=120):
    r = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.returncode} {r.stderr.strip()[:300]}")
    return r


def daemons_of(path):
    """Pids of keybagfs daemons whose command line names the mount point `path`."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"keybagfs") and b"mount" in args and path.encode() in args:
            pids.append(int(d))
    return pids


def unmount(path):
    """Unmounts a keybagfs mount the check made, waiting for programs that still hold it, then
    for its daemon to exit: the unmount returns before the daemon has let go of the store (its
    journal's checkpoint, its store lock), and an fsck started then finds the store in use."""
    pids = daemons_of(path)
    for _ in range(100):
        if sh(["fusermount3", "-u", path]).returncode == 0 or not os.path.ismount(path):
            break
        time.sleep(0.1)
    else:
        sh(["fusermount3", "-uz", path])
    for _ in range(300):
        if not any(alive(p) for p in pids):
            return
        time.sleep(0.1)


def alive(pid):
    """Whether process `pid` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Checker:
    """Checks one state image: ext4, then keybagfs on the store in it."""

    def __init__(self, args, journal):
        self.a, self.journal = args, journal
        self.torn_reads = 0
        self.results = []

    def expected(self, included):
        """Facts of the included marks, and the facts an operation in flight may already have made."""
        facts, pending = {}, {}
        last = {}
        for rec in self.journal:
            if rec["mark"] in included:
                facts.update(rec["facts"])
                last = rec["facts"]
        self.last_paths = set(last)
        nxt = [r for r in self.journal if r["mark"] not in included]
        if nxt:
            pending = dict(nxt[0]["facts"])
            pending["__op"] = nxt[0]["op"]
            pending["__rewrites"] = nxt[0].get("rewrites", [])
        return facts, pending

    def check_state(self, name, image, included, later=()):
        """All problems of one state (empty: it passed); `later`: the marks not included whose
        operations the state's writes may have reached (a window spans marks)."""
        problems = []
        facts, pending = self.expected(included)
        self.later = [r for r in self.journal if r["mark"] in set(later)]
        mnt = tempfile.mkdtemp(prefix="kbpc-disk.")
        kbm = tempfile.mkdtemp(prefix="kbpc-mnt.")
        state = tempfile.mkdtemp(prefix="kbpc-state.")
        loop = sh(["losetup", "-f", "--show", image], check=True).stdout.strip()
        try:
            r = sh(["mount", "-t", "ext4", loop, mnt])
            if r.returncode != 0:
                return [f"the ext4 does not mount: {r.stderr.strip()}"]
            sh(["umount", mnt], check=True)
            r = sh(["e2fsck", "-fn", loop])
            if r.returncode != 0:
                problems.append(f"e2fsck -fn: exit {r.returncode}: {r.stdout.strip()[-300:]}")
            sh(["mount", "-t", "ext4", loop, mnt], check=True)
            try:
                problems += self.check_store(mnt + "/store", kbm, state, facts, pending)
            except Exception as e:  # the check itself broke: the state fails, the run goes on
                problems.append(f"the check broke: {type(e).__name__}: {e}")
            finally:
                unmount(kbm)
                for _ in range(50):
                    if sh(["umount", mnt]).returncode == 0:
                        break
                    time.sleep(0.1)
        finally:
            sh(["losetup", "-d", loop])
            for d in (mnt, kbm):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            shutil.rmtree(state, ignore_errors=True)
        return problems

    def unlock(self, store, kbm, state, facts, pending):
        env = dict(os.environ, STATE_DIRECTORY=state)
        sock = state + "/sock"
        r = subprocess.run([self.a.kbin + "/keybagfs", "mount", store, kbm, "--device-key", self.a.device_key,
                            "--socket", sock, "--grace", "0", "-o", "allow_other"], capture_output=True, text=True,
                           env=env)
        if r.returncode != 0:
            return f"the store does not mount: {r.stderr.strip()[:300]}"
        codes = [facts.get("passcode")] + ([pending["passcode"]] if "passcode" in pending else [])
        for code in [c for c in codes if c]:
            r = sh([self.a.kbin + "/keybagctl", "--socket", sock, "unlock", "--passcode-stdin"], stdin=code + "\n")
            if r.returncode == 0:
                return None
        return f"no passcode in force unlocks it ({codes}): {r.stderr.strip()[:200]}"

    def check_store(self, store, kbm, state, facts, pending):
        if not os.path.isdir(store):
            return ["the store is gone"] if facts.get("passcode") else []
        err = self.unlock(store, kbm, state, facts, pending)
        if err:
            return [err]
        problems = []
        for path, want in sorted(facts.items()):
            if path in ("passcode", "recovery") or path.startswith("device:"):
                continue
            # A database server's recovery costs seconds: checked where its last operation or the
            # one in flight touched it (nothing after them writes into it).
            if want.get("type") == "postgres" and path not in pending and path not in self.last_paths:
                continue
            alt = pending.get(path)
            got, torn = self.read(kbm, path, want)
            if want.get("type") == "blocks":
                if self.blocks_match(got, want, alt, path):
                    continue
                if got.get("errno") == 5:
                    self.torn_reads += 1
                problems.append(f"{path}: a block is neither as acknowledged nor as a write since made it: {json.dumps(got)[:200]}")
                continue
            if got == want or (alt is not None and self.read(kbm, path, alt)[0] == alt):
                continue
            if torn:  # a block torn by the cut: never allowed (issue "Overwrites a power cut cannot tear")
                self.torn_reads += 1
            problems.append(f"{path}: expected {json.dumps(want)[:160]}, got {json.dumps(got)[:200]}")
        unmount(kbm)
        problems += self.fsck(store, facts, pending)
        for key, want in sorted(facts.items()):
            if key.startswith("device:"):
                problems += self.check_device(store, kbm, key[7:], want, pending.get(key))
        if facts.get("recovery") not in (None, "rk") or "recovery" in pending:  # from the rotation on
            problems += self.check_recovery(store, facts["recovery"], pending.get("recovery"))
        return problems

    def check_device(self, store, kbm, key, want, alt):
        """A second device's keybag opens with its passcode (added), or the device is refused (removed)."""
        state = tempfile.mkdtemp(prefix="kbpc-dev.")
        try:
            r = subprocess.run([self.a.kbin + "/keybagfs", "mount", store, kbm, "--device-key",
                                os.path.dirname(self.a.device_key) + "/" + key, "--socket", state + "/sock"],
                               capture_output=True, text=True, env=dict(os.environ, STATE_DIRECTORY=state))
            opened = r.returncode == 0 and sh([self.a.kbin + "/keybagctl", "--socket", state + "/sock", "unlock",
                                               "--passcode-stdin"], stdin=want["passcode"] + "\n").returncode == 0
            unmount(kbm)
        finally:
            shutil.rmtree(state, ignore_errors=True)
        if opened == want["present"] or (alt is not None and opened == alt["present"]):
            return []
        return [f"device {key}: {'opens' if opened else 'does not open'} ({r.stderr.strip()[:160]})"]

    def check_recovery(self, store, want, alt):
        """The recovery key in force opens the escrow: `device add` of a throwaway key with it
        (in a copy of the keybags only: the store stays as the state left it)."""
        probe = tempfile.mkdtemp(prefix="kbpc-rk.")
        try:
            shutil.copytree(store, probe + "/store", ignore=shutil.ignore_patterns("data", "xattrs", "targets"))
            os.mkdir(probe + "/store/data")
            for rk in [want] + ([alt] if alt else []):
                r = subprocess.run([self.a.kbin + "/keybagfs", "device", "add", probe + "/store", "--device-key",
                                    probe + "/probe.key", "--recovery-key-file",
                                    os.path.dirname(self.a.device_key) + "/" + rk, "--stdin", "--kdf",
                                    "interactive", "--tpm2", "off"], input="probe\n", capture_output=True,
                                   text=True, env=dict(os.environ, STATE_DIRECTORY=probe))
                if r.returncode == 0:
                    return []
            return [f"no recovery key in force opens the escrow: {r.stderr.strip()[:200]}"]
        finally:
            shutil.rmtree(probe, ignore_errors=True)

    def read(self, kbm, path, want):
        """What the mount shows at `path`, in the shape of the fact `want`; and whether it was EIO."""
        p = kbm + "/" + path
        kind = want.get("type")
        try:
            if kind == "absent":
                return ({"type": "absent"} if not os.path.lexists(p) else {"type": "present"}), False
            if kind == "symlink":
                return {"type": "symlink", "target": os.readlink(p)}, False
            if kind == "dir":
                return ({"type": "dir"} if os.path.isdir(p) else {"type": "missing"}), False
            if kind == "sqlite":
                return self.read_db(p, want), False
            if kind == "blocks":
                return self.read_blocks(p, want), False
            if kind == "postgres":
                return self.read_pg(p + "/data"), False
            with open(p, "rb") as f:
                data = f.read()
            cls = os.getxattr(p, "user.protection").decode()
            xattrs = {n: os.getxattr(p, n).decode(errors="replace") for n in os.listxattr(p)
                      if n != "user.protection"}
            return {"type": "file", "sha": sha(data), "size": len(data), "class": cls, "xattrs": xattrs}, False
        except OSError as e:
            return {"type": "error", "errno": e.errno, "what": str(e)[:120]}, e.errno == 5

    def read_blocks(self, p, want):
        """A file of blocks rewritten in place: each block as acknowledged, or as a write since
        showed it (`want` is the fact of the mark included last or of the write in flight: the
        check passes with either when each block is one of its versions)."""
        out = []
        with open(p, "rb") as f:
            for b in range(want["blocks"]):
                f.seek(b * 4096)
                try:
                    h = sha(f.read(4096))
                except OSError as e:
                    return {"type": "blocks", "block": b, "errno": e.errno}
                out.append(h)
        self.block_shas = out
        return {"type": "blocks", "shas": out}

    def blocks_match(self, got, want, alt, path):
        """Whether every block read is its acknowledged version or one a write since made (by
        the operation in flight or one whose writes the state reaches)."""
        if "shas" not in got:
            return False
        later = [r["facts"][path] for r in self.later if path in r["facts"]] + ([alt] if alt else [])
        for b, h in enumerate(got["shas"]):
            ok = {want["acked"][b]} | set(want["since"][b])
            for f in later:
                ok |= set(f["since"][b]) | {f["acked"][b]}
            if h not in ok:
                return False
        return True

    def read_db(self, p, want):
        """The committed rows of a database, or what is wrong with it."""
        if not os.path.exists(p):
            return {"type": "missing"}
        try:
            db = sqlite3.connect(p)
        except sqlite3.DatabaseError as e:
            if "disk I/O error" in str(e):
                raise OSError(5, str(e))
            return {"type": "sqlite", "error": str(e)}
        try:
            ok = db.execute("PRAGMA integrity_check").fetchone()[0]
            ids = [r[0] for r in db.execute("SELECT id FROM t ORDER BY id")]
        except sqlite3.DatabaseError as e:
            if "disk I/O error" in str(e):
                raise OSError(5, str(e))
            return {"type": "sqlite", "error": str(e)}
        finally:
            db.close()
        if ok != "ok" or ids != list(range(1, len(ids) + 1)):
            if "disk I/O error" in str(ok):
                raise OSError(5, ok)
            return {"type": "sqlite", "integrity": ok, "ids": ids[:20]}
        return {"type": "sqlite", "rows": len(ids)}

    def read_pg(self, data):
        """The committed rows of the PostgreSQL cluster in `data`, after its crash recovery, with
        pg_amcheck clean; or what is wrong with it."""
        if not os.path.isdir(data):
            return {"type": "missing"}
        sock = tempfile.mkdtemp(prefix="kbpc-pg.")
        shutil.chown(sock, "postgres", "postgres")
        log = sock + "/log"
        pg = ["runuser", "-u", "postgres", "--"]
        bin_ = "/usr/lib/postgresql/15/bin"
        try:
            r = sh(pg + [bin_ + "/pg_ctl", "-D", data, "-l", log, "-w", "-t", "120", "-o",
                         f"-c listen_addresses='' -k {sock}", "start"], timeout=180)
            if r.returncode != 0:
                text = open(log).read() if os.path.exists(log) else r.stderr
                # A file it reads back failed: EIO, or a short read (keybagfs answers a torn block
                # inside a file with the blocks before it, which the kernel takes as the end: a
                # defect the next issue's old-or-new blocks remove). Counted as a torn read only
                # where an operation in flight was rewriting the cluster's files in place.
                if "Input/output error" in text or "read too few bytes" in text:
                    raise OSError(5, "postgres: " + [l for l in text.splitlines() if "DETAIL" in l or "FATAL" in l][-1][:200])
                if os.environ.get("VERBOSE"):
                    print(text)
                return {"type": "postgres", "start": text.strip()[-300:]}
            q = sh(pg + ["/usr/bin/psql", "-h", sock, "-U", "postgres", "-Atc", "SELECT id FROM t ORDER BY id"])
            if q.returncode != 0:
                if "Input/output error" in q.stderr:
                    raise OSError(5, q.stderr.strip()[:200])
                return {"type": "postgres", "query": q.stderr.strip()[:200]}
            ids = [int(x) for x in q.stdout.split()]
            if ids != list(range(1, len(ids) + 1)):
                return {"type": "postgres", "ids": ids[:20]}
            c = sh(pg + [bin_ + "/pg_amcheck", "-h", sock, "-U", "postgres", "--install-missing", "postgres"])
            if c.returncode != 0:
                return {"type": "postgres", "amcheck": (c.stdout + c.stderr).strip()[:300]}
            return {"type": "postgres", "rows": len(ids)}
        finally:
            sh(pg + [bin_ + "/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"])
            shutil.rmtree(sock, ignore_errors=True)

    @staticmethod
    def cut_rotation_record(p, pending):
        """A `recovery-key rotate` cut between its key-set record and its keybag's save, on a
        device alone without the current recovery key: the record carries no signature of the
        certification key in force, so this device refuses it (fsck names it, left alone) and
        the rotation did not happen (the old recovery key still opens the escrow, checked);
        running the rotation again writes the record anew. Seen once in CI's short pass
        (flush at entry 11745); issue note of 2026-11-29."""
        return ("recovery" in pending and p["kind"] == "device-record-refused"
                and re.fullmatch(r"devices/keyset-\d+\.[0-9a-f]+\.json", p["path"]) is not None)

    def fsck(self, store, facts, pending):
        env = dict(os.environ)
        codes = [c for c in (facts.get("passcode"), pending.get("passcode")) if c]
        out = None
        for code in codes:
            r = subprocess.run([self.a.kbin + "/keybagfs", "fsck", store, "--device-key", self.a.device_key,
                                "--passcode-stdin", "--json"], input=code + "\n", capture_output=True, text=True,
                               env=env)
            if r.stdout.strip().startswith("{"):
                out = json.loads(r.stdout)
                break
        if out is None:
            return [f"fsck gave no report: {r.stderr.strip()[:200]}"]
        problems = []
        for p in out["problems"]:
            if p["kind"] in ALLOWED or self.cut_rotation_record(p, pending):
                continue
            problems.append(f"fsck: {p['kind']}: {p['path']} ({p.get('name', '?')}): {p['detail'][:120]}")
        if out["problems"] and not problems:
            r = subprocess.run([self.a.kbin + "/keybagfs", "fsck", store, "--device-key", self.a.device_key,
                                "--passcode-stdin", "--repair"], input=codes[0] + "\n", capture_output=True,
                               text=True)
            r = subprocess.run([self.a.kbin + "/keybagfs", "fsck", store, "--device-key", self.a.device_key,
                                "--passcode-stdin", "--json"], input=codes[0] + "\n", capture_output=True, text=True)
            left = json.loads(r.stdout)["problems"] if r.stdout.strip().startswith("{") else ["no report"]
            # What --repair leaves by design: a torn tail of a write never synced (cut only by --yes).
            left = [p for p in left if not isinstance(p, dict) or (p["kind"] not in ("torn-tail", "end-not-sealed")
                                                                   and not self.cut_rotation_record(p, pending))]
            if left:
                problems.append(f"fsck --repair left: {json.dumps(left)[:300]}")
        return problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pass", dest="which", default="short")
    ap.add_argument("--log", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--kbin", required=True)
    ap.add_argument("--device-key", required=True)
    ap.add_argument("--final")
    ap.add_argument("--seed", type=int, default=455)
    ap.add_argument("--only", help="check only states whose name contains this")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    log = Log(a.log)
    journal = [json.loads(l) for l in open(a.journal)]
    marks = {e[4]: i for i, e in enumerate(log.entries) if e[4] is not None}
    missing = [r["mark"] for r in journal if str(r["mark"]) not in marks]
    if missing:
        raise SystemExit(f"FAIL: marks {missing[:5]} are in the journal but not in the log")
    first = marks[str(journal[0]["mark"])]
    flushes = [i for i, e in enumerate(log.entries) if i > first and e[4] is None and e[2] & (FLUSH | FUA)]
    mark_at = sorted((marks[str(r["mark"])], r["mark"]) for r in journal)

    def included(pos):
        """Marks whose entry lies before `pos` (entries applied: 0..pos-1)."""
        return {m for i, m in mark_at if i < pos}

    # Prefix states: after every mark; after every flush/FUA (short: every third).
    states = [(f"mark {m}", i + 1, None) for i, m in mark_at]
    # Short pass: at most 60 flush points, spread evenly over the log (the long pass: all).
    picked = flushes if a.which == "long" else flushes[::max(1, -(-len(flushes) // 60))]
    states += [(f"flush at entry {i}", i + 1, None) for i in picked]
    # Reordered and torn states in the window before a flush.
    windows = []
    prev = first
    for f in flushes:
        w = [i for i in range(prev + 1, f + 1) if log.entries[i][1] > 0 and not log.entries[i][2] & DISCARD]
        if len(w) >= 2:
            windows.append((prev + 1, w))
        prev = f
    pick = windows if a.which == "long" else rng.sample(windows, min(12, len(windows)))
    for start, w in pick:
        for k in range(2 if a.which == "long" else 1):
            subset = sorted(rng.sample(w, rng.randrange(1, len(w))))
            states.append((f"reordered window at {start} ({len(subset)} of {len(w)} writes)", start, ("subset", subset)))
        big = [i for i in w if log.entries[i][1] * log.ss > 4096] or w
        victim = rng.choice(big)
        cut = 4096 if log.entries[victim][1] * log.ss > 4096 else 512
        states.append((f"torn write at entry {victim} (first {cut} bytes)", start, ("torn", w, victim, cut)))
    # Every window of the in-place rewrites (the marks of the "rewrite:" operations), in both
    # passes, with a generator of its own (the sample above stays as it was): two reorderings
    # and three torn writes, cut at 4 KiB or 512 bytes, each.
    rw = [marks[str(r["mark"])] for r in journal if r["op"].startswith("rewrite:")]
    rw_rng = random.Random(a.seed + 1)
    for start, w in [x for x in windows if rw and rw[0] <= x[0] <= rw[-1] + 1 and x not in pick]:
        for k in range(2):
            subset = sorted(rw_rng.sample(w, rw_rng.randrange(1, len(w))))
            states.append((f"reordered window at {start} ({len(subset)} of {len(w)} writes)", start, ("subset", subset)))
        big = [i for i in w if log.entries[i][1] * log.ss > 4096] or w
        for victim in rw_rng.sample(big, min(len(big), 3)):
            cut = rw_rng.choice([4096, 512]) if log.entries[victim][1] * log.ss > 4096 else 512
            states.append((f"torn write at entry {victim} (first {cut} bytes)", start, ("torn", w, victim, cut)))
    if a.only:
        states = [s for s in states if a.only in s[0]]
    states.sort(key=lambda s: s[1])

    img = Image(log, a.work + "/replay.img", a.size)
    # The whole log replayed gives the disk the guest left (checks the replay itself).
    if a.final:
        full = Image(log, a.work + "/full.img", a.size)
        full.advance(len(log.entries))
        if sha(open(full.path, "rb").read()) != sha(open(a.final, "rb").read()):
            raise SystemExit("FAIL: the replayed log does not give the disk the guest left")
        os.unlink(full.path)
    check = Checker(a, journal)
    failed, start_t = 0, time.time()
    state_img = a.work + "/state.img"
    for name, pos, extra in states:
        img.advance(pos)
        img.copy(state_img)
        need = included(pos)
        if extra:
            s = Image.__new__(Image)
            s.log, s.path, s.f = log, state_img, open(state_img, "r+b")
            if extra[0] == "subset":
                for i in extra[1]:
                    s.apply(i)
            else:
                for i in extra[1]:
                    s.apply(i, cut=extra[3] if i == extra[2] else None)
            s.f.close()
        # The operations whose writes the state may hold: marks inside the applied entries, and
        # the first after them (its writes come before its mark).
        last = max(extra[1]) if extra else pos - 1
        later = [m for i, m in mark_at if pos <= i <= last] + [m for i, m in mark_at if i > last][:1]
        problems = check.check_state(name, state_img, need, later=later)
        status = "ok" if not problems else "FAIL"
        if problems:
            failed += 1
            print(f"FAIL {name} (marks up to {max(need) if need else 0}):")
            for p in problems[:8]:
                print(f"    {p}")
        elif os.environ.get("VERBOSE"):
            print(f"ok   {name}")
    total = len(states)
    print(f"# power cut: {total} crash states checked ({len([s for s in states if s[2] is None])} prefix, "
          f"{len([s for s in states if s[2] and s[2][0] == 'subset'])} reordered, "
          f"{len([s for s in states if s[2] and s[2][0] == 'torn'])} torn), {failed} failed, "
          f"{check.torn_reads} reads failed with EIO (each also a failed state), "
          f"{len(journal)} durable marks, {time.time() - start_t:.0f} s")
    sys.exit(1 if failed else 0)


# A SIGTERM or SIGHUP (a CI timeout, a closed terminal) unwinds like an exception, so every
# `finally` above unmounts what it mounted instead of leaving loop devices behind.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
main()
