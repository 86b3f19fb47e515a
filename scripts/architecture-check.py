#!/usr/bin/env python3
"""Holds docs/ARCHITECTURE.md to the code (issue "The house II") and the tree to its layering
rules (issue "The house III", see `layering` below), run by scripts/test.sh.

Every name the document quotes in backticks must exist:
- a file name ending in .swift, .c or .h: a file of that name under Sources/, Tests/ or Examples/;
- a path with a slash (`KeybagCore/Lock`, `Examples/SecureNotes`): a folder or file under
  Sources/, Tests/ or the repository;
- a type (`FileKeyLife`): a class, struct, enum, protocol, actor or typealias declared in
  Sources/ or Tests/, a target of Package.swift, a file of that name (`Namespace` for
  Namespace.swift), or a type of the Swift libraries the code uses (LIBRARY_TYPES);
- a member (`FileKeyLife.evict`): the type as above, and a func, var, let, case or init of
  that name declared in Sources/.
Flags, paths in a store (`STORE/data`, `devices/`), file names of the store (`.kbfs-dir`),
errno names and other lower-case words are not checked. Exit 0 when every name is found, 1 with one line per missing name otherwise.
"""

import os
import re
import sys

DOC = "docs/ARCHITECTURE.md"
# Longest line (a table cell) the document may have: it is read in one sitting.
MAX_DOC_LINE = 400
TREES = ["Sources", "Tests", "Examples", "Fuzz"]
LIBRARY_TYPES = {"Mutex", "Atomic", "Foundation", "Dispatch", "Synchronization", "XCTest"}


def swift_files():
    """(path, text) of every Swift and C file under the trees."""
    for tree in TREES:
        for root, _, names in os.walk(tree):
            for name in names:
                if name.endswith((".swift", ".c", ".h")):
                    path = os.path.join(root, name)
                    yield path, open(path, encoding="utf-8").read()


# Calls that trap in this toolchain's Foundation on input a user can type: the call, and the
# replacement to use (a file may name the call in a comment).
# (NSString's property; URL's method of the same name is sound.)
TRAPPING_CALLS = {r"deletingLastPathComponent(?!\s*\()": "PathText.parent"}


def trapping_calls(files):
    """One line per use of a call in TRAPPING_CALLS in Sources and Fuzz (comments excluded)."""
    out = []
    for path, text in files:
        if not path.startswith(("Sources/", "Fuzz/")):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("//")[0]
            for call, instead in TRAPPING_CALLS.items():
                if re.search(r"\b" + call + r"\b", code):
                    out.append(f"{path}:{n}: {call.split('(')[0]} traps on `s`, `.` or `a/` in Foundation 6.3.1; use {instead}")
    return out


# The layering rules (issue "The house III"). Each finding is one line `RULE: SUBJECT`; the
# ones scripts/architecture-debt.txt lists are known debt, their counts ceilings. A finding
# not listed or over its ceiling fails the check, and so does a listed one that no longer
# holds (the list only shrinks).
DEBT = "scripts/architecture-debt.txt"
DEBT_HEADER = ("# Known layering debt (scripts/architecture-check.py, issue \"The house III\"): no new finding may\n"
               "# join it and no count may grow; fix one and remove its line, or run the check with --tighten.\n")
MAX_EXTENSION_FILES = 3
MAX_TYPE_LINES = 600
# What a file that imports a C module must name from it (regexes; the kbfs_ names the
# module's own header declares are added).
C_MODULE_USES = {
    "CFuse": [r"\bfuse_\w+", r"\bFUSE_\w+", r"\bkbfs_XATTR_\w+"],
    "CSodium": [r"\bsodium_\w+", r"\bcrypto_\w+", r"\brandombytes\w*"],
    "CSystem": [r"\b[lf]?(?:get|set|list|remove)xattr\b", r"\bXATTR_\w+"],
    "CCrypto": [],
    "CTPM": [],
    "CLogind": [],
}
# The classifier of backing names, the one file that may test the store's reserved prefix.
CLASSIFIER = "Sources/KeybagCore/Store/BackingKind.swift"
# The fronts: types that keep only their table and hand each request on to the rooms that own
# their state (at most so many lines in all and stored properties).
FRONTS = ["Filesystem", "Keybag"]
MAX_FRONT_LINES = 400
MAX_FRONT_STORED = 6
# Targets whose folders each need a folder of unit tests (Tests/<Target>Tests/<Folder>).
UNIT_TESTED_TARGETS = ["KeybagCore", "KeybagDaemon"]


