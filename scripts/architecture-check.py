#!/usr/bin/env python3
"""Holds docs/ARCHITECTURE.md to the code (issue "The house II"), run by scripts/test.sh.

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
TREES = ["Sources", "Tests", "Examples"]
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
    """One line per use of a call in TRAPPING_CALLS in Sources (comments excluded)."""
    out = []
    for path, text in files:
        if not path.startswith("Sources/"):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("//")[0]
            for call, instead in TRAPPING_CALLS.items():
                if re.search(r"\b" + call + r"\b", code):
                    out.append(f"{path}:{n}: {call.split('(')[0]} traps on `s`, `.` or `a/` in Foundation 6.3.1; use {instead}")
    return out


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
    missing = []
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
    traps = trapping_calls(files)
    for line in traps:
        print(f"FAIL: {line}", file=sys.stderr)
    missing += traps
    if not missing:
        print(f"# doc check: every file, folder, type and member {DOC} names exists")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
