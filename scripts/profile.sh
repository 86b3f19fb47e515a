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
TAR=${1:-}
if [[ -z $TAR ]]; then
  TAR=$W/tree.tar
  xz -dc /usr/src/linux-source-6.1.tar.xz | tar -C "$W" -xf - linux-source-6.1/fs
  tar -C "$W" -cf "$TAR" linux-source-6.1 && rm -rf "$W/linux-source-6.1"
fi
mkdir -p "$W/s" "$W/m"
echo pw | "$BIN/keybagfs" init "$W/s" --passcode-stdin --device-key "$W/dk" --kdf interactive >/dev/null
"$BIN/keybagfs" mount "$W/s" "$W/m" --device-key "$W/dk" --socket "$W/sock" --grace 0 >/dev/null
echo pw | "$BIN/keybagctl" --socket "$W/sock" unlock --passcode-stdin >/dev/null
pid=$("$BIN/keybagctl" --socket "$W/sock" status --json | sed -E 's/.*"pid":([0-9]+).*/\1/')

phase() { # name command...
  local name=$1; shift; set +o pipefail   # head closes the report pipes early
  perf record -q -F 4000 -g -p "$pid" -o "$W/$name.perf" 2>/dev/null & local p=$!
  perf record -q -e fuse:fuse_request_send -a -o "$W/$name.ops" 2>/dev/null & local q=$!
  sleep 0.5
  (cd "$W/m" && "$@" >/dev/null)
  kill -INT $p $q; wait $p $q 2>/dev/null || true
  echo "== $name: FUSE requests"
  perf script -i "$W/$name.ops" 2>/dev/null | grep -oE "\(FUSE_[A-Z_]+\)" | sort | uniq -c | sort -rn | head -8
  echo "== $name: daemon CPU by library"
  perf report -i "$W/$name.perf" --no-children --sort dso -g none 2>/dev/null | grep -E "^ +[0-9]" | head -8
  echo "== $name: top symbols (self)"
  perf report -i "$W/$name.perf" --no-children --sort sym -g none 2>/dev/null | grep -E "^ +[0-9]" | head -25 | cut -c1-150
}
phase write dd if=/dev/zero of=zero bs=131072 count=2000 conv=fsync
rm -f "$W/m/zero"
phase untar tar -xf "$TAR"
