#!/usr/bin/env bash
# Runs every test: unit tests of the core, tests that mount for real, and (without
# arguments) the system test under a booted systemd container.
# Needs root and /dev/fuse; a missing prerequisite is a failure, never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
if [[ $(id -u) -ne 0 ]]; then echo "FAIL: the mount tests need root (/dev/fuse is root-only here)" >&2; exit 1; fi
if [[ ! -c /dev/fuse ]]; then echo "FAIL: /dev/fuse is missing; the mount tests cannot run" >&2; exit 1; fi
command -v fusermount3 >/dev/null || { echo "FAIL: fusermount3 missing" >&2; exit 1; }
start=$(date +%s)
# A run that was killed (a cut session, Ctrl-C) cannot tear down: its mounts under
# /tmp/kbfs-test.* would make keybagctl's discovery see two mounts in this run. Name and
# detach them first; mounts this run leaves are still a failure (below).
stale=$(awk '$2 ~ /^\/tmp\/kbfs-(test|bystander)\./ {print $2}' /proc/mounts | sort -r)
if [[ -n $stale ]]; then
  echo "# detaching $(wc -l <<<"$stale") mount(s) left by an earlier, killed test run:" >&2
  head -3 <<<"$stale" >&2
  for m in $stale; do fusermount3 -uz "$m" 2>/dev/null || umount -l "$m" || true; done
fi
swift build --build-tests
status=0
# A keybagfs mount this run did not make, standing for the user's own (install.sh --demo
# leaves one up): no test may depend on being the only one, or touch it. Checked at the end.
bystander=$(mktemp -d /tmp/kbfs-bystander.XXXXXX)
drop_bystander() { fusermount3 -u "$bystander/mnt" 2>/dev/null || umount -l "$bystander/mnt" 2>/dev/null || true; rm -rf "$bystander"; }
trap drop_bystander EXIT
mkdir "$bystander/mnt"
printf 'bystander passcode\n' | .build/debug/keybagfs init "$bystander/store" --passcode-stdin --device-key "$bystander/device.key" \
  --kdf interactive --no-recovery-key >/dev/null
.build/debug/keybagfs mount "$bystander/store" "$bystander/mnt" --device-key "$bystander/device.key"
printf 'bystander passcode\n' | .build/debug/keybagctl --mount "$bystander/mnt" unlock --passcode-stdin
echo "bystander" > "$bystander/mnt/file"
log=$(mktemp)
swift test --skip-build --disable-swift-testing "$@" 2>&1 | tee "$log" || status=$?
# One plain closing line: counts from XCTest's per-case lines.
passed=$(grep -cE "^Test Case .* passed \(" "$log" || true)
failed=$(grep -cE "^Test Case .* failed \(" "$log" || true)
# The failures again at the end (CI shows the tail): each failing case and its messages.
failures=$(grep -E "^Test Case .* failed \(|: error: " "$log" | head -40 || true)
rm -f "$log"
[[ $failed -eq 0 ]] || status=1
[[ $passed -gt 0 ]] || { echo "FAIL: no test ran" >&2; status=1; }
# Style: swift-format's lint with the committed .swift-format (swift format -i fixes it).
if ! swift format lint --strict -r Sources Tests Examples Fuzz/Targets >/tmp/kbfs-format.log 2>&1; then
  echo "FAIL: swift format lint (swift format -i -r Sources Tests Examples Fuzz/Targets fixes it):" >&2
  head -20 /tmp/kbfs-format.log >&2; status=1
fi
# Every parser of store and socket bytes under libFuzzer with ASan and LSan: its committed
# corpus and regression inputs, then new inputs for a short budget per target (about 2.5
# minutes in all); a crash, leak or allocation over the limits fails (scripts/fuzz.sh).
bash scripts/fuzz.sh 6 || { echo "FAIL: fuzzing (scripts/fuzz.sh) found a crash, a leak or an over-limit allocation" >&2; status=1; }
# The source tree's size limits (scripts/size-check.py): files and functions.
python3 scripts/size-check.py || status=1
# Every file, folder, type and member docs/ARCHITECTURE.md names exists, and the layering rules
# hold but for the debt scripts/architecture-debt.txt lists (scripts/architecture-check.py).
python3 scripts/architecture-check.py || status=1
# The FileProtection library's DocC catalog builds without warnings, and every public
# symbol has a doc comment.
if swift package generate-documentation --target FileProtection --warnings-as-errors >/tmp/kbfs-docc.log 2>&1 &&
   python3 scripts/doc-check.py; then :; else
  echo "FAIL: DocC for FileProtection:" >&2; grep -E "error|warning|FAIL" /tmp/kbfs-docc.log | head -20 >&2; status=1
