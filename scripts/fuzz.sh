#!/usr/bin/env bash
# Fuzzes every parser of store and socket bytes (Fuzz/Targets, docs/TESTING.md "Fuzzing"):
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default 8 s each: the test command's pass)
#   scripts/fuzz.sh 3600 --merge                          (the long pass; new coverage kept in Fuzz/corpus)
# Each target starts from its committed corpus (Fuzz/corpus/TARGET) under libFuzzer with
# AddressSanitizer and LeakSanitizer; any crash, trap, leak, timeout or allocation over the
# limits fails the run and leaves the input in Fuzz/crashes/ (commit it beside the corpus as a
# regression input once fixed). Prints per target: executions, libFuzzer's cov: and ft:,
# peak RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-8}
[[ $# -gt 0 ]] && shift
merge=0
targets=()
for a in "$@"; do if [[ $a == --merge ]]; then merge=1; else targets+=("$a"); fi; done
[[ ${#targets[@]} -gt 0 ]] || mapfile -t targets < <(ls Fuzz/corpus)
# Every target has a corpus folder and every corpus folder a target (the plain build lists them).
swift build --product keybagfs-fuzz >/dev/null
if [[ $(.build/debug/keybagfs-fuzz list | sort) != $(ls Fuzz/corpus | sort) ]]; then
  echo "FAIL: fuzz targets and Fuzz/corpus folders differ:" >&2
  diff <(.build/debug/keybagfs-fuzz list | sort) <(ls Fuzz/corpus | sort) >&2 || true
  exit 1
fi
# SwiftPM (6.3.1) hands its compile jobs only one of the two sanitizers, picked at random per
# run (seen on a fresh clone: half the builds had no coverage counters in Swift code), so both
# are also passed to swiftc; built afresh, and the counters are checked below.
rm -rf .build-fuzz
if ! swift build --product keybagfs-fuzz --sanitize=fuzzer --sanitize=address -Xswiftc -sanitize=fuzzer,address \
  -Xswiftc -DKBFS_FUZZ \
  --scratch-path .build-fuzz >/tmp/kbfs-fuzz-build.log 2>&1; then
  echo "FAIL: the libFuzzer build of keybagfs-fuzz failed:" >&2; grep -E "error" /tmp/kbfs-fuzz-build.log | head >&2
  exit 1
fi
bin=.build-fuzz/debug/keybagfs-fuzz
# The build must instrument KeybagCore, not only the harness (else the search is blind).
counters=$(KBFS_FUZZ_TARGET=names KBFS_FUZZ_DIR=Fuzz "$bin" -runs=0 Fuzz/corpus/names 2>&1 |
  grep -oE "\(([0-9]+) inline 8-bit counters\)" | grep -oE "[0-9]+" | head -1 || echo 0)
if [[ ${counters:-0} -lt 10000 ]]; then
  echo "FAIL: the libFuzzer build has ${counters:-0} coverage counters: KeybagCore is not instrumented" >&2
  exit 1
fi
work=$(mktemp -d /tmp/kbfs-fuzzrun.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p Fuzz/crashes
status=0
# Limits: a store file's largest accepted size is 1 MiB (the keybag) and a journal record's
# 4 MiB + 64 KiB; no input may make a target allocate more than 64 MiB at once or hold 1 GiB.
limits=(-rss_limit_mb=1024 -malloc_limit_mb=64 -max_len=65536 -timeout=10 -detect_leaks=1)
printf '%-16s %10s %6s %6s %7s %s\n' target execs cov ft rss_MB result
for t in "${targets[@]}"; do
  new=$work/new-$t
  mkdir -p "$new" "$work/tmp-$t"
  log=$work/$t.log
  rc=0
  KBFS_FUZZ_TARGET=$t KBFS_FUZZ_DIR=Fuzz TMPDIR=$work/tmp-$t ASAN_OPTIONS=detect_leaks=1 \
    "$bin" "$new" "Fuzz/corpus/$t" -max_total_time="$secs" "${limits[@]}" -print_final_stats=1 \
    -artifact_prefix="Fuzz/crashes/$t-" >"$log" 2>&1 || rc=$?
  done_line=$(grep -E "^#[0-9]+.*(DONE|pulse|NEW|REDUCE|INITED)" "$log" | tail -1 || true)
  execs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$log" | tail -1 | grep -oE "[0-9]+$" || echo "?")
  cov=$(grep -oE "cov: [0-9]+" <<<"$done_line" | grep -oE "[0-9]+" || echo "?")
  ft=$(grep -oE "ft: [0-9]+" <<<"$done_line" | grep -oE "[0-9]+" || echo "?")
  rss=$(grep -oE "stat::peak_rss_mb: *[0-9]+" "$log" | tail -1 | grep -oE "[0-9]+$" || echo "?")
  if [[ $rc -ne 0 ]]; then
    printf '%-16s %10s %6s %6s %7s %s\n' "$t" "$execs" "$cov" "$ft" "$rss" "FAIL (exit $rc)"
    grep -E "ERROR|SUMMARY|Fatal|fatal error|==[0-9]+==|Test unit written|^keybagfs-fuzz:" "$log" | head -20 >&2
    grep -A30 "ERROR: " "$log" | grep -E "^\s+#[0-9]+ " | head -25 >&2 || true
    status=1
  else
    printf '%-16s %10s %6s %6s %7s %s\n' "$t" "$execs" "$cov" "$ft" "$rss" ok
  fi
  if [[ $merge -eq 1 && $rc -eq 0 ]]; then
    KBFS_FUZZ_TARGET=$t KBFS_FUZZ_DIR=Fuzz TMPDIR=$work/tmp-$t "$bin" -merge=1 "Fuzz/corpus/$t" "$new" \
      "${limits[@]}" >/dev/null 2>&1 || true
  fi
done
# Every committed regression input still passes (a crash found once stays fixed).
[[ $status -eq 0 ]] && rmdir Fuzz/crashes 2>/dev/null || true
exit $status
