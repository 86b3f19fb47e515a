#!/bin/bash
# Runs xfstests against keybagfs (docs/TESTING.md). Set up once with bootstrap.sh.
#
#   bash scripts/xfstests/run.sh generic/001 generic/013 ...
#   bash scripts/xfstests/run.sh -g quick [-x SOMEGROUP] [-E EXCLUDE_FILE] ...
#   KBFS_BIN=/path/to/.build/debug bash scripts/xfstests/run.sh generic/471
#
# Every argument goes to xfstests' ./check. Environment (all paths absolute):
#   KBFS_XFSTESTS_HOME  holds the xfstests checkout (xfstests/, made by bootstrap.sh) and, by
#                       default, state/ and results/ (default /var/tmp/kbfs-xfstests)
#   KBFS_BIN            folder with keybagfs and keybagctl (default: the repository's
#                       .build/release if it has keybagfs, else .build/debug). The binaries
#                       are used in place: do not rebuild them while a run goes on.
#   KBFS_STATE          images, stores, keys, mount points (default $KBFS_XFSTESTS_HOME/state)
#   KBFS_TEST_SIZE      size of the TEST_DEV ext4 image (default 4G, sparse)
#   KBFS_SCRATCH_SIZE   size of the SCRATCH_DEV ext4 image made by a plain _scratch_mkfs
#                       (default 2G; _scratch_mkfs_sized uses the size the test asks for)
#   KBFS_RESULTS        results folder (default $KBFS_XFSTESTS_HOME/results/<date>-<time>;
#                       $KBFS_XFSTESTS_HOME/results/latest points at the last one)
#   KBFS_NICE           nice level of the run (default 10)
#   KBFS_TEST_TIMEOUT   seconds one test may run before the watchdog kills its commands
#                       (default 300; 0 = no watchdog). A test that hangs (as generic/015 did
#                       before commits 0c135a3 and 829b64b: its dd never saw ENOSPC through the
#                       write-back cache) becomes a failure and the run goes on.
# It sets up fresh stores on fresh loop-mounted ext4 images (re-runnable: leftovers of an
# earlier run below KBFS_STATE are unmounted first), installs the mount helper
# /sbin/mount.fuse.keybagfs (an existing one is kept as /sbin/mount.fuse.keybagfs.pre-xfstests
# and put back afterwards), runs ./check, and unmounts everything it mounted. Exit status:
# that of ./check (0 = no failure).
set -u
HARNESS=$(cd "$(dirname "$0")" && pwd)   # scripts/xfstests: these scripts and local.config
REPO=$(cd "$HARNESS/../.." && pwd)
KBFS_XFSTESTS_HOME=${KBFS_XFSTESTS_HOME:-/var/tmp/kbfs-xfstests}
XFSTESTS=$KBFS_XFSTESTS_HOME/xfstests
if [[ -z ${KBFS_BIN:-} ]]; then
  if [[ -x $REPO/.build/release/keybagfs ]]; then KBFS_BIN=$REPO/.build/release; else KBFS_BIN=$REPO/.build/debug; fi
fi
export KBFS_HARNESS=$HARNESS
export KBFS_BIN
export KBFS_STATE=${KBFS_STATE:-$KBFS_XFSTESTS_HOME/state}
export KBFS_KEY=$KBFS_STATE/device.key
export KBFS_PASSFILE=$KBFS_STATE/passcode
export KBFS_SCRATCH_SIZE=${KBFS_SCRATCH_SIZE:-2G}
TEST_SIZE=${KBFS_TEST_SIZE:-4G}
RESULTS=${KBFS_RESULTS:-$KBFS_XFSTESTS_HOME/results/$(date +%Y%m%d-%H%M%S)}
HELPER=/sbin/mount.fuse.keybagfs
BACKUP=/sbin/mount.fuse.keybagfs.pre-xfstests
MARK="keybagfs-xfstests-helper"

