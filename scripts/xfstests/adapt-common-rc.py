#!/usr/bin/env python3
"""Adapts an xfstests checkout's common/rc for keybagfs (FSTYP=fuse, FUSE_SUBTYP=.keybagfs).

    adapt-common-rc.py [--check] XFSTESTS_DIR_OR_COMMON_RC

Three edits, each found by an anchor in the function it changes:

1. _scratch_mkfs(): a `fuse)` branch right after its `case $FSTYP in` line runs
   `$FUSE_MKFS_PROG $SCRATCH_DEV` when FUSE_MKFS_PROG is set. xfstests itself cannot
   re-create a fuse file system and only deletes the files on the scratch mount.
2. _try_scratch_mkfs_sized(): a `fuse)` branch before its final `*)` branch (the one that
   says "not supported in _scratch_mkfs_sized") runs
   `$FUSE_MKFS_PROG -s BYTES -b BLOCKSIZE $SCRATCH_DEV`. Without it every test that needs a
   small or full file system is "not run".
3. _fs_type(): its sed, after the line that maps fuse.ceph-fuse, also maps
   `fuse$FUSE_SUBTYP` (df says fuse.keybagfs) to `fuse`. Without it the start-up check that
   TEST_DEV is mounted with type $FSTYP fails ("not a type fuse filesystem"). This edit
   appends " \\" to the anchor line so that the sed command goes on to our line.

Every inserted block carries the marker comment "keybagfs-xfstests". An edit whose function
already has the marker is skipped, so the script can run any number of times. When an
anchor is missing (another xfstests version), nothing is written and the exit status is 1.
--check writes nothing and exits 0 when all three edits are present, 1 otherwise.
"""
import os
import re
import sys
import tempfile

MARK = "keybagfs-xfstests"
# The comment that the earlier, out-of-tree harness put in common/rc with a git patch.
OLD_MARK = "keybagfs harness"


class AnchorMissing(Exception):
    pass


def function_body(lines, name):
    """(first, end) line indexes of shell function `name`: from its `name()` line up to, not
    including, the first line that is a lone `}` after it."""
    head = re.compile(r"^" + re.escape(name) + r"\(\)\s*(\{\s*)?$")
    starts = [i for i, l in enumerate(lines) if head.match(l)]
    if len(starts) != 1:
        raise AnchorMissing(f"function {name}() found {len(starts)} times (expected once)")
    start = starts[0]
    for end in range(start + 1, len(lines)):
        if re.match(r"^\}\s*$", lines[end]):
            return start, end
    raise AnchorMissing(f"end of function {name}() not found")


def has_mark(lines, rng):
    return any(MARK in lines[i] for i in range(*rng))


def indent_of(line):
    return line[: len(line) - len(line.lstrip())]


def edit_scratch_mkfs(lines):
    rng = function_body(lines, "_scratch_mkfs")
    if has_mark(lines, rng):
        return False
    for i in range(*rng):
        if re.match(r"^\s*case \$FSTYP in\s*$", lines[i]):
            ind = indent_of(lines[i])
            block = [
                "fuse)",
                f"\t# {MARK}: FUSE_MKFS_PROG makes the store anew (a fresh",
                "\t# backing image and store); without it, only the files on",
                "\t# the scratch mount are removed, as for any fuse fs.",
                '\tif [ -n "$FUSE_MKFS_PROG" ]; then',
                "\t\t$FUSE_MKFS_PROG $SCRATCH_DEV",
                "\t\treturn $?",
                "\tfi",
                "\t_scratch_cleanup_files",
                "\treturn $?",
                "\t;;",
            ]
            lines[i + 1:i + 1] = [ind + b + "\n" for b in block]
            return True
    raise AnchorMissing("_scratch_mkfs(): no `case $FSTYP in` line")


def edit_scratch_mkfs_sized(lines):
    rng = function_body(lines, "_try_scratch_mkfs_sized")
    if has_mark(lines, rng):
        return False
    for i in range(rng[1] - 1, rng[0], -1):
        if (re.match(r"^\s*\*\)\s*$", lines[i]) and i + 1 < rng[1]
                and "_notrun" in lines[i + 1]
                and "not supported in _scratch_mkfs_sized" in lines[i + 1]):
            ind = indent_of(lines[i])
            block = [
                "fuse)",
                f"\t# {MARK}: a store on a backing image of the given size",
                '\t[ -n "$FUSE_MKFS_PROG" ] || \\',
                '\t\t_notrun "Filesystem $FSTYP not supported in _scratch_mkfs_sized"',
                "\t$FUSE_MKFS_PROG -s $fssize -b $blocksize $SCRATCH_DEV",
                "\t;;",
            ]
            lines[i:i] = [ind + b + "\n" for b in block]
            return True
    raise AnchorMissing("_try_scratch_mkfs_sized(): no final `*)` branch with "
                        "_notrun \"... not supported in _scratch_mkfs_sized\"")


def edit_fs_type(lines):
    rng = function_body(lines, "_fs_type")
    if has_mark(lines, rng):
        return False
    for i in range(*rng):
        m = re.match(r"^(\s*)(.*-e 's/fuse\.ceph-fuse/ceph-fuse/')\s*$", lines[i])
        if m:
            lines[i] = m.group(1) + m.group(2) + " \\\n"
            lines.insert(i + 1, m.group(1) + '-e "s/^fuse${FUSE_SUBTYP}\\$/fuse/"'
                         + f"\t# {MARK}\n")
            return True
    raise AnchorMissing("_fs_type(): no last sed line `-e 's/fuse.ceph-fuse/ceph-fuse/'` "
                        "(the one without a continuation)")


EDITS = [
    ("_scratch_mkfs: fuse runs FUSE_MKFS_PROG", edit_scratch_mkfs),
    ("_try_scratch_mkfs_sized: fuse runs FUSE_MKFS_PROG -s -b", edit_scratch_mkfs_sized),
    ("_fs_type: fuse$FUSE_SUBTYP reads as fuse", edit_fs_type),
]


def main(argv):
    args = argv[1:]
    check = False
    if args and args[0] == "--check":
        check, args = True, args[1:]
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: adapt-common-rc.py [--check] XFSTESTS_DIR_OR_COMMON_RC", file=sys.stderr)
        return 2
    path = args[0]
    if os.path.isdir(path):
        path = os.path.join(path, "common", "rc")
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            text = f.read()
    except OSError as e:
        print(f"adapt-common-rc.py: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 1
    if OLD_MARK in text:
        print(f"adapt-common-rc.py: {path} carries the edits of the older harness patch "
              f"(comment \"{OLD_MARK}\"); restore it first (git checkout -- common/rc)",
              file=sys.stderr)
        return 1
    lines = text.splitlines(keepends=True)
    applied, present = [], []
    try:
        for what, edit in EDITS:
            (applied if edit(lines) else present).append(what)
    except AnchorMissing as e:
        print(f"adapt-common-rc.py: {path}: anchor missing: {e}; nothing changed. "
              "This xfstests version differs from the one the script knows "
              "(kdave/xfstests 63a29724): adapt the anchors.", file=sys.stderr)
        return 1
    if check:
        if applied:
            print(f"adapt-common-rc.py: {path} lacks: " + "; ".join(applied), file=sys.stderr)
            return 1
        return 0
    if not applied:
        print(f"adapt-common-rc.py: {path} is already adapted")
        return 0
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".rc.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape", newline="") as f:
            f.write("".join(lines))
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    for what in applied:
        print(f"adapt-common-rc.py: {path}: {what}")
    for what in present:
        print(f"adapt-common-rc.py: {path}: {what} (was already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
