#!/usr/bin/env bash
# Memory soak: tar -x and rm -rf of a kernel tree in a loop on one mount for SECONDS
# (default 3600), printing the daemon's RSS after every extract and every removal, then
# the first, last and highest values. A leak shows as RSS creeping up across iterations.
#   SECONDS_TOTAL=3600 scripts/soak.sh [TAR]   (default TAR: ten top folders of linux-source-6.1, ~15k entries)
# Needs root and a release build (uses the binaries in BIN, default the release folder).
set -euo pipefail
cd "$(dirname "$0")/.."
TOTAL=${SECONDS_TOTAL:-3600}
BIN=${BIN:-$(swift build -c release --show-bin-path)}
W=$(mktemp -d /dev/shm/kbsoak.XXXXXX)
trap 'cd /; fusermount3 -u "$W/m" 2>/dev/null || true; rm -rf "$W"' EXIT
. scripts/bench-lib.sh
TAR=${1:-}
if [[ -z $TAR ]]; then TAR=$W/tree.tar; kb_tree_tar "$TAR" fs net kernel include sound lib mm crypto security block; fi
kb_scratch_mount "$W" "$BIN"; pid=$KB_PID
rss() { awk '/VmRSS/{print $2}' "/proc/$pid/status"; }
echo "# $(date -u +%FT%TZ) soak ${TOTAL}s, tree $(tar -tf "$TAR" | wc -l) entries; RSS in KiB"
echo "iteration seconds rss_after_untar rss_after_rm"
start=$(date +%s) i=0 first="" max=0
cd "$W/m"
while (( $(date +%s) - start < TOTAL )); do
  i=$((i + 1))
  tar -xf "$TAR"; a=$(rss)
  rm -rf linux-source-6.1; b=$(rss)
  [[ -n $first ]] || first=$b
  (( a > max )) && max=$a; (( b > max )) && max=$b
  echo "$i $(( $(date +%s) - start )) $a $b"
done
cd /
[[ -z $(ls -A "$W/m") ]] || { echo "soak: the mount is not empty after rm -rf" >&2; exit 1; }
echo "# iterations $i; RSS after rm: first $first KiB, last $b KiB; highest $max KiB"
