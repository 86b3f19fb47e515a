#!/usr/bin/env bash
# keybagfs as a system component under a real systemd: boots a minimal Debian 12
# (debootstrap, cached outside the checkout) with `systemd-nspawn -b`, installs keybagfs
# with scripts/install.sh, and checks the units, the logind follower (session Lock,
# suspend with a delay inhibitor, forged signals), fstab mounts, PAM unlock and the
# hardening scores. Fails, never skips, when it cannot boot. Run as root.
#   KEYBAGFS_SYSTEST_CACHE (default /var/cache/keybagfs-systest) holds the root file system.
#   KEYBAGFS_SYSTEST_ROUNDS (default 50) lock/suspend rounds timed.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
cache=${KEYBAGFS_SYSTEST_CACHE:-/var/cache/keybagfs-systest}
rounds=${KEYBAGFS_SYSTEST_ROUNDS:-50}
rootfs=$cache/rootfs
packages=systemd,systemd-sysv,dbus,libpam-systemd,fuse3,libfuse3-3,libsodium23,libsystemd0,pamtester,attr,python3,procps,util-linux,login,passwd,libtss2-esys-3.0.2-0,libtss2-mu0,libtss2-rc0,libtss2-sys1,libtss2-tctildr0,libtss2-tcti-device0,libtss2-tcti-swtpm0
leader=""
swtpm_pid=""
fail() {
  echo "FAIL: $*" >&2
  if [[ -n $leader ]]; then
    echo "--- journal of the keybagfs units in the container:" >&2
    nsenter -t "$leader" -a -- journalctl -q --no-pager -n 40 -u 'keybagfs*' >&2 || true
  fi
  exit 1
}
[[ $(id -u) -eq 0 ]] || fail "the system test needs root"
bash scripts/install-deps.sh
command -v systemd-nspawn >/dev/null || fail "systemd-nspawn is missing (package systemd-container)"
command -v debootstrap >/dev/null || fail "debootstrap is missing"
[[ -c /dev/fuse ]] || fail "/dev/fuse is missing"

# 1. The root file system, once (1-2 minutes), reused while its package list is the same.
stamp="$rootfs/.keybagfs-packages"
if [[ ! -f $stamp || $(cat "$stamp") != "$packages" ]]; then
  rm -rf "$rootfs.new"
  mkdir -p "$cache"
  debootstrap --variant=minbase --include="$packages" bookworm "$rootfs.new" http://deb.debian.org/debian >"$cache/debootstrap.log" 2>&1 ||
    fail "debootstrap failed (see $cache/debootstrap.log)"
  echo "c! /dev/fuse 0666 root root - 10:229" >"$rootfs.new/etc/tmpfiles.d/fuse.conf"
  echo "$packages" >"$rootfs.new/.keybagfs-packages"
  rm -rf "$rootfs"; mv "$rootfs.new" "$rootfs"
fi

# 2. Release binaries and an install staged with DESTDIR (man pages need the package).
stage=$(mktemp -d /tmp/kbfs-systest.XXXXXX)
nspawn_pid=""
cleanup() {
  if [[ $? -ne 0 && -n ${KEYBAGFS_SYSTEST_KEEP:-} && -n $leader ]]; then
    echo "kept for debugging: nsenter -t $leader -a  (stop: kill $nspawn_pid; rm -rf $stage)" >&2; return
  fi
  [[ -z $swtpm_pid ]] || kill "$swtpm_pid" 2>/dev/null || true
  if [[ -n $nspawn_pid ]] && kill -0 "$nspawn_pid" 2>/dev/null; then
    kill -TERM "$nspawn_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$nspawn_pid" 2>/dev/null || true
  fi
  rm -rf "$stage"
}
trap cleanup EXIT
DESTDIR=$stage/root bash scripts/install.sh >"$stage.install.log" 2>&1 || { tail -20 "$stage.install.log" >&2; fail "install.sh (DESTDIR) failed"; }
if ldd "$stage/root/usr/local/bin/keybagfs" | grep -q libswift; then fail "the installed keybagfs needs the Swift runtime"; fi
# The Debian package from the same binaries and man pages (installed in step 13).
KEYBAGFS_BIN=$stage/root/usr/local/bin KEYBAGFS_MAN=$stage/root/usr/local/share/man/man1 \
  bash scripts/build-deb.sh "$stage/deb" >"$stage.deb.log" 2>&1 || { tail -20 "$stage.deb.log" >&2; fail "build-deb.sh failed"; }
