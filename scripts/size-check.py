#!/usr/bin/env python3
"""Size limits of the source tree (issue "The house II"), checked by scripts/test.sh.

- No Swift file under Sources over 450 lines.
- No function, initializer or deinitializer over 60 lines.

A function's length runs from its declaration line to the closing brace at its own
indentation (swift-format style: the brace closes on a line of its own).
Exit 0 when within the limits, 1 with one line per excess otherwise.
"""

import os
import re
import sys

FILE_LIMIT = 450
FUNCTION_LIMIT = 60
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
                if length > FUNCTION_LIMIT:
                    problems.append(f"{path}:{start}: {length} lines (limit {FUNCTION_LIMIT}): {decl[:80]}")
    for p in problems:
        print("FAIL: " + p, file=sys.stderr)
    if not problems:
        print(f"# size check: no Sources file over {FILE_LIMIT} lines, no function over {FUNCTION_LIMIT}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
