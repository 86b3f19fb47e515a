#!/usr/bin/env python3
"""Fails when a public symbol of the FileProtection library has no doc comment.

Reads the symbol graphs that `swift package generate-documentation` extracted."""
import glob, json, sys

files = glob.glob(".build/*/extracted-symbols/*/FileProtection/FileProtection*.symbols.json")
if not files:
    sys.exit("FAIL: no FileProtection symbol graph; run swift package generate-documentation first")
missing, seen = [], 0
for f in files:
    for s in json.load(open(f))["symbols"]:
        if s["kind"]["identifier"] == "swift.extension" or s.get("accessLevel") not in ("public", "open"):
            continue
        if "::SYNTHESIZED::" in s["identifier"]["precise"]:
            continue  # members a protocol supplies (hashValue of a RawRepresentable), documented there
        seen += 1
        if not s.get("docComment", {}).get("lines"):
            missing.append("/".join(s["pathComponents"]))
if missing:
    sys.exit("FAIL: public symbols without documentation:\n  " + "\n  ".join(sorted(missing)))
print(f"# DocC: all {seen} public symbols of FileProtection are documented")
