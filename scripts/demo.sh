#!/usr/bin/env bash
# Brings up a demo mount on a fresh Debian 12 machine: installs the system packages,
# builds release binaries, creates a store (asks for a passcode on the terminal) and
# mounts it. Run as root.   DEMO_DIR (default /srv/keybagfs-demo) holds store and mount.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
swift build -c release
BIN=$(swift build -c release --show-bin-path)
DEMO_DIR=${DEMO_DIR:-/srv/keybagfs-demo}
STORE=$DEMO_DIR/store MNT=$DEMO_DIR/mnt
mkdir -p "$MNT"
if [[ ! -f $STORE/keybag ]]; then
  echo "Creating the demo store $STORE; choose a passcode:"
  "$BIN/keybagfs" init "$STORE" --kdf interactive
fi
if ! mountpoint -q "$MNT"; then "$BIN/keybagfs" mount "$STORE" "$MNT" --grace 5; fi
cat <<TXT

keybagfs is mounted on $MNT (state: beforeFirstUnlock).
  $BIN/keybagctl status                  # state and open files
  $BIN/keybagctl unlock                  # asks for the passcode
  echo hi > $MNT/note.txt; setfattr -n user.protection -v complete $MNT/note.txt
  $BIN/keybagctl lock --grace 0          # now: cat $MNT/note.txt -> Permission denied
  $BIN/keybagctl watch                   # events, until Ctrl-C
  fusermount3 -u $MNT                    # unmount; the daemon exits
TXT
