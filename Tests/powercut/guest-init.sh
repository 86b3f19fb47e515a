#!/bin/busybox sh
# /init of the power-cut guest (Tests/powercut/run.sh builds the initramfs): loads the modules
# it carries, mounts the host's root read-only and the run's folder read-write over virtfs,
# and runs the workload (the run folder's guest-workload.sh) chrooted into the host's root,
# so the guest uses the host's own binaries and libraries. Powers off when the workload ends.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do
  grep -q "^$(basename "$m" .ko | tr - _) " /proc/modules || insmod "/modules/$m" || echo "powercut-guest: insmod $m failed"
done
mkdir -p /host /run-dir
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose hostroot /host || echo "powercut-guest: no host root"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 rundir /run-dir || echo "powercut-guest: no run folder"
for d in proc sys dev; do mount --bind /$d /host/$d; done
mount -t tmpfs tmpfs /host/tmp
mount -t tmpfs tmpfs /host/run
mount -t tmpfs tmpfs /host/var/tmp
mkdir -p /host/tmp/run-dir
mount --bind /run-dir /host/tmp/run-dir
mount -t tmpfs tmpfs /host/mnt
cat /proc/modules > /run-dir/modules.txt
chroot /host /bin/bash /tmp/run-dir/guest-workload.sh > /run-dir/guest.log 2>&1
echo "powercut-guest: workload exit $?" >> /run-dir/guest.log
dmesg > /run-dir/dmesg.txt
sync
poweroff -f