lintian --tag-display-limit 0 "$stage"/deb/keybagfs_*.deb >"$stage.lintian.log" 2>&1 || true
if grep -q "^E: " "$stage.lintian.log"; then grep "^E: " "$stage.lintian.log" >&2; fail "lintian reports errors in the package"; fi

# A TPM 2.0 for the container (step 11b): Debian's swtpm on the host, reached through a Unix
# socket in a folder bound into the container (the unit allows only AF_UNIX sockets).
mkdir -p "$stage/tpm"
swtpm socket --tpm2 --tpmstate dir="$stage/tpm" --server type=unixio,path="$stage/tpm/tpm.sock" \
  --ctrl type=unixio,path="$stage/tpm/tpm.sock.ctrl" --flags startup-clear >"$stage.swtpm.log" 2>&1 &
swtpm_pid=$!
host_tpm() { TPM2TOOLS_TCTI="swtpm:path=$stage/tpm/tpm.sock" TSS2_LOG=all+NONE "$@"; }
for _ in $(seq 50); do [[ -S $stage/tpm/tpm.sock ]] && break; sleep 0.1; done
host_tpm tpm2_dictionarylockout -c >/dev/null && host_tpm tpm2_dictionarylockout -s -n 5 -t 600 -l 600 >/dev/null ||
  fail "swtpm did not come up (see $stage.swtpm.log)"

# 3. Boot (the overlay keeps the cached root file system clean).
machine=kbfs$$
systemd-nspawn -D "$rootfs" --volatile=overlay -b --register=no --keep-unit --console=passive -M "$machine" \
  --bind-ro="$stage:/stage" --bind-ro="$repo:/src" --bind=/dev/fuse --bind="$stage/tpm:/run/kbfs-swtpm" >"$stage.log" 2>&1 &
nspawn_pid=$!
for _ in $(seq 100); do
  leader=$(pgrep -P "$nspawn_pid" -x systemd || true)
  [[ -n $leader ]] && break
  kill -0 "$nspawn_pid" 2>/dev/null || break
  sleep 0.1
