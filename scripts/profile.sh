#!/usr/bin/env bash
# Where the daemon's time goes: perf profiles of the keybagfs daemon during a streaming
# write (dd, 262 MB) and during tar -x of a tree, plus the FUSE request mix of each.
#   scripts/profile.sh [TAR]     (default: the kernel tree's fs/ folder, as compare.sh quick)
# Needs root, perf and a release build. Prints the top symbols (self time) per phase.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v perf >/dev/null || { echo "perf is missing (apt-get install linux-perf)" >&2; exit 1; }
BIN=$(swift build -c release --show-bin-path)
W=$(mktemp -d /dev/shm/kbprof.XXXXXX)
trap 'cd /; fusermount3 -u "$W/m" 2>/dev/null || true; rm -rf "$W"' EXIT
. scripts/bench-lib.sh
TAR=${1:-}
if [[ -z $TAR ]]; then TAR=$W/tree.tar; kb_tree_tar "$TAR" fs; fi
kb_scratch_mount "$W" "$BIN"; pid=$KB_PID
conn=$(mountpoint -d "$W/m" | cut -d: -f2)   # the FUSE connection id, to leave other mounts' requests out

phase() { # name command...
  local name=$1; shift; set +o pipefail   # head closes the report pipes early
  perf record -q -F 4000 -g -p "$pid" -o "$W/$name.perf" 2>/dev/null & local p=$!
  perf record -q -e fuse:fuse_request_send -a -o "$W/$name.ops" 2>/dev/null & local q=$!
  sleep 0.5
  (cd "$W/m" && "$@" >/dev/null)
  kill -INT $p $q; wait $p $q 2>/dev/null || true
  echo "== $name: FUSE requests"
  perf script -i "$W/$name.ops" 2>/dev/null | grep "connection $conn " | grep -oE "\(FUSE_[A-Z_]+\)" | sort | uniq -c | sort -rn | head -8
  echo "== $name: daemon CPU by library"
  perf report -i "$W/$name.perf" --no-children --sort dso -g none 2>&1 | grep -E "^ +[0-9]" | head -8
  echo "== $name: top symbols (self)"
  perf report -i "$W/$name.perf" --no-children --sort sym -g none 2>&1 | grep -E "^ +[0-9]" | head -25 | cut -c1-150
}
phase write dd if=/dev/zero of=zero bs=131072 count=2000 conv=fsync
rm -f "$W/m/zero"
phase untar tar -xf "$TAR"
