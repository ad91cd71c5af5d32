#!/usr/bin/env bash
# ci/v2guest.sh: run one shell command in a throwaway QEMU guest whose kernel has cgroup v2
# only (cgroup_no_v1=all), on this machine's own files; print its output, exit with its status.
#
#   bash ci/v2guest.sh [-C DIR] COMMAND...    COMMAND (its words joined by spaces) runs under
#                                             bash in DIR (default: the current directory)
#   e.g.  bash ci/v2guest.sh '.venv/bin/python -m pytest -q tests/test_limits.py'
#
# What the guest is:
# - Debian's cloud kernel (the package linux-image-cloud-amd64 depends on) and a busybox
#   initramfs that loads virtio, virtiofs and overlayfs, mounts this machine's / read-only
#   over virtiofs with a tmpfs overlay on top (the guest writes anywhere; it is all gone at
#   power-off; the host's files are never written), and switch_roots into it.
# - PID 1 is then this machine's bash: it mounts proc, sysfs, cgroup2 at /sys/fs/cgroup
#   (nsdelegate, as systemd does) with every controller enabled in the root's
#   cgroup.subtree_control, devtmpfs, devpts, /dev/shm, /run, brings lo up, and runs COMMAND
#   as root in the ROOT cgroup (to run it elsewhere, COMMAND moves its shell first:
#   ci/test.sh's v2 stage does). No network but lo, no systemd, RLIMIT_NOFILE 1024/524288.
# - /dev/kvm on this project's machines is PVM (the kvm_pvm module), which runs only
#   PVM-enlightened guest kernels: a stock kernel hangs before its first console line. So
#   the guest runs under TCG (emulation), ~10x slower than the host: BOLTZLABS_TIME_SCALE=10
#   is set for COMMAND, which tests read to give their deadlines room (tests/conftest.py).
#
# Installs with apt-get on a fresh Debian machine, once (root): qemu-system-x86
# (--no-install-recommends; virtiofsd comes with its dependency qemu-system-common); the
# kernel and busybox-static are fetched with `apt-get download` and unpacked into the cache,
# never installed. Also used: util-linux (unshare, flock), coreutils, dpkg-deb, apt-cache.
#
# Environment: V2GUEST_MEM (4G), V2GUEST_CPUS (2), V2GUEST_TMPFS (3G: the overlay's size),
# V2GUEST_TIMEOUT (3600 s; then exit 124), V2GUEST_ACCEL (auto: kvm where /dev/kvm is real
# KVM, else tcg), V2GUEST_CACHE (/var/cache/boltzlabs-v2guest; delete it to rebuild),
# V2GUEST_QUIET=1 (no "v2guest:" lines on stderr), V2GUEST_INIT=systemd (PID 1 is this
# machine's systemd and COMMAND its service: for trying systemd-run in the guest).
# Exit status: COMMAND's; 124 on V2GUEST_TIMEOUT; 125 if the guest reported none (its
# console's tail goes to stderr).
set -euo pipefail

usage() { sed -n '2,8p' "$0" >&2; exit 2; }
WORKDIR=$PWD
while getopts C:h opt; do
  case $opt in C) WORKDIR=$(readlink -f "$OPTARG") ;; *) usage ;; esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || usage
CMD="$*"
[ "$(id -u)" = 0 ] || { echo "ci/v2guest.sh: needs root (virtiofsd, mount namespaces)" >&2; exit 2; }
[ -d "$WORKDIR" ] || { echo "ci/v2guest.sh: no directory $WORKDIR" >&2; exit 2; }

MEM=${V2GUEST_MEM:-4G}
CPUS=${V2GUEST_CPUS:-2}
TMPFS=${V2GUEST_TMPFS:-3G}
TIMEOUT=${V2GUEST_TIMEOUT:-3600}
ACCEL=${V2GUEST_ACCEL:-auto}
CACHE=${V2GUEST_CACHE:-/var/cache/boltzlabs-v2guest}
VIRTIOFSD=/usr/lib/qemu/virtiofsd
# Modules the initramfs loads, dependencies first (all modules in the cloud kernel).
MODULES="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci fuse virtiofs overlay"
say() { [ "${V2GUEST_QUIET:-0}" = 1 ] || echo "v2guest: $*" >&2; }

# -- setup: once, under a lock (two runs may start together) -----------------------------------

