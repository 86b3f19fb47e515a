#!/usr/bin/env python3
"""Writes N files of 100 bytes into ROOT (a mount), 1,000 per folder: the tree the device and
TPM benchmarks time their commands on.  usage: make-tree.py ROOT N"""
import os
import sys

root, n = sys.argv[1], int(sys.argv[2])
per = 1000
for d in range((n + per - 1) // per):
    os.mkdir(f"{root}/d{d}")
    for f in range(min(per, n - d * per)):
        with open(f"{root}/d{d}/f{f}", "wb") as fh:
            fh.write(b"x" * 100)