die() { echo "run.sh: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root"
# The mount options, local.config and the results' links name these paths from elsewhere.
for v in KBFS_XFSTESTS_HOME KBFS_BIN KBFS_STATE RESULTS; do
  [[ ${!v} == /* ]] || die "$v=${!v} is not an absolute path"
done
[[ -c /dev/fuse ]] || die "/dev/fuse is missing"
for b in keybagfs keybagctl; do [[ -x $KBFS_BIN/$b ]] || die "$KBFS_BIN/$b is missing (swift build -c release, or set KBFS_BIN)"; done
[[ -x $XFSTESTS/check && -x $XFSTESTS/ltp/fsstress ]] || die "xfstests is not built in $XFSTESTS (bash $HARNESS/bootstrap.sh)"
python3 "$HARNESS/adapt-common-rc.py" --check "$XFSTESTS" || die "$XFSTESTS/common/rc is not adapted (bash $HARNESS/bootstrap.sh)"
command -v mount.fuse3 >/dev/null || die "fuse3 is not installed (apt-get install fuse3)"
case $KBFS_STATE in /|/tmp|/var|/var/tmp|/work|"") die "KBFS_STATE=$KBFS_STATE is too broad";; esac
export PATH=$KBFS_BIN:$PATH

# Users and group that xfstests' permission tests run commands as.
id fsgqa >/dev/null 2>&1 || useradd -m fsgqa
id 123456-fsgqa >/dev/null 2>&1 || useradd 123456-fsgqa
id fsgqa2 >/dev/null 2>&1 || useradd fsgqa2
getent group fsgqa >/dev/null || groupadd fsgqa

# All descendants of a process (children first found, deepest last).
descendants() {
  local p c
  for p in "$@"; do
    for c in $(ps -o pid= --ppid "$p" 2>/dev/null); do echo "$c"; descendants "$c"; done
  done
}

# Unmounts what this harness mounted below KBFS_STATE: keybagfs mounts first, then the
# ext4 images (deepest first). Mounts elsewhere are never touched.
teardown_mounts() {
  local t
  for t in $(findmnt -rn -t fuse.keybagfs -o TARGET | grep -F "$KBFS_STATE/" | sort -r); do
    "$HARNESS/kbfs-umount" "$(printf '%b' "$t")" || umount -l "$(printf '%b' "$t")"
  done
  for t in $(findmnt -rn -o TARGET | grep -F "$KBFS_STATE/" | sort -r); do
    t=$(printf '%b' "$t")
    umount "$t" 2>/dev/null || { sleep 1; umount "$t"; } || umount -l "$t"
  done
}

install_helper() {
  if [[ -e $HELPER || -L $HELPER ]] && ! grep -q "$MARK" "$HELPER" 2>/dev/null; then
    mv -f "$HELPER" "$BACKUP"
    echo "run.sh: kept the existing $HELPER as $BACKUP" >&2
  fi
  install -m 0755 "$HARNESS/mount.fuse.keybagfs" "$HELPER"
}

# shellcheck disable=SC2317  # only run through cleanup, the EXIT trap
restore_helper() {
  if grep -q "$MARK" "$HELPER" 2>/dev/null; then rm -f "$HELPER"; fi
  if [[ -e $BACKUP || -L $BACKUP ]] && [[ ! -e $HELPER && ! -L $HELPER ]]; then
    mv -f "$BACKUP" "$HELPER"
  fi
}

# shellcheck disable=SC2317  # the EXIT trap
cleanup() {
  teardown_mounts
  restore_helper
}

# Ctrl-C / kill: stop ./check and the test it runs (background jobs ignore SIGINT), then the
# EXIT trap unmounts and restores the helper.
# shellcheck disable=SC2317,SC2046  # (run from the trap; $(descendants) is a list of pids)
interrupted() {
  trap - INT TERM
  echo "run.sh: interrupted; stopping ./check" >&2
  [[ -n ${check:-} ]] && kill -KILL $(descendants "$check") "$check" 2>/dev/null
  [[ -n ${wd:-} ]] && kill "$wd" 2>/dev/null
  sleep 1
  exit 130
}
teardown_mounts
if findmnt -rn -o TARGET | grep -qF "$KBFS_STATE/"; then die "cannot unmount what an earlier run left below $KBFS_STATE"; fi
trap cleanup EXIT
trap interrupted INT TERM
install_helper

# Fresh state: device key, passcode, mount points, and the two stores on their images.
mkdir -p "$KBFS_STATE" "$KBFS_STATE/test" "$KBFS_STATE/scratch"
chmod 0755 "$KBFS_STATE"   # tests run commands as fsgqa inside the mounts below it
rm -rf "$KBFS_STATE/images" "$KBFS_STATE/test-backing" "$KBFS_STATE/scratch-backing"
head -c 32 /dev/urandom > "$KBFS_KEY"; chmod 0600 "$KBFS_KEY"
echo "xfstests-$(od -An -tx1 -N8 /dev/urandom | tr -d ' \n')" > "$KBFS_PASSFILE"; chmod 0600 "$KBFS_PASSFILE"
"$HARNESS/kbfs-mkfs" -s "$TEST_SIZE" "$KBFS_STATE/test-backing/store" || die "cannot make the test store"
"$HARNESS/kbfs-mkfs" -s "$KBFS_SCRATCH_SIZE" "$KBFS_STATE/scratch-backing/store" || die "cannot make the scratch store"

mkdir -p "$RESULTS" "$KBFS_XFSTESTS_HOME/results"
ln -sfn "$RESULTS" "$KBFS_XFSTESTS_HOME/results/latest"
{
  echo "keybagfs binaries: $KBFS_BIN ($(stat -c '%y' "$KBFS_BIN/keybagfs"), sha256 $(sha256sum < "$KBFS_BIN/keybagfs" | cut -c1-16))"
  echo "xfstests: $(git -C "$XFSTESTS" log -1 --format='%h %s') + common/rc adapted by adapt-common-rc.py"
  echo "scripts: $HARNESS (repository at $(git -C "$REPO" log -1 --format=%h 2>/dev/null))"
  echo "kernel: $(uname -r)  started: $(date -u +%FT%TZ)  args: $*"
} | tee "$RESULTS/run-info.txt"

# Kills the commands of a test that runs longer than KBFS_TEST_TIMEOUT: first everything the
# test script started (so the script goes on and its output shows what hung), 30 s later the
# script itself. The keybagfs daemons are not among them (they detach to init).
watchdog() {
  local check=$1 limit=$2 p args age name killed=""
  while kill -0 "$check" 2>/dev/null; do
    sleep 5
    for p in $(descendants "$check" | sort -un); do
      args=$(ps -o args= -p "$p" 2>/dev/null) || continue
      [[ $args =~ ^(/bin/)?bash\ (.*/)?tests/([a-z0-9_-]+/[0-9]+)$ ]] || continue
      name=${BASH_REMATCH[3]}
      # the test script itself, not one of its subshells
      [[ $(ps -o args= -p "$(ps -o ppid= -p "$p" | tr -d ' ')" 2>/dev/null) == "$args" ]] && continue
      age=$(ps -o etimes= -p "$p" 2>/dev/null | tr -d ' ')
      [[ -n $age ]] || continue
      if ((age > limit)) && [[ " $killed " != *" $p "* ]]; then
        killed="$killed $p"
        echo "run.sh watchdog: $name (pid $p) ran ${age}s (limit ${limit}s): killing the commands it started" |
          tee -a "$RESULTS/watchdog.log" "$RESULTS/$name.full" >&2
        ps -o pid=,args= -p "$(descendants "$p" | paste -sd, -)" >> "$RESULTS/watchdog.log" 2>/dev/null
        # shellcheck disable=SC2046  # a list of pids
        kill -KILL $(descendants "$p") 2>/dev/null
      elif ((age > limit + 30)); then
        echo "run.sh watchdog: $name (pid $p) still running after ${age}s: killing the test script" |
          tee -a "$RESULTS/watchdog.log" "$RESULTS/$name.full" >&2
        # shellcheck disable=SC2046  # a list of pids
        kill -KILL $(descendants "$p") "$p" 2>/dev/null
      fi
    done
  done
}