def code_of(text):
    """`text` without // comments (a rough cut: enough for names and calls)."""
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def type_spread(files):
    """Findings: a type declared or extended in too many files, or too long in all."""
    spread = {}
    for path, text in files:
        if not path.startswith("Sources/") or not path.endswith(".swift"):
            continue
        lines = text.splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^(?:(?:public|internal|private|fileprivate|final|@\w+)\s+)*"
                         r"(?:class|struct|enum|actor|protocol|extension)\s+([A-Z]\w*)\b", line)
            if not m:
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "}"), len(lines) - 1)
            files_, count = spread.get(m.group(1), (set(), 0))
            spread[m.group(1)] = (files_ | {path}, count + end - i + 1)
    out = []
    for name, (paths, count) in sorted(spread.items()):
        if len(paths) > MAX_EXTENSION_FILES:
            out.append(f"type-spread: {name} is declared or extended in {len(paths)} files")
        if count > MAX_TYPE_LINES:
            out.append(f"type-size: {name} is {count} lines in all")
    return out


def front_sizes(files):
    """Findings: a front over its size, or holding more stored properties than its rooms."""
    lines_of, stored = {}, {}
    for path, text in files:
        if not path.startswith("Sources/") or not path.endswith(".swift"):
            continue
        lines = text.splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^(?:(?:public|internal|final)\s+)*(?:class|struct|extension)\s+(\w+)\b", line)
            if not m or m.group(1) not in FRONTS:
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "}"), len(lines) - 1)
            name = m.group(1)
            lines_of[name] = lines_of.get(name, 0) + end - i + 1
            for body in lines[i + 1:end]:
                d = re.match(r"^    (?:(?:public|internal|private|fileprivate|private\(set\)|public\(set\)|nonisolated)\s+)*"
                             r"(let|var)\s+(.*)$", body)
                if not d or (d.group(1) == "var" and body.rstrip().endswith("{")) or re.search(r"\{ *\S.*\}\s*$", body):
                    continue  # not a stored property (static, computed)
                names = d.group(2).split("=")[0]  # `let a: A, b: B` is two; `let c = C()` one
                stored[name] = stored.get(name, 0) + len(re.findall(r"(?:^|,)\s*\w+\s*(?::|$)", names))
    out = []
    for name in FRONTS:
        if lines_of.get(name, 0) > MAX_FRONT_LINES:
            out.append(f"front-size: {name} is {lines_of[name]} lines in all")
        if stored.get(name, 0) > MAX_FRONT_STORED:
            out.append(f"front-stored: {name} holds {stored[name]} stored properties")
    return out


def unused_imports(files):
    """Findings: a file that imports a C module and names nothing of it."""
    uses = {}
    for module, patterns in C_MODULE_USES.items():
        header = "".join(open(os.path.join(root, n), encoding="utf-8").read()
                         for root, _, names in os.walk(f"Sources/{module}") for n in names if n.endswith(".h"))
        declared = sorted(set(re.findall(r"\b(kbfs_\w+|KBFS_\w+)", header)))
        uses[module] = re.compile("|".join(patterns + [r"\b" + d + r"\b" for d in declared]) or "(?!)")
    out = []
    for path, text in files:
        if not path.startswith("Sources/") or not path.endswith(".swift"):
            continue
        code = code_of(text)
        for module in re.findall(r"^import (C\w+)$", text, re.M):
            if module in uses and not uses[module].search(code):
                out.append(f"unused-import: {path} imports {module} and uses none of it")
    return out


def calls_up(files):
    """Findings: a folder below the daemon's entry point that calls up into it."""
    return [f"calls-up: {path} calls MountDaemon" for path, text in files
            if path.startswith("Sources/") and path != "Sources/KeybagDaemon/MountDaemon.swift"
            and path.startswith(("Sources/KeybagDaemon/", "Sources/KeybagCore/"))
            and re.search(r"\bMountDaemon\.", code_of(text))]


def prefix_tests(files):
    """Findings: the store's reserved prefix tested outside the classifier."""
    pattern = re.compile(r"hasPrefix\((?:NameCipher\.|Self\.)?(?:reservedPrefix|\"\.kbfs)|\bisReserved\(")
    return [f"prefix-test: {path} tests the reserved prefix" for path, text in files
            if path.startswith("Sources/") and path != CLASSIFIER and pattern.search(code_of(text))]