install() {
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9
  if ! command -v qemu-system-x86_64 >/dev/null || [ ! -x "$VIRTIOFSD" ]; then
    say "installing qemu-system-x86 with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 >/dev/null
  fi
  if [ -f "$CACHE/vmlinuz" ] && [ -f "$CACHE/initrd.cpio" ]; then exec 9>&-; return; fi
  local pkg build ird m f
  kernel_package() { apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
  pkg=$(kernel_package)
  if [ -z "$pkg" ]; then apt-get update -qq; pkg=$(kernel_package); fi
  [ -n "$pkg" ] || { echo "ci/v2guest.sh: apt knows no linux-image-cloud-amd64" >&2; exit 2; }
  say "fetching $pkg and busybox-static (apt-get download) into $CACHE"
  build=$(mktemp -d "$CACHE/build.XXXXXX")
  chmod 755 "$build"  # apt's download user must write here
  (cd "$build" && apt-get download -q "$pkg" busybox-static >/dev/null 2>&1) \
    || { echo "ci/v2guest.sh: apt-get download $pkg busybox-static failed" >&2; exit 2; }
  dpkg-deb -x "$build"/linux-image-*.deb "$build/kernel"
  dpkg-deb -x "$build"/busybox-static_*.deb "$build/busybox"
  ird=$build/initramfs
  mkdir -p "$ird/bin" "$ird/lib/modules"
  cp "$build/busybox/bin/busybox" "$ird/bin/busybox"
  for m in $MODULES; do
    f=$(find "$build/kernel/lib/modules" -name "$m.ko*" | head -n 1)
    [ -z "$f" ] || cp "$f" "$ird/lib/modules/"
  done
  ls "$ird/lib/modules" | grep -q '^virtiofs\.ko' || grep -qs virtiofs "$build"/kernel/lib/modules/*/modules.builtin \
    || { echo "ci/v2guest.sh: $pkg has no virtiofs" >&2; exit 2; }
  # The initramfs: mount / from virtiofs under a tmpfs overlay, hand over to stage2.
  cat > "$ird/init" <<INIT
#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /sbin /usr/bin /usr/sbin /lower /rw /newroot
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
fail() { echo "v2guest initramfs: \$*" > /dev/ttyS1; echo "rc 125" > /dev/ttyS2; poweroff -f; }
for m in $MODULES; do for f in /lib/modules/\$m.ko*; do [ -f "\$f" ] && insmod "\$f"; done; done
run=; tmpfs=3G
for a in \$(cat /proc/cmdline); do
  case \$a in v2guest.run=*) run=\${a#*=} ;; v2guest.tmpfs=*) tmpfs=\${a#*=} ;; esac
done
i=0
until mount -t virtiofs -o ro hostroot /lower 2>/dev/null; do
  i=\$((i + 1)); [ \$i -lt 100 ] || fail "cannot mount the virtiofs tag hostroot"; sleep 0.05
done
mount -t tmpfs -o size=\$tmpfs,mode=755 rw /rw || fail "tmpfs"
mkdir /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work root /newroot || fail "overlay"
[ -f "/newroot\$run/stage2" ] || fail "the guest does not see \$run/stage2"
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /bin/bash "\$run/stage2"
INIT
  chmod 755 "$ird/init"
  (cd "$ird" && find . | "$build/busybox/bin/busybox" cpio -o -H newc 2>/dev/null) > "$build/initrd.cpio"
  cp "$build"/kernel/boot/vmlinuz-* "$CACHE/vmlinuz.new"
  echo "$pkg" > "$CACHE/kernel-package"
  mv "$build/initrd.cpio" "$CACHE/initrd.cpio.new"
  mv "$CACHE/vmlinuz.new" "$CACHE/vmlinuz"
  mv "$CACHE/initrd.cpio.new" "$CACHE/initrd.cpio"  # last: its presence means "set up"
  rm -rf "$build"
  exec 9>&-
}
install

# -- one run -----------------------------------------------------------------------------------

RUN=$(mktemp -d /tmp/v2guest.XXXXXX)
chmod 755 "$RUN"
VPID=; QPID=
cleanup() {
  local rc=$?
  for pid in $QPID $VPID; do kill "$pid" 2>/dev/null || true; done
  for pid in $QPID $VPID; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$RUN"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
printf '%s\n' "$CMD" > "$RUN/cmd"
printf '%s\n' "$WORKDIR" > "$RUN/workdir"
mkdir "$RUN/lower"
: > "$RUN/out"; : > "$RUN/status"

# stage2, PID 1 of the guest after switch_root. ttyS0: kernel console; ttyS1: COMMAND's
# output; ttyS2: "start", "end" (uptimes) and "rc N" lines for this script.
# V2GUEST_INIT=systemd: stage2 hands PID 1 to this machine's systemd at once, which mounts
# the API filesystems and cgroup2 itself and runs COMMAND as the oneshot v2guest.service.
{ echo '#!/bin/bash'; echo "RUN=$RUN"; echo "INIT=${V2GUEST_INIT:-bash}"; cat <<'STAGE2'; } > "$RUN/stage2"
if [ "$INIT" = systemd ] && [ "$$" = 1 ]; then
  # Debian's tmpfiles.d/tmp.conf empties /tmp at boot ("D /tmp"): once the system bus pulls in
  # systemd-tmpfiles-setup, the guest would delete its view of the host's /tmp, a checkout
  # there included, walking every file of it. Kept, not emptied.
  mkdir -p /etc/systemd/system /etc/tmpfiles.d
  printf '%s\n' 'd /tmp 1777 root root -' 'd /var/tmp 1777 root root -' > /etc/tmpfiles.d/tmp.conf
  printf '%s\n' '[Unit]' 'DefaultDependencies=no' '[Service]' 'Type=oneshot' \
    "ExecStart=/bin/bash $RUN/stage2" > /etc/systemd/system/v2guest.service
  exec /lib/systemd/systemd --unit=v2guest.service
fi
exec 3>/dev/ttyS1 4>/dev/ttyS2 </dev/null
run_command() {  # COMMAND in its directory, its output on ttyS1, its uptimes and rc on ttyS2; then power off
  stty raw -echo 115200 <&3 2>/dev/null; stty raw -echo 115200 <&4 2>/dev/null
  export HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 TERM=dumb
  export BOLTZLABS_TIME_SCALE=${BOLTZLABS_TIME_SCALE:-10}
  read -r up _ < /proc/uptime; echo "start $up" >&4
  if cd "$(cat "$RUN/workdir")"; then bash "$RUN/cmd" </dev/null >&3 2>&3; rc=$?; else rc=125; fi
  read -r up _ < /proc/uptime; echo "end $up" >&4
  echo "rc $rc" >&4
  sync
  echo o > /proc/sysrq-trigger
  sleep 30
}
if [ "$INIT" = systemd ]; then  # systemd mounted all and brings lo up; COMMAND is its service
  run_command
fi
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup || mount -t cgroup2 cgroup2 /sys/fs/cgroup
for c in $(cat /sys/fs/cgroup/cgroup.controllers); do echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control; done
mkdir -p /dev/pts /dev/shm /dev/mqueue
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts /dev/pts
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /dev/shm
mount -t mqueue mqueue /dev/mqueue 2>/dev/null
mount -t tmpfs -o nosuid,nodev,mode=755 tmpfs /run
mkdir -p /run/lock /run/user
chmod 1777 /tmp /var/tmp 2>/dev/null
hostname v2guest
ip link set lo up 2>/dev/null || echo "v2guest: no ip command: lo stays down" >&3
ulimit -Hn 524288; ulimit -Sn 1024
run_command
STAGE2
chmod 755 "$RUN/stage2"

# virtiofsd serves a read-only bind of / (not recursive: no host /proc, /sys, /dev) and of
# the filesystems holding WORKDIR and RUN where they are not /, from a private mount namespace.
EXTRA=""
for p in "$WORKDIR" "$RUN"; do
  m=$(stat -c %m "$p")
  [ "$m" = / ] || case " $EXTRA " in *" $m "*) ;; *) EXTRA="$EXTRA $m" ;; esac
done
SOCK=$RUN/virtiofs.sock
# virtiofsd holds an O_PATH fd for every host inode the guest has cached, and its fd limit is
# this process's hard limit (20,000 here, which root cannot raise). A systemd guest passed it
# when systemd-tmpfiles walked the host's /tmp to empty it (seen: 600 fds to 20,000 in 30 s;
# every open and close after that failed in the guest, EMFILE and EBADF). stage2 now keeps
# /tmp, and the systemd guest, which looks up far more than the bash-init one, also runs
# with cache=none, which lets the guest drop what it no longer uses (at most ~800 fds seen),
# at some speed; the bash-init guest keeps cache=always. V2GUEST_VIRTIOFS_CACHE chooses.
if [ "${V2GUEST_INIT:-bash}" = systemd ]; then VIRTIOFS_CACHE=${V2GUEST_VIRTIOFS_CACHE:-none}
else VIRTIOFS_CACHE=${V2GUEST_VIRTIOFS_CACHE:-always}; fi
unshare -m --propagation private bash -c '
  set -e
  lower=$1 sock=$2 virtiofsd=$3 cache=$4; shift 4
  mount --bind / "$lower"; mount -o remount,bind,ro "$lower"
  for m in "$@"; do mount --bind "$m" "$lower$m"; mount -o remount,bind,ro "$lower$m"; done
  exec "$virtiofsd" --socket-path="$sock" -o source="$lower" -o cache="$cache" -o no_posix_lock -o log_level=err
' v2guest-virtiofsd "$RUN/lower" "$SOCK" "$VIRTIOFSD" "$VIRTIOFS_CACHE" $EXTRA 2>"$RUN/virtiofsd.log" &
VPID=$!
for _ in $(seq 200); do [ -S "$SOCK" ] && break; sleep 0.05; done
[ -S "$SOCK" ] || { echo "ci/v2guest.sh: virtiofsd did not start: $(cat "$RUN/virtiofsd.log")" >&2; exit 125; }

if [ "$ACCEL" = auto ]; then
  if [ -d /sys/module/kvm_pvm ]; then
    say "/dev/kvm is PVM (kvm_pvm), which cannot run a stock kernel: TCG (emulation, ~10x slower)"
    ACCEL=tcg
  elif [ -r /dev/kvm ] && [ -w /dev/kvm ]; then ACCEL=kvm
  else say "no usable /dev/kvm: TCG (emulation, ~10x slower)"; ACCEL=tcg
  fi
fi
if [ "$ACCEL" = kvm ]; then CPU=host; else CPU=max; fi
# The guest's clock is the emulated HPET, which QEMU drives from the host's clock: under TCG the
# TSC is calibrated at boot against a timer the busy host makes late, and a guest booted beside CI's
# other stages once ran its clock 5x fast (2,676 guest seconds in 516 host seconds), so every
# deadline a test scaled for emulation was 5x too short.
APPEND="console=ttyS0 loglevel=4 panic=-1 cgroup_no_v1=all rdinit=/init clocksource=hpet tsc=unstable no_timer_check"
APPEND="$APPEND i8042.noaux i8042.nokbd i8042.nopnp v2guest.run=$RUN v2guest.tmpfs=$TMPFS"

say "booting $(cat "$CACHE/kernel-package") ($ACCEL, $CPUS vCPUs, $MEM) in $WORKDIR"
T0=$(date +%s.%N)
timeout -k 5 "$TIMEOUT" qemu-system-x86_64 -name v2guest -nodefaults -no-user-config -no-reboot \
  -machine "q35,accel=$ACCEL" -cpu "$CPU" -smp "$CPUS" -m "$MEM" \
  -object "memory-backend-memfd,id=mem,size=$MEM,share=on" -numa node,memdev=mem \
  -kernel "$CACHE/vmlinuz" -initrd "$CACHE/initrd.cpio" -append "$APPEND" \
  -chardev "socket,id=vfs,path=$SOCK" -device vhost-user-fs-pci,chardev=vfs,tag=hostroot \
  -device virtio-rng-pci -display none -monitor none \
  -serial "file:$RUN/console.log" -serial "file:$RUN/out" -serial "file:$RUN/status" \
  </dev/null >"$RUN/qemu.log" 2>&1 &
QPID=$!
tail -s 0.2 -n +1 -f --pid="$QPID" "$RUN/out" &
TPID=$!
set +e
wait "$QPID"; qrc=$?
QPID=
wait "$TPID"
set -e
T1=$(date +%s.%N)

status() { tr -d '\r' < "$RUN/status" | awk -v k="$1" '$1 == k {print $2}'; }
rc=$(status rc)
if [ -z "$rc" ]; then
  if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
    echo "ci/v2guest.sh: the guest ran past V2GUEST_TIMEOUT=$TIMEOUT s and was killed" >&2; rc=124
  else
    echo "ci/v2guest.sh: the guest reported no exit status (qemu exit $qrc: $(tail -n 3 "$RUN/qemu.log"))" >&2
    tail -n 40 "$RUN/console.log" >&2
    rc=125
  fi
fi
start=$(status start); end=$(status end)
if [ -n "$start" ] && [ -n "$end" ]; then
  say "$(awk -v t0="$T0" -v t1="$T1" -v s="$start" -v e="$end" -v rc="$rc" 'BEGIN {
    printf "exit %s; %.1f s in all, of which the command %.1f s", rc, t1 - t0, e - s }')"
fi
exit "$rc"
