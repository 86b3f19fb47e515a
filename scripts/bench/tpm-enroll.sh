#!/usr/bin/env bash
# "Hardware keys II" numbers: `keybagfs tpm2 enroll` (new key set + every header rewrapped) on a
# tree of FILES files, then `keybagfs rewrap` on the same tree (nothing left to move: the walk
# alone), and the time of `keybagctl unlock` (default KDF, moderate) with the passcode sealed in
# swtpm, without and with PCR 7 binding, interleaved ROUNDS times.
#   scripts/bench/tpm-enroll.sh                 FILES=100000, ROUNDS=5
#   FILES=10000 ROUNDS=3 scripts/bench/tpm-enroll.sh
# Needs root, swtpm and tpm2-tools, and release binaries (.build/release, or BIN=DIR).
# The store lives in DIR (default a new folder under /var/tmp: the disk, not tmpfs).
set -euo pipefail
cd "$(dirname "$0")/../.."
FILES=${FILES:-100000}
ROUNDS=${ROUNDS:-5}
BIN=${BIN:-$PWD/.build/release}
for b in keybagfs keybagctl; do [[ -x $BIN/$b ]] || { echo "$BIN/$b missing: swift build -c release" >&2; exit 1; }; done
W=$(mktemp -d "${DIR:-/var/tmp}/kbtpm.XXXXXX")
port=$((24000 + RANDOM % 1000 * 2))
mkdir -p "$W/tpm" "$W/state"
swtpm socket --tpm2 --tpmstate dir="$W/tpm" --server type=tcp,port=$port,bindaddr=127.0.0.1 \
  --ctrl type=tcp,port=$((port + 1)),bindaddr=127.0.0.1 --flags startup-clear >/dev/null 2>&1 &
tpm_pid=$!
cleanup() {
  for m in "$W"/m*; do fusermount3 -u "$m" 2>/dev/null || true; done
  kill "$tpm_pid" 2>/dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
export STATE_DIRECTORY=$W/state TPM2TOOLS_TCTI=swtpm:host=127.0.0.1,port=$port
for _ in $(seq 50); do tpm2_getcap properties-fixed >/dev/null 2>&1 && break; sleep 0.1; done
tpm2_dictionarylockout -s -n 32 -t 600 -l 600 >/dev/null
tcti=$TPM2TOOLS_TCTI
ms() { date +%s%N; }

echo "# tpm2 enroll on $FILES files (swtpm, $(uname -r))"
printf 'pw\n' | "$BIN/keybagfs" init "$W/s" --passcode-stdin --device-key "$W/dk" --tpm2 off \
  --recovery-key-file "$W/rk" >/dev/null
mkdir "$W/m"
"$BIN/keybagfs" mount "$W/s" "$W/m" --device-key "$W/dk" --socket "$W/sock"
printf 'pw\n' | "$BIN/keybagctl" --socket "$W/sock" unlock --passcode-stdin
python3 scripts/bench/make-tree.py "$W/m" "$FILES"
fusermount3 -u "$W/m"
sleep 1
sync
t0=$(ms)
printf 'pw\n' | "$BIN/keybagfs" tpm2 enroll "$W/s" --device-key "$W/dk" --tpm2-device "$tcti" --passcode-stdin \
  --recovery-key-file "$W/rk" | grep -E "rewrapped|key set"
t1=$(ms)
echo "tpm2 enroll: $(( (t1 - t0) / 1000000 )) ms for $FILES files (KDF moderate, one TPM seal)"
t0=$(ms)
printf 'pw\n' | "$BIN/keybagfs" rewrap "$W/s" --device-key "$W/dk" --passcode-stdin 2>/dev/null
t1=$(ms)
echo "rewrap with nothing to move: $(( (t1 - t0) / 1000000 )) ms"

echo "# unlock time, sealed in swtpm, without and with PCR 7 ($ROUNDS interleaved rounds)"
for v in plain pcr7; do
  extra=(); [[ $v == pcr7 ]] && extra=(--tpm2-pcrs 7)
  printf 'pw\n' | "$BIN/keybagfs" init "$W/u-$v" --passcode-stdin --device-key "$W/dk-$v" --tpm2 on \
    --tpm2-device "$tcti" --no-recovery-key --tpm2-accept-clearable-lockout "${extra[@]}" >/dev/null
  mkdir "$W/m-$v"
  "$BIN/keybagfs" mount "$W/u-$v" "$W/m-$v" --device-key "$W/dk-$v" --socket "$W/sock-$v" --tpm2-device "$tcti"
done
declare -A times
for r in $(seq "$ROUNDS"); do
  for v in plain pcr7; do
    t0=$(ms)
    printf 'pw\n' | "$BIN/keybagctl" --socket "$W/sock-$v" unlock --passcode-stdin
    t1=$(ms)
    times[$v]+="$(( (t1 - t0) / 1000000 )) "
    "$BIN/keybagctl" --socket "$W/sock-$v" lock --grace 0 >/dev/null
  done
done
for v in plain pcr7; do
  sorted=$(tr ' ' '\n' <<<"${times[$v]}" | grep . | sort -n | tr '\n' ' ')
  read -r -a a <<<"$sorted"
  echo "unlock $v: median ${a[$(( ${#a[@]} / 2 ))]} ms (min ${a[0]}, max ${a[-1]}; ms: ${times[$v]})"
done
