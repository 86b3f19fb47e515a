#!/bin/bash
# Runs in the power-cut guest, chrooted into the host's root (Tests/powercut/guest-init.sh):
# the store on ext4 on dm-log-writes over the guest's two disks (/dev/vda the log, /dev/vdb the
# data), keybagfs mounted on it, and the workload (workload.py), which writes a mark into the
# log after each operation it was told is durable and records what it was told in the run
# folder's journal (off the disk under test). The log is closed before the guest powers off.
set -u
. /tmp/run-dir/config.sh
export DM_DISABLE_UDEV=1 STATE_DIRECTORY=/tmp/state PATH=/usr/sbin:/usr/bin:/sbin:/bin
say() { echo "guest: $*"; }
mkdir -p /tmp/state /mnt/disk /mnt/kb
sectors=$(blockdev --getsz /dev/vdb) || { say "no data disk"; exit 1; }
dmsetup create lw --table "0 $sectors log-writes /dev/vdb /dev/vda" || { say "dmsetup create failed"; exit 1; }
dmsetup mknodes lw 2>/dev/null
mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 /dev/mapper/lw || { say "mkfs failed"; exit 1; }
dmsetup message lw 0 mark mkfs
mount -t ext4 /dev/mapper/lw /mnt/disk || { say "mount failed"; exit 1; }
/usr/bin/python3 /tmp/run-dir/workload.py "$KBIN" /mnt/disk /mnt/kb /tmp/run-dir
rc=$?
say "workload exit $rc"
fusermount3 -u /mnt/kb 2>/dev/null
umount /mnt/disk || say "umount failed"
dmsetup remove lw || say "dmsetup remove failed"
sync
exit $rc
