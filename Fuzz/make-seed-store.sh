#!/usr/bin/env bash
# Makes Fuzz/seed-store (and Fuzz/seed.key): a small store written by the real daemon, the
# source of the fuzz targets' seed inputs and the keys their harness opens them with.
# Run once by hand after a format change (`bash Fuzz/make-seed-store.sh`), then commit; the
# store's passcode is below (a test fixture, it protects nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
swift build --product keybagfs >/dev/null
swift build --product keybagctl >/dev/null
bin=.build/debug
work=$(mktemp -d /tmp/kbfs-seed.XXXXXX)
mnt=$work/mnt
mkdir "$mnt"
cleanup() { fusermount3 -u "$mnt" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
rm -rf Fuzz/seed-store Fuzz/seed.key
printf 'fuzz seed passcode\n' | $bin/keybagfs init "$work/store" --passcode-stdin --device-key "$work/seed.key" \
  --kdf interactive --recovery-key-file "$work/recovery" >/dev/null
# Two more devices, the second removed again: device keybags, certificates, a key-set record
# and a removal record in STORE/devices.
for d in 2 3; do
  printf 'device %s passcode\n' "$d" | $bin/keybagfs device add "$work/store" --device-key "$work/dev$d.key" \
    --recovery-key-file "$work/recovery" --stdin --kdf interactive --tpm2 off --name "seed-$d" >/dev/null
done
id3=$($bin/keybagfs device id "$work/store" --device-key "$work/dev3.key")
printf 'fuzz seed passcode\n' | $bin/keybagfs device remove "$work/store" --device-key "$work/seed.key" "$id3" \
  --recovery-key-file "$work/recovery" --stdin >/dev/null
$bin/keybagfs mount "$work/store" "$mnt" --device-key "$work/seed.key"
printf 'fuzz seed passcode\n' | $bin/keybagctl --mount "$mnt" unlock --passcode-stdin
# Files of every class (class none and C open with the device key and passcode), sizes around
# the block edges, a folder with a default class, a long name, a long symlink target, xattrs.
mkdir "$mnt/docs"
setfattr -n user.protection -v none "$mnt/docs"
printf 'a' >"$mnt/docs/one-byte"
head -c 4096 /dev/urandom >"$mnt/docs/one-block"
head -c 10000 /dev/urandom >"$mnt/docs/partial-end"
: >"$mnt/docs/empty"
printf 'default class\n' >"$mnt/c-file"
printf 'complete\n' >"$mnt/a-file"
setfattr -n user.protection -v complete "$mnt/a-file"
long=$(printf 'n%.0s' $(seq 1 200))
printf 'long name\n' >"$mnt/docs/$long"
ln -s "$(printf 't%.0s' $(seq 1 3000))" "$mnt/docs/long-target"
ln -s short "$mnt/docs/short-target"
setfattr -n user.note -v "a note" "$mnt/docs/one-byte"
setfattr -n user.other -v "$(head -c 300 /dev/urandom | base64 -w0)" "$mnt/docs"
$bin/keybagctl --mount "$mnt" status --json >"$work/status.json" 2>/dev/null || $bin/keybagctl --mount "$mnt" status >"$work/status.json"
# An overwrite goes through the journal.
printf 'Z' | dd of="$mnt/docs/one-block" bs=1 seek=100 conv=notrunc status=none
sync -f "$mnt/docs/one-block"
fusermount3 -u "$mnt"
# The journal (a 16 MiB ring, empty after the unmount) stays out: the journal target builds its own.
rm -f "$work"/store/.kbfs-journal-*
cp -a "$work/store" Fuzz/seed-store
cp "$work/seed.key" Fuzz/seed.key
# Inputs only the daemon's peers see (not in the store): a recovery key and a status reply.
mkdir -p Fuzz/seed-extra
cp "$work/recovery" Fuzz/seed-extra/recovery-key
cp "$work/status.json" Fuzz/seed-extra/status.json
python3 Fuzz/make-corpus.py
echo "Fuzz/seed-store made: $(find Fuzz/seed-store -type f | wc -l) files"
