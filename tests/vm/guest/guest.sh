#!/bin/bash
# PID 1 of the ctxmem test guest (tests/vm/run.sh boots it; do not run it on a host).
# The root is the host's / over 9p, read-only. This script mounts what a system needs,
# loads the RDMA/NVMe-oF modules, creates rxe0 on eth0, sets up the nvmet target, runs
# the command that run.sh left in the out share, reports its exit status there and
# powers off.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export LANG=C.UTF-8

mount -t proc proc /proc
t_boot=$(cut -d' ' -f1 /proc/uptime)

param() {  # value of ctxmem.NAME= on the kernel command line
  local a
  for a in $(cat /proc/cmdline); do
    case "$a" in "ctxmem.$1="*) echo "${a#*=}"; return ;; esac
  done
}
REPO=$(param repo)
NVMET_MB=$(param nvmet_mb)
DEBUG=$(param debug)
[ "$DEBUG" = 1 ] && set -x

OUT=/run/out
CTL=$OUT/.ctxmem-vm

poweroff_now() {
  sync
  umount "$OUT" 2>/dev/null
  # Once power-off starts, virtio goes down and nothing more can be exec'ed from the
  # 9p root, and PID 1 exiting would panic with a noisy trace: wait with builtins
  # only, on a FIFO opened read-write (never blocks to open, never gets data).
  echo o > /proc/sysrq-trigger
  if [ -p /run/ctxmem-wait ] && exec 8<>/run/ctxmem-wait; then
    read -r -t 300 -u 8 _
  fi
  exit 0  # only if power-off did not happen: PID 1 exits, panic=-1 ends QEMU
}

fail() {  # setup failed: report it, show the kernel's view, power off
  echo "ctxmem-vm guest: setup failed: $*"
  dmesg 2>/dev/null | tail -n 40
  dmesg > "$CTL/dmesg.txt" 2>/dev/null
  echo "setup failed: $*" > "$CTL/error" 2>/dev/null
  echo 125 > "$CTL/status" 2>/dev/null
  poweroff_now
}

mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p "$OUT" /run/kmod /run/home /run/nvmet
mkfifo /run/ctxmem-wait
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out "$OUT" || fail "mount out share"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,ro,cache=loose kmod /run/kmod \
  || fail "mount kernel modules share"
[ -f "$CTL/cmd" ] || fail "no command file $CTL/cmd"
# The repo (and CTXMEM_VM_SHARES) at their host paths, over the tmpfs mounts above: a
# checkout under /tmp or /run works like one anywhere else.
if [ -f "$CTL/mounts" ]; then
  while read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "$path" 2>/dev/null  # exists already unless under /tmp or /run
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,ro,cache=loose "$tag" "$path" \
      || fail "mount share $tag at $path"
  done < "$CTL/mounts"
fi
# Variables the host passed through (CTXMEM_VM_PASSENV); the contract set below wins.
if [ -f "$CTL/env" ]; then . "$CTL/env"; fi

t0=$(cut -d' ' -f1 /proc/uptime)

# Modules: crc32_generic before rdma_rxe ("failed to init crc32 algorithm" otherwise).
for m in virtio_net crc32_generic rdma_rxe ib_uverbs rdma_ucm configfs \
         nvmet nvmet-rdma nvmet-tcp nvme-rdma nvme-tcp; do
  modprobe -d /run/kmod "$m" || fail "modprobe $m"
done
# sock_diag for TCP (ss -e; the service asks it which local user made a loopback
# connection: ctxmem_dpu.control.localpeer). A normal host loads it on first use; here the
# modules live in /run/kmod, where the kernel's own autoload does not look. Without it the
# service reads /proc/net/tcp[6] instead.
modprobe -d /run/kmod tcp_diag || echo "ctxmem-vm guest: modprobe tcp_diag failed (the service falls back to /proc/net/tcp)"
# Block drivers SPDK exposes bdevs through (ctxmem_tools.spdk_app): nbd on every
# kernel; ublk_drv only on the backports kernel (Debian 12's 6.1 has no ublk).
modprobe -d /run/kmod nbd || fail "modprobe nbd"
if modprobe -d /run/kmod -n ublk_drv 2>/dev/null; then
  modprobe -d /run/kmod ublk_drv || fail "modprobe ublk_drv"
fi
mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config \
  || fail "mount configfs"

# Network: eth0 at slirp's address; the guest only ever talks to itself.
for _ in $(seq 100); do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done
ip link set lo up
ip link set eth0 up || fail "no eth0"
ip addr add 10.0.2.15/24 dev eth0 || fail "ip addr add"
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add rxe0"
for _ in $(seq 200); do
  rdma link show rxe0/1 2>/dev/null | grep -q 'state ACTIVE' && break
  sleep 0.1
done
rdma link show rxe0/1 | grep -q 'state ACTIVE' || fail "rxe0 port not ACTIVE"

# NVMe-oF target (RDMA 4420, TCP 4421), file-backed namespace on tmpfs.
export CTXMEM_NVMET_NQN=nqn.2024-01.io.ctxmem:vm-target
export CTXMEM_NVMET_ADDR=10.0.2.15
export CTXMEM_NVMET_RDMA_PORT=4420
export CTXMEM_NVMET_TCP_PORT=4421
export CTXMEM_NVMET_BACKING=/run/nvmet/ns1.img
export CTXMEM_NVMET_CTL=$REPO/tests/vm/guest/nvmet-ctl.sh
mount -t tmpfs -o mode=700,size=$((${NVMET_MB:-512} + 16))M tmpfs /run/nvmet
truncate -s "${NVMET_MB:-512}M" "$CTXMEM_NVMET_BACKING"
bash "$CTXMEM_NVMET_CTL" setup || fail "nvmet setup"

t1=$(cut -d' ' -f1 /proc/uptime)

# The command's environment (the contract tests rely on; see tests/vm/README.md).
export CTXMEM_VM=1
export CTXMEM_RDMA_DEV=rxe0
export CTXMEM_RDMA_IP=10.0.2.15
export CTXMEM_VM_OUT=$OUT
export HOME=/run/home
export TMPDIR=/tmp
export PATH=$REPO/.venv/bin:$PATH
export PYTHONDONTWRITEBYTECODE=1
export TERM=dumb  # a serial line relayed to a log: no colour codes
# The repo is read-only here: keep pytest's cache off it.
export PYTEST_ADDOPTS="-p no:cacheprovider ${PYTEST_ADDOPTS:-}"

eval "set -- $(cat "$CTL/cmd")"
echo "ctxmem-vm guest: ready in ${t1}s; running: $*"
cd "$REPO" || fail "cd $REPO"
set +x
"$@" < /dev/null
rc=$?
t2=$(cut -d' ' -f1 /proc/uptime)

dmesg > "$CTL/dmesg.txt" 2>/dev/null
awk -v b="$t_boot" -v s0="$t0" -v s1="$t1" -v e="$t2" 'BEGIN {
  printf "boot %.1f s, setup %.1f s, command %.1f s (guest clock)\n", b, s1 - s0, e - s1 }' \
  > "$CTL/timings"
echo "$rc" > "$CTL/status"
poweroff_now