def test_folders():
    """Findings: a folder of a unit-tested target without its folder of unit tests."""
    out = []
    for target in UNIT_TESTED_TARGETS:
        for folder in sorted(os.listdir(f"Sources/{target}")):
            if not os.path.isdir(f"Sources/{target}/{folder}"):
                continue
            tests = f"Tests/{target}Tests/{folder}"
            if not (os.path.isdir(tests) and any(n.endswith(".swift") for n in os.listdir(tests))):
                out.append(f"test-folder: Sources/{target}/{folder} has no {tests}")
    return out


def layering(files):
    """Exit lines for the layering rules, measured against the debt list."""
    found = set(type_spread(files) + front_sizes(files) + unused_imports(files) + calls_up(files) + prefix_tests(files) + test_folders())
    debt = {line.strip() for line in open(DEBT, encoding="utf-8") if line.strip() and not line.startswith("#")}
    # A count in a debt line is a ceiling: the same finding with a count at or below it is
    # covered (and its line must be lowered to it only when the check is asked to: --tighten).
    def key(line):
        return re.sub(r"\d+", "N", line)

    def count(line):
        return int(re.search(r"\d+", line).group()) if re.search(r"\d+", line) else 0

    ceilings = {key(d): d for d in debt}
    covered = {f for f in found if key(f) in ceilings and count(f) <= count(ceilings[key(f)])}
    fails = [f"{line}" + (f" (more than the {count(ceilings[key(line)])} in {DEBT})" if key(line) in ceilings else "")
             for line in sorted(found - covered)]
    fails += [f"{line}: no longer true; remove it from {DEBT}" for line in sorted(debt)
              if key(line) not in {key(f) for f in found}]
    if "--tighten" in sys.argv:  # lowers the ceilings to today's counts; never adds a line
        lowered = sorted({key(f): f for f in covered}.values())
        with open(DEBT, "w", encoding="utf-8") as out:
            out.write(DEBT_HEADER + "".join(line + "\n" for line in lowered))
    rules = sorted({line.split(":")[0] for line in found})
    print(f"# layering: {len(found)} findings ({len(covered)} known debt) over rules {', '.join(rules) or 'none'}")
    return fails


def main():
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    files = list(swift_files())
    file_names = {os.path.basename(p) for p, _ in files}
    file_stems = {os.path.splitext(n)[0] for n in file_names}
    code = "\n".join(t for p, t in files if p.startswith("Sources/"))
    everything = "\n".join(t for _, t in files)
    targets = set(re.findall(r'name: "([A-Za-z0-9_-]+)"', open("Package.swift", encoding="utf-8").read()))
    types = set(re.findall(r"\b(?:class|struct|enum|protocol|actor|typealias|extension)\s+([A-Z][A-Za-z0-9_]*)",
                           everything))
    members = set(re.findall(r"\b(?:func|var|let|case)\s+`?([a-z][A-Za-z0-9_]*)", code))
    if re.search(r"\binit[(?<]", code):
        members.add("init")
    doc = open(DOC, encoding="utf-8").read()
    missing = [f"line {n}: {len(line)} characters (at most {MAX_DOC_LINE}: one room per line)"
               for n, line in enumerate(doc.splitlines(), 1) if len(line) > MAX_DOC_LINE]
    for token in sorted(set(re.findall(r"`([^`\s]+)`", doc))):
        if token.startswith(("-", ".", "/", "$")) or not re.match(r"^[A-Za-z]", token):
            continue
        if token.endswith((".swift", ".c", ".h")):
            if os.path.basename(token) not in file_names:
                missing.append(f"{token}: no such file")
            continue
        if "/" in token:
            if token.split("/")[0].isupper() or token.endswith("/"):
                continue   # a path in a store
            if not any(os.path.exists(os.path.join(base, token)) for base in TREES + ["."]):
                missing.append(f"{token}: no such folder or file")
            continue
        m = re.match(r"^([A-Z][A-Za-z0-9_]*)(?:\.([a-z][A-Za-z0-9_]*))?(?:\(\))?$", token)
        if not m or token.isupper() or "_" in m.group(1):
            continue   # errno names, constants, words
        kind, member = m.group(1), m.group(2)
        if kind not in types | targets | LIBRARY_TYPES | (file_stems if not member else set()):
            missing.append(f"{token}: no type or target {kind}")
        elif member and member not in members:
            missing.append(f"{token}: no member {member}")
    for line in missing:
        print(f"FAIL: {DOC}: {line}", file=sys.stderr)
    traps = trapping_calls(files) + layering(files)
    for line in traps:
        print(f"FAIL: {line}", file=sys.stderr)
    missing += traps
    if not missing:
        print(f"# doc check: every file, folder, type and member {DOC} names exists")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
