#!/usr/bin/env bash
# Lock latency and daemon RSS with FILES open class A files (what scripts/bench.sh did after the
# side-by-side comparison before the harness moved to scripts/bench/bench.py).
#   scripts/bench/lock-latency.sh                 FILES=10000 by default, 3 runs
#   FILES=1000 scripts/bench/lock-latency.sh
# Needs root and release binaries (.build/release, or BIN=DIR). FILES needs a descriptor per file
# in the daemon and one in the tool.
set -euo pipefail
cd "$(dirname "$0")/../.."
FILES=${FILES:-10000}
BIN=${BIN:-.build/release}
for b in keybagfs keybagctl keybagfs-bench; do
  [[ -x $BIN/$b ]] || { echo "$BIN/$b missing: swift build -c release" >&2; exit 1; }
done
echo "# lock latency and RSS with $FILES open class A files"
W=$(mktemp -d /dev/shm/kblock.XXXXXX)
trap 'fusermount3 -u "$W/m" 2>/dev/null || true; rm -rf "$W"' EXIT
. scripts/bench-lib.sh
kb_scratch_mount "$W" "$BIN"; pid=$KB_PID
echo "daemon RSS after unlock: $(awk '/VmRSS/{print $2, $3}' /proc/$pid/status)"
for round in 1 2 3; do
  echo pw | "$BIN/keybagfs-bench" lock-latency "$W/m" "$W/sock" "$FILES" | grep -v "^unlock: type"
  rm -rf "$W"/m/lock-latency-*
  sleep 1.5   # the heap trimmer runs once a second after files are freed
  echo "daemon RSS after the files are closed and removed: $(awk '/VmRSS/{print $2, $3}' /proc/$pid/status)"
done