done
[[ -n $leader ]] || { cat "$stage.log" >&2; fail "the container did not boot"; }
inside() { nsenter -t "$leader" -a -- /usr/bin/env PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
state=""
for _ in $(seq 300); do
  state=$(inside systemctl is-system-running 2>/dev/null || true)
  [[ $state == running || $state == degraded ]] && break
  sleep 0.1
done
[[ $state == running || $state == degraded ]] || fail "systemd in the container is '$state'"
echo "# booted Debian 12 with systemd $(inside systemctl --version | head -1 | awk '{print $2}') (state $state)"
ok() { echo "ok - $*"; }

# 4. Install from the README's command (binaries prebuilt), with the demo.
inside bash -c "KEYBAGFS_BIN=/stage/root/usr/local/bin KEYBAGFS_MAN=/stage/root/usr/local/share/man/man1 bash /src/scripts/install.sh --demo <<<'demo passcode'" >/dev/null ||
  fail "install.sh --demo failed"
inside bash -c 'command -v keybagctl && ls /usr/local/share/man/man1/keybagctl.1 /usr/local/share/bash-completion/completions/keybagctl' >/dev/null ||
  fail "keybagctl, its man page or completion missing after install"
demo=srv-keybagfs-demo
inside systemctl is-active -q "keybagfs@$demo.service" || fail "keybagfs@$demo is not active"
inside mountpoint -q /srv/keybagfs/demo || fail "the demo mount is not live after systemctl start returned"
inside systemctl is-active -q "keybagfs-follow@$demo.service" || fail "the follower is not active"
status_text=$(inside systemctl show -p StatusText --value "keybagfs@$demo.service")
[[ $status_text == "mounted, beforeFirstUnlock" ]] || fail "STATUS= was '$status_text'"
inside bash -c "test ! -e /var/lib/keybagfs/$demo.key && test -s /var/lib/keybagfs/$demo.cred" || fail "the demo's device key is not (only) stored encrypted"
inside systemctl cat "keybagfs@$demo.service" | grep -q "^LoadCredentialEncrypted=device-key:/var/lib/keybagfs/$demo.cred" || fail "the unit does not load the encrypted device key"
ok "install.sh --demo: binaries, man pages, completions; device key only as a systemd-creds credential; keybagfs@ active with the mount live; STATUS=$status_text; follower active"

# 5. systemctl start returns only after the mount is live (Type=notify), every time.
for i in 1 2 3; do
  inside systemctl restart "keybagfs@$demo.service"
  inside mountpoint -q /srv/keybagfs/demo || fail "restart $i returned before the mount was live"
done
inside systemctl restart "keybagfs-follow@$demo.service" || fail "the follower did not restart"
ok "systemctl (re)start returned with the mount live, 3 of 3"

# 6. Unit files: systemd-analyze verify and the exposure score of each unit.
inside systemd-analyze verify "/etc/systemd/system/keybagfs@.service" "/etc/systemd/system/keybagfs-follow@.service" 2>&1 |
  grep -v "^$" | grep -v "Command 'man " >"$stage/verify.txt" || true   # no man(1) in the minimal root
[[ ! -s $stage/verify.txt ]] || { cat "$stage/verify.txt" >&2; fail "systemd-analyze verify complained"; }
score_mount=$(inside systemd-analyze security --no-pager "keybagfs@$demo.service" | awk '/Overall exposure level/ {print $(NF-2), $(NF-1)}')
score_follow=$(inside systemd-analyze security --no-pager "keybagfs-follow@$demo.service" | awk '/Overall exposure level/ {print $(NF-2), $(NF-1)}')
ok "systemd-analyze verify clean; exposure: keybagfs@ $score_mount, keybagfs-follow@ $score_follow"

# Helpers inside: status, unlock, and a poller that times a command until `locked`.
unlock() { inside bash -c "keybagctl --mount /srv/keybagfs/demo unlock --passcode-stdin <<<'demo passcode'" || fail "unlock failed"; }
state() { inside keybagctl --mount /srv/keybagfs/demo status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])'; }
inside bash -c 'cat > /usr/local/bin/time-to-locked <<"PY"
#!/usr/bin/python3
"""Runs argv, then polls the control socket until the state is locked; prints milliseconds."""
import json, socket, subprocess, sys, time
sock = "/run/keybagfs/srv-keybagfs-demo.sock"
def state():
    s = socket.socket(socket.AF_UNIX); s.connect(sock); s.sendall(b"{\"op\":\"status\"}\n")
    r = json.loads(s.makefile().readline()); s.close(); return r["state"]
t0 = time.monotonic()
subprocess.run(sys.argv[1:], check=True)
while state() != "locked":
    if time.monotonic() - t0 > 10: print("timeout"); sys.exit(1)
    time.sleep(0.001)
print("%.1f" % ((time.monotonic() - t0) * 1000))
PY
chmod +x /usr/local/bin/time-to-locked'
median_max() { sort -n | awk '{a[NR]=$1} END {m=(NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2; printf "median %.1f ms, max %.1f ms (n=%d)", m, a[NR], NR}'; }

# 7. A session's Lock signal locks the mount (grace 0 for the follower).
inside bash -c 'echo "FOLLOW_OPTIONS=--grace 0" >> /etc/keybagfs/srv-keybagfs-demo.conf'
inside systemctl restart "keybagfs-follow@$demo.service" || fail "the follower did not restart"
inside useradd -m -s /bin/bash alice
inside bash -c 'echo alice:alice-login-pw | chpasswd'
inside bash -c 'setsid runuser -l alice -c "sleep 100000" </dev/null >/dev/null 2>&1 &'
session=""
for _ in $(seq 50); do
  session=$(inside loginctl list-sessions --no-legend | awk '$3 == "alice" {print $1; exit}')
  [[ -n $session ]] && break; sleep 0.1
done
[[ -n $session ]] || fail "no logind session for alice"
sleep 1   # the follower reconnects after its restart
: >"$stage/lock-ms"
for i in $(seq "$rounds"); do
  unlock
  ms=$(inside time-to-locked loginctl lock-session "$session") || fail "loginctl lock-session $session did not lock the mount (round $i)"
  echo "$ms" >>"$stage/lock-ms"
done
lock_stats=$(median_max <"$stage/lock-ms")
ok "loginctl lock-session -> locked: $lock_stats"

