#!/usr/bin/env bash
# The power-cut harness with the real kernel (issue "Nothing lost on a power cut"), after
# xfstests' generic/455 and 482: a QEMU guest (TCG) with Debian's kernel puts the store on ext4
# on dm-log-writes and runs Tests/powercut/workload.py, which marks the log after every operation
# it was told is durable; then replay.py rebuilds the disk at every mark, every flush and FUA,
# and at reordered and torn states inside the last window before each flush (CrashMonkey's
# states), and checks each: e2fsck clean, the store mounts and unlocks, every durable fact
# reads back, fsck reports only what FORMAT.md allows.
#   bash Tests/powercut/run.sh            short pass (the test command; a few minutes)
#   bash Tests/powercut/run.sh long       every flush window, more reorderings (docs/TESTING.md)
# Needs root, loop devices, qemu-system-x86, linux-image-amd64, busybox-static, dmsetup and
# e2fsprogs (scripts/install-deps.sh), and the debug binaries (KBIN=DIR for others).
# Exit 0 when every state passes; the folder it worked in is kept on failure (KEEP=1: always).
set -euo pipefail
cd "$(dirname "$0")/../.."
pass=${1:-short}
KBIN=${KBIN:-$PWD/.build/debug}
for b in keybagfs keybagctl; do [[ -x $KBIN/$b ]] || { echo "FAIL: $KBIN/$b missing (swift build)" >&2; exit 1; }; done
for t in qemu-system-x86_64 busybox dmsetup mkfs.ext4 e2fsck losetup cpio; do
  command -v "$t" >/dev/null || [[ -x /bin/$t || -x /sbin/$t ]] || { echo "FAIL: $t missing (scripts/install-deps.sh)" >&2; exit 1; }
done
kver=$(find /lib/modules -maxdepth 1 -mindepth 1 -name '*-amd64' -printf '%f\n' | sort -V | tail -1)
kernel=/boot/vmlinuz-$kver
[[ -n $kver && -r $kernel ]] || { echo "FAIL: Debian's kernel (linux-image-amd64) is not installed" >&2; exit 1; }
W=$(mktemp -d /var/tmp/kbfs-powercut.XXXXXX)
status=1
finish() {
  if [[ $status -eq 0 && -z ${KEEP:-} ]]; then rm -rf "$W"; else echo "# power-cut run folder kept: $W" >&2; fi
}
trap finish EXIT

# The initramfs: busybox, the modules the guest needs (with their dependencies, in order), /init.
mods=(virtio_pci virtio_blk 9pnet_virtio 9p crc32c_generic ext4 dm-mod dm-log-writes dm-flakey fuse)
mkdir -p "$W/initrd/bin" "$W/initrd/modules" "$W/initrd/proc" "$W/initrd/sys" "$W/initrd/dev"
cp /bin/busybox "$W/initrd/bin/busybox"
python3 - "$kver" "$W/initrd" "${mods[@]}" <<'PY'
import os, shutil, sys
kver, out, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
base = f"/lib/modules/{kver}/"
deps = {}
for line in open(base + "modules.dep"):
    mod, _, rest = line.partition(":")
    deps[os.path.basename(mod)[:-3].replace("-", "_")] = (mod, rest.split())
order = []
def add(name):
    mod, ds = deps[name]
    for d in ds:
        add(os.path.basename(d)[:-3].replace("-", "_"))
    if mod not in order:
        order.append(mod)
for w in wanted:
    add(w.replace("-", "_"))
with open(out + "/modules.order", "w") as f:
    for mod in order:
        shutil.copy(base + mod, out + "/modules/")
        f.write(os.path.basename(mod) + "\n")
PY
cp Tests/powercut/guest-init.sh "$W/initrd/init"
chmod +x "$W/initrd/init"
(cd "$W/initrd" && find . | cpio -o -H newc --quiet | gzip -1) >"$W/initrd.gz"

# The run folder the guest writes its journal into, and the two disks.
mkdir -p "$W/run"
cp Tests/powercut/guest-workload.sh Tests/powercut/workload.py "$W/run/"
# The guest mounts tmpfs over /tmp, /run, /var/tmp and /mnt of the host's root: binaries from a
# clone under one of them would be out of its reach, so it runs copies in the run folder.
mkdir -p "$W/run/bin"
for b in keybagfs keybagctl; do cp -l "$KBIN/$b" "$W/run/bin/" 2>/dev/null || cp "$KBIN/$b" "$W/run/bin/"; done
echo "KBIN=/tmp/run-dir/bin" >"$W/run/config.sh"
truncate -s 1G "$W/log.img"
truncate -s 96M "$W/data.img"
echo "# power-cut guest: Debian $kver under TCG, workload running" >&2
start=$(date +%s)
timeout 1200 qemu-system-x86_64 -accel tcg,thread=multi -m 1536 -smp 2 -kernel "$kernel" -initrd "$W/initrd.gz" \
  -append "console=ttyS0 panic=-1 quiet" -nographic -no-reboot -nic none \
  -drive "file=$W/log.img,if=virtio,format=raw,cache=unsafe" -drive "file=$W/data.img,if=virtio,format=raw,cache=unsafe" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs "local,path=$W/run,mount_tag=rundir,security_model=none" >"$W/console.log" 2>&1 || true
echo "# guest done in $(( $(date +%s) - start )) s" >&2
if ! grep -q "workload exit 0" "$W/run/guest.log" 2>/dev/null; then
  echo "FAIL: the guest workload did not finish:" >&2
  tail -20 "$W/run/guest.log" "$W/console.log" >&2 2>/dev/null || true
  exit 1
fi
python3 Tests/powercut/replay.py --pass "$pass" --log "$W/log.img" --size "$(stat -c %s "$W/data.img")" \
  --journal "$W/run/journal" --work "$W" --kbin "$KBIN" --device-key "$W/run/dk" --final "$W/data.img"
status=$?
exit $status
