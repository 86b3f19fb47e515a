#!/usr/bin/env bash
# rm -rf of many small files on keybagfs with and without the kernel's write-back cache,
# gocryptfs and libfuse's passthrough_hp (when PASSTHROUGH_HP is set), rounds interleaved:
# wall time and the daemon's CPU per file, and (TRACE=1) the FUSE request mix of the last
# round from the fuse:fuse_request_send tracepoint. Shows what the SETATTR the kernel sends
# after each unlink under the write-back cache costs (docs/PERFORMANCE.md, session 19).
# Usage: scripts/bench/rm-setattr.sh [ROUNDS] [FILES]   (root; stores on /dev/shm)
set -euo pipefail
rounds=${1:-5} files=${2:-5000}
kb=${KEYBAGFS_BIN:-.build/release}
base=$(mktemp -d /dev/shm/kbfs-rm.XXXXXX)
trap 'fusermount3 -u "$base/m" 2>/dev/null || true; rm -rf "$base"' EXIT
systems="keybagfs keybagfs-no-writeback gocryptfs"
[ -n "${PASSTHROUGH_HP:-}" ] && systems="$systems passthrough_hp"
tracing=/sys/kernel/tracing
if [ "${TRACE:-0}" = 1 ] && [ ! -d $tracing/events/fuse ]; then mount -t tracefs nodev $tracing; fi

mount_system() {   # SYSTEM: mounts $base/s on $base/m, sets pid
  fusermount3 -u "$base/m" 2>/dev/null || true
  rm -rf "$base/s" "$base/m" "$base/dk" "$base/sock"; mkdir -p "$base/s" "$base/m"
  case $1 in
    keybagfs*)
      "$kb/keybagfs" init "$base/s" --passcode-stdin --device-key "$base/dk" --kdf interactive \
        --no-recovery-key --tpm2 off <<<"pw" >/dev/null
      local extra=(); [ "$1" = keybagfs-no-writeback ] && extra=(--no-writeback-cache)
      "$kb/keybagfs" mount "$base/s" "$base/m" --device-key "$base/dk" --socket "$base/sock" --grace 0 "${extra[@]}"
      "$kb/keybagctl" --socket "$base/sock" unlock --passcode-stdin <<<"pw" >/dev/null
      pid=$("$kb/keybagctl" --socket "$base/sock" status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])');;
    gocryptfs)
      gocryptfs -q -init -extpass "echo pw" "$base/s" 2>/dev/null
      gocryptfs -q -extpass "echo pw" "$base/s" "$base/m" 2>/dev/null
      pid=$(pgrep -f "gocryptfs .*$base/m" | head -1);;
    passthrough_hp)
      "$PASSTHROUGH_HP" "$base/s" "$base/m" </dev/null
      for _ in $(seq 50); do mountpoint -q "$base/m" && break; sleep 0.05; done
      pid=$(pgrep -f "passthrough_hp $base/s" | head -1);;
  esac
}

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "round system wall_ms daemon_cpu_us_per_file"
for r in $(seq 1 "$rounds"); do
  for sys in $systems; do
    mount_system "$sys"
    for d in $(seq 1 50); do
      mkdir "$base/m/d$d"
      (cd "$base/m/d$d" && for f in $(seq 1 $((files / 50))); do echo x >"f$f"; done)
    done
    sync; echo 3 >/proc/sys/vm/drop_caches
    if [ "${TRACE:-0}" = 1 ] && [ "$r" = "$rounds" ]; then
      echo >$tracing/trace; echo 1 >$tracing/events/fuse/fuse_request_send/enable; echo 1 >$tracing/tracing_on
    fi
    c0=$(cpu "$pid"); t0=$(date +%s%N)
    rm -rf "$base/m"/d*
    t1=$(date +%s%N); c1=$(cpu "$pid")
    echo "$r $sys $(( (t1 - t0) / 1000000 )) $(( (c1 - c0) * 1000000 / $(getconf CLK_TCK) / files ))"
    if [ "${TRACE:-0}" = 1 ] && [ "$r" = "$rounds" ]; then
      echo 0 >$tracing/tracing_on; echo 0 >$tracing/events/fuse/fuse_request_send/enable
      grep -o 'opcode [0-9]* ([A-Z_]*)' $tracing/trace | sort | uniq -c | sort -rn | head -4 | sed "s/^/# $sys /"
    fi
    fusermount3 -u "$base/m"; sleep 0.3
  done
done 2> >(grep -v -i syslog >&2)