# 8. Suspend: logind sends PrepareForSleep and waits for the follower's delay inhibitor;
# the follower releases it only after `locked`. /sys/power/state is a file here (this
# kernel has no suspend), so systemd-sleep "suspends" at once. The eviction is slowed by
# 1.5 s in one round to show that sleep waits for it.
inside bash -c 'printf "freeze mem\n" > /run/fake-power-state && mount --bind /run/fake-power-state /sys/power/state'
inside bash -c 'mkdir -p /etc/systemd/logind.conf.d && printf "[Login]\nInhibitDelayMaxSec=20\n" > /etc/systemd/logind.conf.d/keybagfs-test.conf && systemctl restart systemd-logind'
sleep 1
inside systemctl restart "keybagfs-follow@$demo.service" || fail "the follower did not restart"
sleep 1
: >"$stage/sleep-ms"
for i in $(seq "$rounds"); do
  unlock
  ms=$(inside time-to-locked systemctl suspend) || fail "systemctl suspend did not lock the mount (round $i)"
  echo "$ms" >>"$stage/sleep-ms"
  for _ in $(seq 100); do inside systemctl is-active -q systemd-suspend.service || break; sleep 0.05; done
done
sleep_stats=$(median_max <"$stage/sleep-ms")
inside bash -c 'mkdir -p /etc/systemd/system/keybagfs@.service.d && printf "[Service]\nEnvironment=KEYBAGFS_TEST_FAILPOINTS=eviction-before-locked=sleep:1500\n" > /etc/systemd/system/keybagfs@.service.d/slow.conf && systemctl daemon-reload'
inside systemctl restart "keybagfs@$demo.service"
inside systemctl restart "keybagfs-follow@$demo.service" || fail "the follower did not restart"
sleep 1
unlock
mark=$(inside date +%s.%N)
inside systemctl suspend
for _ in $(seq 100); do inside journalctl -q -u systemd-suspend.service --since "@$mark" | grep -q "System returned from sleep" && break; sleep 0.1; done
# Order in the journal: the follower's "locked ... sleep may proceed" before the sleep itself.
journal=$(inside journalctl -q -o short-unix --since "@$mark" -u "keybagfs-follow@$demo.service" -u systemd-suspend.service)
t_locked=$(awk '/PrepareForSleep: locked/ {print $1; exit}' <<<"$journal")
t_sleep=$(awk '/Performing sleep operation|Entering sleep state|Suspending system/ {print $1; exit}' <<<"$journal")
[[ -n $t_locked && -n $t_sleep ]] || { echo "$journal" >&2; fail "no PrepareForSleep lock or no sleep in the journal"; }
awk -v a="$t_locked" -v b="$t_sleep" 'BEGIN {exit !(a <= b)}' || { echo "$journal" >&2; fail "sleep began before the mount was locked"; }
slow_ms=$(grep -o 'PrepareForSleep: locked in [0-9.]* ms' <<<"$journal" | head -1 | awk '{print $4}')
awk -v ms="$slow_ms" 'BEGIN {exit !(ms >= 1500)}' || fail "the slowed eviction took $slow_ms ms, expected >= 1500"
inside rm -f /etc/systemd/system/keybagfs@.service.d/slow.conf
inside systemctl daemon-reload
inside systemctl restart "keybagfs@$demo.service"
inside systemctl restart "keybagfs-follow@$demo.service" || fail "the follower did not restart"
ok "systemctl suspend -> locked before sleep: $sleep_stats; with a 1.5 s eviction sleep waited ($slow_ms ms, locked at $t_locked, sleep at $t_sleep)"

# 9. A forged PrepareForSleep / Lock from another bus name is ignored.
sleep 1
unlock
mark=$(inside date +%s.%N)
# Broadcast: the bus does not route it to the follower (its match names logind as sender).
inside dbus-send --system --type=signal /org/freedesktop/login1 org.freedesktop.login1.Manager.PrepareForSleep boolean:true
# Sent straight to the follower's connection: the bus delivers it; the follower must drop it.
follower_pid=$(inside systemctl show -p MainPID --value "keybagfs-follow@$demo.service")
follower_bus=$(inside busctl --system list --no-legend | awk -v pid="$follower_pid" '$2 == pid && $1 ~ /^:/ {print $1; exit}')
[[ -n $follower_bus ]] || fail "the follower has no connection on the system bus"
session_path=$(inside busctl --system call org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager GetSession s "$session" | awk '{print $2}' | tr -d '"')
inside dbus-send --system --dest="$follower_bus" --type=signal /org/freedesktop/login1 org.freedesktop.login1.Manager.PrepareForSleep boolean:true
inside dbus-send --system --dest="$follower_bus" --type=signal "$session_path" org.freedesktop.login1.Session.Lock
sleep 1
[[ $(state) == unlocked ]] || fail "a forged signal locked the mount"
inside journalctl -q -u "keybagfs-follow@$demo.service" --since "@$mark" | grep -q "PrepareForSleep\|Lock of" && fail "the follower acted on a forged signal"
ok "forged PrepareForSleep and Session.Lock (broadcast, and sent straight to the follower): dropped, the mount stays unlocked"

