#!/usr/bin/env python3
"""Size limits of the source tree (issue "The house II"), checked by scripts/test.sh.

- No Swift file under Sources over 450 lines.
- No function, initializer or deinitializer over 60 lines. The ones that were longer when
  the check came in are listed in KNOWN with their length then: they may shrink, never grow;
  a new long one fails.

A function's length runs from its declaration line to the closing brace at its own
indentation (swift-format style: the brace closes on a line of its own).
Exit 0 when within the limits, 1 with one line per excess otherwise.
"""

import os
import re
import sys

FILE_LIMIT = 450
FUNCTION_LIMIT = 60
# path:declaration-start -> lines when the check came in (may only shrink).
KNOWN = {
    "Sources/KeybagCore/Check/StoreCheck.swift:func checkDirectory(": 83,
    "Sources/keybagfs-bench/Bench.swift:static func crypto(": 82,
    "Sources/keybagfs/RecoveryCommands.swift:func run(": 79,
    "Sources/keybagctl/Follow.swift:func run(": 76,
    "Sources/KeybagCore/Keybag/RecoveryKey.swift:public mutating func recover(": 67,
    "Sources/KeybagDaemon/Watch/StoreWatcher.swift:private func handle(": 65,
    "Sources/KeybagCore/Devices/Devices.swift:public mutating func removeDevice(": 64,
    "Sources/KeybagCore/Keybag/Keybag.swift:static func validate(": 61,
    "Sources/KeybagCore/Check/StoreCheck+Files.swift:func checkFile(": 61,
}
DECL = re.compile(
    r"^(\s*)(?:@\w+(?:\([^)]*\))?\s+)*"
    r"(?:(?:public|private|fileprivate|internal|static|override|mutating|nonmutating|final|class|"
    r"convenience|required)\s+)*(func\s|init[(<?!]|deinit\b)")


def functions(lines):
    """(start line, length, declaration) of every function body in a file."""
    for i, line in enumerate(lines):
        m = DECL.match(line)
        if not m:
            continue
        indent, j = m.group(1), i
        while j < len(lines) and not lines[j].rstrip().endswith("{"):
            if lines[j].rstrip().endswith("}") and "{" in lines[j]:
                break   # a one-line body
            j += 1
        if j >= len(lines) or not lines[j].rstrip().endswith("{"):
            continue
        k = j + 1
        while k < len(lines) and lines[k].rstrip() != indent + "}":
            k += 1
        yield i + 1, k - i + 1, line.strip()


def main():
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    problems = []
    for root, _, names in os.walk("Sources"):
        for name in sorted(names):
            if not name.endswith(".swift"):
                continue
            path = os.path.join(root, name)
            lines = open(path, encoding="utf-8").read().split("\n")
            if len(lines) - 1 > FILE_LIMIT:
                problems.append(f"{path}: {len(lines) - 1} lines (limit {FILE_LIMIT})")
            for start, length, decl in functions(lines):
                if length <= FUNCTION_LIMIT:
                    continue
                key = next((k for k in KNOWN if k.startswith(path + ":") and decl.startswith(k.split(":", 1)[1])), None)
                if key is None:
                    problems.append(f"{path}:{start}: {length} lines (limit {FUNCTION_LIMIT}): {decl[:80]}")
                elif length > KNOWN[key]:
                    problems.append(f"{path}:{start}: grew to {length} lines (was {KNOWN[key]}; limit {FUNCTION_LIMIT}): {decl[:80]}")
    for p in problems:
        print("FAIL: " + p, file=sys.stderr)
    if not problems:
        print(f"# size check: no Sources file over {FILE_LIMIT} lines, no new function over {FUNCTION_LIMIT} "
              f"({len(KNOWN)} older ones may only shrink)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