# summary.txt: one line per test, and the first lines of each failure's diff.
summarise() {
  local out=$RESULTS/summary.txt f t
  {
    echo "== results ($(sed -n 's/^run.sh: //p' "$RESULTS/run-info.txt" | tail -n 1))"
    grep -E '^[a-z0-9_-]+/[0-9]+ ' "$RESULTS/check.out" | sed 's/ *- output mismatch (see [^)]*)/ FAIL (output mismatch)/'
    grep -E '^(Ran|Not run|Failures|Failed|Passed)' "$RESULTS/check.out"
    for f in "$RESULTS"/*/*.out.bad; do
      [[ -e $f ]] || continue
      t=${f#"$RESULTS"/}; t=${t%.out.bad}
      echo; echo "== $t: first lines of the diff"
      diff -u "$XFSTESTS/tests/$t.out" "$f" | sed -n '3,16p' | cut -c1-200
    done
    [[ -s $RESULTS/watchdog.log ]] && { echo; echo "== watchdog"; grep '^run.sh' "$RESULTS/watchdog.log"; }
  } > "$out"
  echo "run.sh: summary in $out"
}

cd "$XFSTESTS" || exit 1
export HOST_OPTIONS=$HARNESS/local.config RESULT_BASE=$RESULTS
start=$(date +%s)
( nice -n "${KBFS_NICE:-10}" ./check "$@" 2>&1 | tee "$RESULTS/check.out"; exit "${PIPESTATUS[0]}" ) &
check=$!
timeout=${KBFS_TEST_TIMEOUT:-300}
if ((timeout > 0)); then watchdog "$check" "$timeout" & wd=$!; fi
wait "$check"
rc=$?
[[ -n ${wd:-} ]] && { kill "$wd" 2>/dev/null; wait "$wd" 2>/dev/null; }
echo "run.sh: ./check exited $rc after $(( $(date +%s) - start )) s; results in $RESULTS" | tee -a "$RESULTS/run-info.txt"
summarise
exit $rc
