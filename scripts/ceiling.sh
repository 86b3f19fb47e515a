#!/usr/bin/env bash
# How fast keybagfs' streaming write and read could be on this machine at best: the CPU
# that libfuse's passthrough_hp (the FUSE limit, no crypto) spends per MB, plus the CPU
# libsodium needs to seal or open a MB, spread over every core with nothing else running.
# That bound is optimistic (passthrough reads by splice without copying; keybagfs must copy
# what it decrypts), so a target above it cannot be met by any keybagfs data path here.
#
#   PASSTHROUGH_HP=/path/to/passthrough_hp scripts/ceiling.sh [ROUNDS]
#
# Measures, rounds interleaved, a 262 MB `dd` write (conv=fsync) and a cold read on tmpfs:
# wall time and busy CPU of all cores (/proc/stat: user, nice, system, irq, softirq, steal).
# Prints medians, then the bound: cores / (passthrough CPU per MB + crypto CPU per MB), as MB/s
# and as a fraction of passthrough. Needs root and a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
[[ -x ${PASSTHROUGH_HP:-} ]] || { echo "set PASSTHROUGH_HP to libfuse's example/passthrough_hp (see ../shared/bench/compare.sh)" >&2; exit 2; }
BIN=$(swift build -c release --show-bin-path)
W=$(mktemp -d /dev/shm/kbceil.XXXXXX)
cleanup() { cd /; for m in "$W"/*/m; do mountpoint -q "$m" && fusermount3 -u "$m"; done; rm -rf "$W"; }
trap cleanup EXIT
. scripts/bench-lib.sh
HZ=$(getconf CLK_TCK) CORES=$(nproc) MB=262.144

busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
declare -A WALL CPU
# measure SYS OP cmd...: appends wall seconds and busy CPU seconds of one run
measure() {
  local sys=$1 op=$2 b0 t0 t1 b1; shift 2
  sync; b0=$(busy); t0=$(date +%s.%N)
  "$@" 2>/dev/null
  t1=$(date +%s.%N); b1=$(busy)
  WALL[$sys,$op]+="$(echo "$t1 - $t0" | bc -l) "
  CPU[$sys,$op]+="$(echo "($b1 - $b0) / $HZ" | bc -l) "
}
for ((r = 1; r <= ROUNDS; r++)); do
  for sys in passthrough keybagfs; do
    d=$W/$sys$r; mkdir -p "$d/s" "$d/m"
    if [[ $sys == keybagfs ]]; then kb_scratch_mount "$d" "$BIN"
    else
      "$PASSTHROUGH_HP" "$d/s" "$d/m" </dev/null >/dev/null 2>&1
      for ((i = 0; i < 100; i++)); do mountpoint -q "$d/m" && break; sleep 0.05; done
    fi
    cd "$d/m"
    measure $sys write dd if=/dev/zero of=zero bs=131072 count=2000 conv=fsync
    sync; echo 3 >/proc/sys/vm/drop_caches
    measure $sys read dd if=zero of=/dev/null bs=131072 count=2000
    cd /; fusermount3 -u "$d/m"; rm -rf "$d"
  done
done

crypto=$("$BIN/keybagfs-bench" crypto | grep '^xchacha20poly1305')
seal=$(awk '{print $3}' <<<"$crypto") open=$(awk '{print $6}' <<<"$crypto")
echo "# $CORES cores, $ROUNDS rounds, stores on /dev/shm; libsodium XChaCha20-Poly1305 on one core: seal $seal MB/s, open $open MB/s (4 KiB blocks)"
printf '%-6s %-12s %10s %14s %14s\n' op system MB/s "CPU s per GB" "cores busy"
for op in write read; do
  rate=$seal; [[ $op == read ]] && rate=$open
  for sys in passthrough keybagfs; do
    w=$(echo "${WALL[$sys,$op]}" | tr ' ' '\n' | grep . | median)
    c=$(echo "${CPU[$sys,$op]}" | tr ' ' '\n' | grep . | median)
    printf '%-6s %-12s %10.0f %14.2f %14.2f\n' $op $sys "$(echo "$MB / $w" | bc -l)" "$(echo "$c / $MB * 1000" | bc -l)" "$(echo "$c / $w" | bc -l)"
  done
  ptw=$(echo "${WALL[passthrough,$op]}" | tr ' ' '\n' | grep . | median)
  ptc=$(echo "${CPU[passthrough,$op]}" | tr ' ' '\n' | grep . | median)
  # per MB: passthrough's CPU plus one MB of crypto on one core; all cores busy
  bound=$(echo "$CORES / ($ptc / $MB + 1 / $rate)" | bc -l)
  printf '%-6s %-12s %10.0f   = %.2f x passthrough at best\n' $op bound "$bound" "$(echo "$bound / ($MB / $ptw)" | bc -l)"
done