# 10. fstab: mount -t fuse.keybagfs through mount.fuse3, options inside -o.
inside bash -c 'mkdir -p /srv/fstab && keybagfs init /srv/fstab.store --device-key /var/lib/keybagfs/fstab.key --kdf interactive --no-recovery-key --passcode-stdin <<<"fstab pw" >/dev/null'
inside mount -t fuse.keybagfs /srv/fstab.store /srv/fstab -o device-key=/var/lib/keybagfs/fstab.key,allow_other,grace=0,policy-rule-ignored=1 2>/dev/null && fail "an unknown -o word must be refused by FUSE" || true
inside mount -t fuse.keybagfs /srv/fstab.store /srv/fstab -o device-key=/var/lib/keybagfs/fstab.key,allow_other,grace=0 || fail "mount -t fuse.keybagfs failed"
inside mountpoint -q /srv/fstab || fail "mount -t fuse.keybagfs returned without a live mount"
inside bash -c 'grep " /srv/fstab " /proc/mounts' | grep -q allow_other || fail "allow_other did not reach FUSE"
inside umount /srv/fstab
inside bash -c 'echo "/srv/fstab.store /srv/fstab fuse.keybagfs device-key=/var/lib/keybagfs/fstab.key,allow_other,_netdev,x-systemd.automount,noauto 0 0" >> /etc/fstab'
inside mount /srv/fstab || fail "mount /srv/fstab from the fstab line failed"
inside bash -c 'for i in $(seq 50); do mountpoint -q /srv/fstab && grep -q " /srv/fstab fuse.keybagfs " /proc/mounts && exit 0; sleep 0.1; done; exit 1' ||
  fail "the fstab mount is not live"
inside umount /srv/fstab
ok "mount -t fuse.keybagfs with -o device-key=…,allow_other and an fstab line (_netdev, x-systemd.automount)"

# 11. PAM: the login password unlocks the mounts alice owns; a wrong password never blocks.
inside bash -c 'mkdir -p /srv/alice && keybagfs init /srv/alice.store --device-key /var/lib/keybagfs/alice.key --kdf interactive --no-recovery-key --passcode-stdin <<<"alice-login-pw" >/dev/null'
inside keybagfs mount /srv/alice.store /srv/alice --device-key /var/lib/keybagfs/alice.key --owner alice
# The profile install.sh left in /usr/share/pam-configs, enabled as a user would: its line
# goes after the primary block of common-auth, reached only after pam_unix accepted the
# password, so wrong passwords never reach the mount's failed-attempt counter.
inside bash -c 'DEBIAN_FRONTEND=noninteractive pam-auth-update --enable keybagfs' || fail "pam-auth-update --enable keybagfs failed"
inside bash -c 'grep -A3 "pam_permit.so" /etc/pam.d/common-auth | grep -q "pam_exec.so .*keybagctl pam-unlock"' ||
  fail "pam-auth-update did not put keybagfs after the primary block of common-auth: $(inside cat /etc/pam.d/common-auth | grep -v '^#' | tr '\n' ' ')"
for _ in 1 2 3 4 5 6; do
  inside bash -c 'echo wrong-password | pamtester login alice authenticate' >/dev/null 2>&1 && fail "pamtester accepted a wrong password"
