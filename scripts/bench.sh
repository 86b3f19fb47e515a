#!/usr/bin/env bash
# Builds release binaries, runs the side-by-side harness (keybagfs vs gocryptfs vs plain),
# then measures lock latency and daemon RSS with FILES open class A files.
#   scripts/bench.sh [compare.sh options]        e.g. --tree full --rounds 3
#   FILES=10000 scripts/bench.sh --tree quick --rounds 1
#   COMPARE=0 scripts/bench.sh                   (lock latency and RSS only)
# Needs root. FILES needs a descriptor per file in the daemon and one in the tool.
set -euo pipefail
cd "$(dirname "$0")/.."
FILES=${FILES:-10000}
swift build -c release
BIN=$(swift build -c release --show-bin-path)
[[ ${COMPARE:-1} == 0 ]] || bash ../shared/bench/compare.sh --keybagfs "$BIN" "$@"

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
echo "# memory over time: scripts/soak.sh (1 hour); profiles: scripts/profile.sh"
