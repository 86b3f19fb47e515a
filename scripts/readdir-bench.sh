#!/usr/bin/env bash
# ls -l of a directory of N entries on keybagfs and gocryptfs (stores on tmpfs), median of
# ROUNDS runs with the kernel's caches dropped before each.   N=10000 ROUNDS=5
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-10000} ROUNDS=${ROUNDS:-5}
BIN=${BIN:-.build/release}
command -v gocryptfs >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gocryptfs >/dev/null; }
W=$(mktemp -d /dev/shm/kbls.XXXXXX)
cleanup() { fusermount3 -u "$W/kbm" 2>/dev/null || true; fusermount3 -u "$W/gcm" 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
mkdir -p "$W/kb" "$W/kbm" "$W/gc" "$W/gcm"
echo pw | "$BIN/keybagfs" init "$W/kb" --passcode-stdin --device-key "$W/dk" --kdf interactive >/dev/null
"$BIN/keybagfs" mount "$W/kb" "$W/kbm" --device-key "$W/dk" --socket "$W/s.sock" --default-class none
gocryptfs -q -init -extpass "echo pw" "$W/gc" >/dev/null 2>&1
gocryptfs -q -extpass "echo pw" "$W/gc" "$W/gcm" >/dev/null 2>&1
for m in kbm gcm; do mkdir "$W/$m/d"; (cd "$W/$m/d" && seq -f "file-with-a-typical-name-%06g.txt" 1 "$N" | xargs touch); done
median() { sort -g | awk '{a[NR]=$1} END{print (NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2}'; }
for m in kbm gcm; do
  name=$([[ $m == kbm ]] && echo keybagfs || echo gocryptfs)
  t=$(for r in $(seq "$ROUNDS"); do
    echo 3 >/proc/sys/vm/drop_caches
    t0=$(date +%s.%N); ls -l "$W/$m/d" >/dev/null; t1=$(date +%s.%N)
    echo "$t1 - $t0" | bc -l
  done | median)
  echo "$name: ls -l of $N entries: $t s (median of $ROUNDS, caches dropped)"
done
