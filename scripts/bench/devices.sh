#!/usr/bin/env bash
# "Several devices II" numbers: mount, unlock and lock times of a store of one device against
# the same with three devices (identities, certificates, a key-set record), ROUNDS interleaved
# rounds, medians with min-max; then `keybagfs device remove` on a store of FILES files (no
# file is re-encrypted: only key sets and wraps change) and the unlock that takes the new set
# up on a device that stays.
#   scripts/bench/devices.sh                 FILES=100000, ROUNDS=5
#   FILES=10000 ROUNDS=3 scripts/bench/devices.sh
# Needs root and release binaries (.build/release, or BIN=DIR). Stores live in DIR (default a
# new folder under /var/tmp: the disk, not tmpfs). KDF: moderate (the default).
set -euo pipefail
cd "$(dirname "$0")/../.."
FILES=${FILES:-100000}
ROUNDS=${ROUNDS:-5}
BIN=${BIN:-$PWD/.build/release}
for b in keybagfs keybagctl; do [[ -x $BIN/$b ]] || { echo "$BIN/$b missing: swift build -c release" >&2; exit 1; }; done
W=$(mktemp -d "${DIR:-/var/tmp}/kbdev.XXXXXX")
cleanup() {
  for m in "$W"/m-*; do fusermount3 -u "$m" 2>/dev/null || true; done
  rm -rf "$W"
}
trap cleanup EXIT
export STATE_DIRECTORY=$W/state
mkdir -p "$W/state"
ns() { date +%s%N; }
kb() { "$BIN/keybagfs" "$@"; }
ctl() { "$BIN/keybagctl" "$@"; }

# one: a store of one device. three: a store of three (B by the recovery key, C too), each
# device's files in the one folder, as after a sync.
printf 'pw\n' | kb init "$W/one" --passcode-stdin --device-key "$W/dk-one" --recovery-key-file "$W/rk-one" >/dev/null
printf 'pw\n' | kb init "$W/three" --passcode-stdin --device-key "$W/dk-a" --recovery-key-file "$W/rk" >/dev/null
for d in b c; do
  printf 'pw-%s\n' "$d" | kb device add "$W/three" --device-key "$W/dk-$d" --recovery-key-file "$W/rk" --stdin \
    --name "host-$d" >/dev/null
done
declare -A mount_ms unlock_ms lock_ms
for r in $(seq "$ROUNDS"); do
  for v in one three; do
    dk=$W/dk-one; [[ $v == three ]] && dk=$W/dk-a
    mkdir -p "$W/m-$v"
    t0=$(ns)
    kb mount "$W/$v" "$W/m-$v" --device-key "$dk" --socket "$W/sock-$v"
    t1=$(ns)
    printf 'pw\n' | ctl --socket "$W/sock-$v" unlock --passcode-stdin
    t2=$(ns)
    ctl --socket "$W/sock-$v" lock --grace 0 --wait >/dev/null
    t3=$(ns)
    fusermount3 -u "$W/m-$v"
    mount_ms[$v]+="$(( (t1 - t0) / 1000000 )) "
    unlock_ms[$v]+="$(( (t2 - t1) / 1000000 )) "
    lock_ms[$v]+="$(( (t3 - t2) / 1000000 )) "
    sleep 0.5
  done
done
stats() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {printf "%d (%d-%d)", a[int((NR+1)/2)], a[1], a[NR]}'; }
echo "# $ROUNDS interleaved rounds, ms: median (min-max); KDF moderate; $(uname -r)"
printf '%-8s %-18s %-18s\n' "" "one device" "three devices"
for k in mount unlock lock; do
  declare -n arr="${k}_ms"
  printf '%-8s %-18s %-18s\n' "$k" "$(stats <<<"${arr[one]}")" "$(stats <<<"${arr[three]}")"
done

echo "# device remove on a store of $FILES files"
mkdir -p "$W/m-three"
kb mount "$W/three" "$W/m-three" --device-key "$W/dk-a" --socket "$W/sock-three"
printf 'pw\n' | ctl --socket "$W/sock-three" unlock --passcode-stdin
python3 scripts/bench/make-tree.py "$W/m-three" "$FILES"
fusermount3 -u "$W/m-three"
sync
idb=$(kb device id "$W/three" --device-key "$W/dk-b")
t0=$(ns)
printf 'pw\n' | kb device remove "$W/three" "$idb" --device-key "$W/dk-a" --recovery-key-file "$W/rk" --stdin >/dev/null
t1=$(ns)
echo "device remove: $(( (t1 - t0) / 1000000 )) ms (one Argon2id run to open, one to wrap the new set; no file touched)"
mkdir -p "$W/m-c"
kb mount "$W/three" "$W/m-c" --device-key "$W/dk-c" --socket "$W/sock-c"
t0=$(ns)
printf 'pw-c\n' | ctl --socket "$W/sock-c" unlock --passcode-stdin
t1=$(ns)
echo "C's unlock that takes key set 1 up: $(( (t1 - t0) / 1000000 )) ms (two Argon2id runs: unlock, then wrap the set)"
printf 'pw-c\n' | ctl --socket "$W/sock-c" lock --grace 0 --wait >/dev/null
t0=$(ns)
printf 'pw-c\n' | ctl --socket "$W/sock-c" unlock --passcode-stdin
t1=$(ns)
echo "C's next unlock: $(( (t1 - t0) / 1000000 )) ms"
fusermount3 -u "$W/m-c"