fi
# The lock and I/O tests again with ThreadSanitizer (test process and daemon); any race
# report fails the run. The memory scan is skipped there: it cannot walk TSan's shadow.
tsan_logs=$(mktemp -d)
tsan_out=$(mktemp)
if swift build --build-tests --sanitize=thread --scratch-path .build-tsan >"$tsan_out" 2>&1 &&
   TSAN_OPTIONS="log_path=$tsan_logs/tsan" swift test --skip-build --sanitize=thread --scratch-path .build-tsan \
     --disable-swift-testing --filter 'LockHoldsTests|LockConcurrencyTests|ClassMatrixTests|FileKeyLifeTests' \
     --skip testNoClassA >>"$tsan_out" 2>&1; then
  tsan_passed=$(grep -cE "^Test Case .* passed \(" "$tsan_out" || true)
  echo "# ThreadSanitizer: $tsan_passed tests passed" >&2
else
  echo "FAIL: the ThreadSanitizer run failed:" >&2; grep -E "error|failed" "$tsan_out" | head -20 >&2; status=1
fi
races=$(cat "$tsan_logs"/tsan.* "$tsan_out" 2>/dev/null | grep -c "WARNING: ThreadSanitizer" || true)
if [[ $races -ne 0 ]]; then
  echo "FAIL: ThreadSanitizer reported $races races:" >&2
  cat "$tsan_logs"/tsan.* 2>/dev/null | grep -A12 "WARNING: ThreadSanitizer" | head -60 >&2
  status=1
fi
rm -rf "$tsan_logs" "$tsan_out"
# The bystander mount is still up, unlocked and whole.
if [[ $(cat "$bystander/mnt/file" 2>/dev/null) != bystander ]] ||
   ! .build/debug/keybagctl --mount "$bystander/mnt" status | grep -q unlocked; then
  echo "FAIL: the suite touched a keybagfs mount it did not make ($bystander/mnt)" >&2; status=1
fi
# No test may leave a mount behind.
left=$(grep ' fuse.keybagfs ' /proc/mounts | awk '{print $2}' | grep '/kbfs-test\.' || true)
if [[ -n $left ]]; then
  echo "FAIL: mounts left behind by tests:" >&2; echo "$left" >&2
  for m in $left; do fusermount3 -u "$m" || umount -l "$m" || true; done
  status=1
fi
# The TPM shim (Sources/CTPM) on its own, against two swtpm of its own: seal, unseal, the
# lockout, another TPM's blobs, the NV counter, an unreachable TPM. Only for the full run.
if [[ $# -eq 0 ]]; then
  if ! bash Tests/tpm-shim/run.sh 1 >/tmp/kbfs-tpm-shim.log 2>&1; then
    echo "FAIL: Tests/tpm-shim/run.sh:" >&2; tail -20 /tmp/kbfs-tpm-shim.log >&2; status=1
  else
    echo "# TPM shim: $(grep -c '^ok' /tmp/kbfs-tpm-shim.log || true) checks passed against swtpm" >&2
  fi
fi
# Power cuts with the real kernel (Tests/powercut): a QEMU guest with Debian's kernel runs the
# workloads on ext4 on dm-log-writes; every mark, flush and a sample of reordered and torn
# states are replayed and checked. Only for the full run (docs/TESTING.md has the long pass).
if [[ $# -eq 0 ]]; then
  if ! bash Tests/powercut/run.sh short >/tmp/kbfs-powercut.log 2>&1; then
    echo "FAIL: Tests/powercut/run.sh:" >&2; grep -E "^FAIL|^    |^#" /tmp/kbfs-powercut.log | head -30 >&2; status=1
  else
    grep "^# power cut" /tmp/kbfs-powercut.log >&2
  fi
fi
# keybagfs under a real systemd (a booted Debian 12 container): only for the full run.
if [[ $# -eq 0 ]]; then
  if ! bash scripts/system-test.sh; then echo "FAIL: scripts/system-test.sh" >&2; status=1; fi
else
  echo "# system test not run: arguments select XCTests only" >&2
fi
echo "# scripts/test.sh: $(( $(date +%s) - start )) s wall" >&2
[[ -z $failures ]] || { echo "# failing XCTests and their messages:" >&2; echo "$failures" >&2; }
echo "$passed passed, $failed failed"
exit $status