done
[[ $(inside keybagctl --mount /srv/alice status --json | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["state"], s["failedAttempts"])') == "beforeFirstUnlock 0" ]] ||
  fail "wrong login passwords changed the state or counted as failed unlocks"
inside bash -c 'echo alice-login-pw | pamtester login alice authenticate' >/dev/null 2>&1 || fail "login with the right password failed"
[[ $(inside keybagctl --mount /srv/alice status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])') == unlocked ]] ||
  fail "the login password did not unlock alice's mount"
inside fusermount3 -u /srv/alice
ok "PAM (pam-auth-update profile, pam_exec expose_authtok after the primary block): alice's login unlocks her mount; 6 wrong passwords fail only the login and count no failed unlock"

# 11b. A TPM: the demo store's device moves onto it under systemd (its device key a systemd
# credential), each wrong passcode counts in the TPM itself; a store bound to the TPM unlocks
# through PAM.
tcti=swtpm:path=/run/kbfs-swtpm/tpm.sock
tpm_counter() { local v; v=$(host_tpm tpm2_getcap properties-variable | awk '/TPM2_PT_LOCKOUT_COUNTER/ {print $2}'); echo $((v)); }
inside systemctl stop "keybagfs@$demo.service"
# The demo's recovery key went to install.sh's output: a new one (passcode) for the enrollment,
# which makes a new key set escrowed under it.
inside bash -c "systemd-creds decrypt --name=device-key /var/lib/keybagfs/$demo.cred /run/demo.key &&
  keybagfs recovery-key rotate /srv/keybagfs/demo.store --device-key /run/demo.key --passcode-stdin \
    --recovery-key-file /run/demo.rk <<<'demo passcode' >/dev/null &&
  keybagfs tpm2 enroll /srv/keybagfs/demo.store --device-key /run/demo.key --tpm2-device $tcti --passcode-stdin \
    --recovery-key-file /run/demo.rk <<<'demo passcode' >/dev/null;
  rc=\$?; rm -f /run/demo.key /run/demo.rk; exit \$rc" || fail "keybagfs tpm2 enroll of the demo store failed"
inside systemctl start "keybagfs@$demo.service" || fail "keybagfs@$demo did not start with its passcode bound to the TPM"
tpm_in_use=$(inside keybagctl --mount /srv/keybagfs/demo status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["tpm2"]["inUse"])')
[[ $tpm_in_use == True ]] || fail "status does not show the TPM in use: $tpm_in_use"
before=$(tpm_counter)
inside bash -c "keybagctl --mount /srv/keybagfs/demo unlock --passcode-stdin <<<'not the demo passcode'" 2>/dev/null && fail "a wrong passcode unlocked"
[[ $(tpm_counter) == $((before + 1)) ]] || fail "the wrong passcode did not count in the TPM (counter $before, then $(tpm_counter))"
unlock
[[ $(state) == unlocked ]] || fail "the demo store did not unlock through its TPM"
inside bash -c 'mkdir -p /srv/alice-tpm && keybagfs init /srv/alice-tpm.store --device-key /var/lib/keybagfs/alice-tpm.key --kdf interactive --no-recovery-key --tpm2 on --tpm2-device '"$tcti"' --tpm2-accept-clearable-lockout --passcode-stdin <<<"alice-login-pw" >/dev/null' ||
  fail "keybagfs init --tpm2 on failed"
inside keybagfs mount /srv/alice-tpm.store /srv/alice-tpm --device-key /var/lib/keybagfs/alice-tpm.key --owner alice
inside bash -c 'DEBIAN_FRONTEND=noninteractive pam-auth-update --enable keybagfs' || fail "pam-auth-update --enable keybagfs failed"
inside bash -c 'echo alice-login-pw | pamtester login alice authenticate' >/dev/null 2>&1 || fail "login with the right password failed"
[[ $(inside keybagctl --mount /srv/alice-tpm status --json | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["state"], s["tpm2"]["inUse"])') == "unlocked True" ]] ||
  fail "the login password did not unlock alice's TPM-bound mount"
inside fusermount3 -u /srv/alice-tpm
ok "TPM (swtpm through a Unix socket): the demo store's device enrolled under systemd (credential device key), a wrong passcode counted in the TPM ($before → $((before + 1))), unlock through the TPM; a TPM-bound store unlocked by alice's login through PAM"

# 12. Uninstall keeps stores.
inside bash /src/scripts/uninstall.sh 2>/dev/null
inside bash -c '! command -v keybagctl && test -f /srv/keybagfs/demo.store/keybag && ! mountpoint -q /srv/keybagfs/demo' || fail "uninstall.sh left binaries or removed the store"
inside bash -c '! grep -q keybagctl /etc/pam.d/common-auth && ! test -e /usr/share/pam-configs/keybagfs' ||
  fail "uninstall.sh left the PAM profile or its line in common-auth"
inside bash -c 'echo alice-login-pw | pamtester login alice authenticate' >/dev/null 2>&1 || fail "login fails after uninstall"
ok "uninstall.sh: units stopped, binaries gone, PAM profile out of common-auth, stores kept"

# 13. The Debian package, as a Debian user installs it: apt (the container has no Swift),
# Debian's places, a working mount from it, PAM through its profile, and apt purge leaving
# nothing of the package and every store and device key.
inside bash -c 'DEBIAN_FRONTEND=noninteractive apt-get install -y -q /stage/deb/keybagfs_*.deb' >"$stage.apt.log" 2>&1 ||
  { tail -20 "$stage.apt.log" >&2; fail "apt-get install of the package failed"; }
inside bash -c '! command -v swift' >/dev/null || fail "the container has a Swift toolchain"
inside bash -c 'test -x /usr/bin/keybagfs && test -x /usr/bin/keybagctl && test -f /lib/systemd/system/keybagfs@.service &&
  test -f /lib/systemd/system/keybagfs-follow@.service && test -e /sbin/mount.fuse.keybagfs && test -f /usr/share/pam-configs/keybagfs &&
  test -f /usr/share/doc/keybagfs/README.Debian && ls /usr/share/man/man1/keybagfs*.1.gz >/dev/null &&
  test -f /usr/share/bash-completion/completions/keybagctl' || fail "the package did not install its files in Debian's places"
inside systemctl cat keybagfs@.service >/dev/null || fail "systemd does not know the packaged unit"
inside bash -c 'mkdir -p /srv/pkg && keybagfs init /srv/pkg.store --device-key /var/lib/keybagfs/pkg.key --kdf interactive --no-recovery-key --passcode-stdin <<<"pkg-pass" >/dev/null &&
  keybagfs mount /srv/pkg.store /srv/pkg --device-key /var/lib/keybagfs/pkg.key --owner alice && echo pkg-pass | keybagctl --mount /srv/pkg unlock --passcode-stdin &&
  echo packaged > /srv/pkg/f && test "$(cat /srv/pkg/f)" = packaged && keybagctl --mount /srv/pkg lock --grace 0' || fail "the packaged keybagfs did not mount, unlock, write and lock"
inside bash -c 'DEBIAN_FRONTEND=noninteractive pam-auth-update --enable keybagfs && grep -q "/usr/bin/keybagctl pam-unlock" /etc/pam.d/common-auth' ||
  fail "the packaged PAM profile did not enable"
inside fusermount3 -u /srv/pkg
store_sum=$(inside bash -c 'find /srv/pkg.store /srv/keybagfs/demo.store -type f -exec sha256sum {} + | sort | sha256sum')
inside bash -c 'dpkg-deb -c /stage/deb/keybagfs_*.deb | awk "\$1 !~ /^d/ {print \$6}" | sed "s|^\\.||" > /tmp/kbfs-pkg-files'
[[ $(inside bash -c 'wc -l < /tmp/kbfs-pkg-files') -gt 10 ]] || fail "could not list the package's files"
inside bash -c 'DEBIAN_FRONTEND=noninteractive apt-get purge -y -q keybagfs' >>"$stage.apt.log" 2>&1 || { tail -20 "$stage.apt.log" >&2; fail "apt-get purge keybagfs failed"; }
left=$(inside bash -c 'while read -r f; do [ -e "$f" ] || [ -L "$f" ] && echo "$f"; done < /tmp/kbfs-pkg-files; dpkg-query -W -f="\${Status}" keybagfs 2>/dev/null | grep -v "not-installed" || true')
[[ -z $left ]] || fail "apt purge left parts of the package: $left"
inside bash -c '! grep -q keybagctl /etc/pam.d/common-auth' || fail "apt purge left the PAM line in common-auth"
[[ $(inside bash -c 'find /srv/pkg.store /srv/keybagfs/demo.store -type f -exec sha256sum {} + | sort | sha256sum') == "$store_sum" ]] &&
  inside test -f /var/lib/keybagfs/pkg.key || fail "apt purge touched a store or a device key"
inside bash -c 'echo alice-login-pw | pamtester login alice authenticate' >/dev/null 2>&1 || fail "login fails after the purge"
ok "Debian package ($(dpkg-deb -f "$stage"/deb/keybagfs_*.deb Version), lintian: no errors): apt install without Swift, files in Debian's places, mounts and locks, PAM profile enables; apt purge leaves no file of the package nor its PAM line, stores and device keys untouched"

echo "# system test passed: lock-session $lock_stats; suspend $sleep_stats; exposure keybagfs@ $score_mount, keybagfs-follow@ $score_follow"
