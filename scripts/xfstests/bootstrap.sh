#!/bin/bash
# One-time setup for running xfstests against keybagfs on a Debian 12 machine (idempotent):
# build dependencies (apt-get), an xfstests checkout in $KBFS_XFSTESTS_HOME/xfstests with
# its common/rc adapted by adapt-common-rc.py, its build (nice, make -j2), and the users
# xfstests' permission tests need. See docs/TESTING.md.
#   bash scripts/xfstests/bootstrap.sh [XFSTESTS_GIT]
# XFSTESTS_GIT: a git URL or a local git directory (plain or bare) of xfstests (default
# https://github.com/kdave/xfstests.git). Known to work at kdave/xfstests 63a29724. An
# existing checkout is kept as it is (only adapted and built), whatever XFSTESTS_GIT says.
# KBFS_XFSTESTS_HOME: where the checkout goes (default /var/tmp/kbfs-xfstests); run.sh
# keeps its state and results there too. Nothing is written inside the repository.
set -euo pipefail
HARNESS=$(cd "$(dirname "$0")" && pwd)   # scripts/xfstests
KBFS_XFSTESTS_HOME=${KBFS_XFSTESTS_HOME:-/var/tmp/kbfs-xfstests}
XFSTESTS=$KBFS_XFSTESTS_HOME/xfstests
SRC=${1:-https://github.com/kdave/xfstests.git}
[[ $(id -u) -eq 0 ]] || { echo "bootstrap.sh: run as root" >&2; exit 1; }
[[ $KBFS_XFSTESTS_HOME == /* ]] || { echo "bootstrap.sh: KBFS_XFSTESTS_HOME=$KBFS_XFSTESTS_HOME is not an absolute path" >&2; exit 1; }

pkgs=(xfslibs-dev uuid-dev libtool-bin e2fsprogs automake gcc libuuid1 quota attr make libacl1-dev
      libaio-dev xfsprogs libgdbm-dev gawk fio dbench uuid-runtime python3 sqlite3 liburing-dev
      libcap-dev bc dump acl fuse3 util-linux git)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# 0755: tests run commands as fsgqa from the checkout and inside mounts below state/.
if [[ ! -d $KBFS_XFSTESTS_HOME ]]; then mkdir -p "$KBFS_XFSTESTS_HOME"; chmod 0755 "$KBFS_XFSTESTS_HOME"; fi
if [[ ! -d $XFSTESTS/.git ]]; then
  git clone -q "$SRC" "$XFSTESTS"
fi
cd "$XFSTESTS"
python3 "$HARNESS/adapt-common-rc.py" "$XFSTESTS" ||
  { echo "bootstrap.sh: cannot adapt common/rc of xfstests $(git log -1 --format=%h)" >&2; exit 1; }
[[ -x ltp/fsstress && -x src/vfs/vfstest ]] || nice -n 10 make -j2

id fsgqa >/dev/null 2>&1 || useradd -m fsgqa
id 123456-fsgqa >/dev/null 2>&1 || useradd 123456-fsgqa
id fsgqa2 >/dev/null 2>&1 || useradd fsgqa2
getent group fsgqa >/dev/null || groupadd fsgqa
echo "bootstrap.sh: xfstests ready in $XFSTESTS; run bash $HARNESS/run.sh TESTS..."
