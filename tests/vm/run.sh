#!/usr/bin/env bash
# Run a command inside a QEMU guest that has real RDMA (Soft-RoCE rxe0) and a real
# kernel NVMe-oF target (nvmet over RDMA and TCP). See tests/vm/README.md.
#
#   bash tests/vm/run.sh [--] COMMAND [ARG...]
#   bash tests/vm/run.sh .venv/bin/pytest -m vm tests -q
#
# The guest boots Debian's stock kernel (cached), shares the host's / read-only over 9p
# (the host's Python and everything else), mounts this repo (with its .venv) read-only
# by its own share at the same path, so a checkout anywhere works, /tmp included, and
# runs COMMAND from the repo root. COMMAND's exit status becomes this script's exit status.
#
# Environment (host side, all optional):
#   CTXMEM_CACHE           cache root (default $HOME/.cache/ctxmem): kernel/, initramfs/
#   CTXMEM_VM_TIMEOUT      seconds for the whole run, boot included (default 1500)
#   CTXMEM_VM_MEM          guest memory (default 4G)
#   CTXMEM_VM_SMP          guest vCPUs (default 2)
#   CTXMEM_VM_OUT_DIR      host dir shared writable into the guest as $CTXMEM_VM_OUT
#                          (default <repo>/out/vm, emptied at each run)
#   CTXMEM_VM_NVMET_MB     size of the nvmet namespace's backing file (default 512)
#   CTXMEM_VM_KERNEL       stock (default): Debian 12's kernel (6.1: nbd, no ublk);
#                          backports: bookworm-backports' (6.12: nbd and ublk), fetched
#                          with a private apt source list under the cache (the host's
#                          apt sources are not touched)
#   CTXMEM_VM_KVER         kernel version to boot, e.g. 6.1.0-50-amd64 (default: the one
#                          linux-image-amd64 depends on, in the chosen suite)
#   CTXMEM_VM_SHARES       more host directories to mount read-only at the same path in
#                          the guest, space-separated (needed only for one under /tmp or
#                          /run outside the repo: a venv or a Python installed there)
#   CTXMEM_VM_PASSENV      names of host variables to export in the guest too
#                          (e.g. "PYTEST_ADDOPTS CTXMEM_LOG_LEVEL")
#   CTXMEM_VM_DEBUG=1      verbose kernel console and `set -x` in the guest script
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}
timeout_s=${CTXMEM_VM_TIMEOUT:-1500}
mem=${CTXMEM_VM_MEM:-4G}
smp=${CTXMEM_VM_SMP:-2}
nvmet_mb=${CTXMEM_VM_NVMET_MB:-512}
debug=${CTXMEM_VM_DEBUG:-0}
kernel_suite=${CTXMEM_VM_KERNEL:-stock}

log() { echo "ctxmem-vm: $*" >&2; }
die() { log "error: $*"; exit 2; }

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --) shift ;;
esac
[ $# -gt 0 ] || { usage >&2; exit 2; }

# The guest mounts tmpfs over /tmp and /run, then the repo and CTXMEM_VM_SHARES at their
# own paths (own 9p shares): a host path under /tmp or /run is visible there only when
# it lies in one of those.
shares=("$repo")
for d in ${CTXMEM_VM_SHARES:-}; do
  [ -d "$d" ] || die "CTXMEM_VM_SHARES: $d is not a directory"
  shares+=("$(cd "$d" && pwd -P)")
done
case "$repo$cache" in *" "*) die "paths with spaces are not supported: $repo $cache" ;; esac
hidden_in_guest() {  # PATH: true if the guest cannot see it
  local p s
  p=$(readlink -f "$1") || return 1
  case "$p/" in /tmp/*|/run/*) ;; *) return 1 ;; esac
  for s in "${shares[@]}"; do
    case "$p/" in "$(readlink -f "$s")"/*) return 1 ;; esac
  done
  return 0
}
check_visible() {  # PATH WHAT
  if hidden_in_guest "$1"; then
    die "$2 ($(readlink -f "$1")) is under /tmp or /run, which the guest hides behind tmpfs, and outside the repo: name its directory in CTXMEM_VM_SHARES (or keep it elsewhere)"
  fi
}
check_visible "$here/guest" "the guest script"
if [ -e "$repo/.venv" ]; then
  check_visible "$repo/.venv" "the repo's .venv"
  venv_home=$(sed -n 's/^home *= *//p' "$repo/.venv/pyvenv.cfg" 2>/dev/null || true)
  [ -z "$venv_home" ] || check_visible "$venv_home" "the .venv's base Python"
fi
case "${1:-}" in */*) [ ! -e "$1" ] || check_visible "$1" "the command $1" ;; esac

for tool in qemu-system-x86_64 busybox depmod modprobe cpio gzip apt-get dpkg timeout; do
  command -v "$tool" >/dev/null || die "$tool not found: run deploy/ci/vm-deps.sh"
done

if [ "$(id -u)" -eq 0 ]; then SUDO=(); else SUDO=(sudo); fi

# ---------------------------------------------------------------------------------------
# Kernel: Debian's stock (or backports) kernel package, extracted and depmod'ed, cached
# by version.
# ---------------------------------------------------------------------------------------
# The backports kernel comes through a private apt configuration (source list, lists
# and archive cache under $cache/kernel/apt-backports/): the host's sources stay as they
# are. The stock kernel uses the host's own apt configuration.
APT_OPTS=()
case "$kernel_suite" in
  stock) ;;
  backports)
    bpo=$cache/kernel/apt-backports
    mkdir -p "$bpo/lists/partial" "$bpo/cache/archives/partial"
    printf '%s\n' "Types: deb" "URIs: http://deb.debian.org/debian" "Suites: bookworm-backports" \
      "Components: main" "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" > "$bpo/backports.sources"
    APT_OPTS=(-o "Dir::Etc::SourceList=$bpo/backports.sources" -o Dir::Etc::SourceParts=/nonexistent
              -o "Dir::State::Lists=$bpo/lists" -o "Dir::Cache=$bpo/cache")
    ;;
  *) die "CTXMEM_VM_KERNEL=$kernel_suite: expected stock or backports" ;;
esac

apt_update() {
  if [ "$kernel_suite" = backports ]; then
    apt-get "${APT_OPTS[@]}" update -q >&2  # private lists: no root needed
  else
    "${SUDO[@]}" apt-get update -q >&2
  fi
}

resolve_kver() {
  apt-cache "${APT_OPTS[@]}" depends linux-image-amd64 2>/dev/null \
    | awk '/Depends: linux-image-[0-9]/{sub(/^linux-image-/, "", $2); print $2; exit}'
}

newest_cached_kver() {  # backports versions carry a "+" (6.12.95+deb12-amd64), stock ones do not
  ls -1d "$cache"/kernel/*/.ok 2>/dev/null | sed 's#/\.ok$##; s#.*/##' \
    | if [ "$kernel_suite" = backports ]; then grep '+'; else grep -v '+'; fi | sort -V | tail -n1
}

ensure_kernel() {
  local kver=${CTXMEM_VM_KVER:-}
  if [ -z "$kver" ]; then
    kver=$(resolve_kver)
    if [ -z "$kver" ]; then
      kver=$(newest_cached_kver)
      if [ -z "$kver" ]; then
        log "apt index ($kernel_suite) has no linux-image-amd64: running apt-get update"
        apt_update
        kver=$(resolve_kver)
      fi
    fi
  fi
  [ -n "$kver" ] || die "cannot resolve the kernel version (set CTXMEM_VM_KVER)"
  local kdir=$cache/kernel/$kver
  if [ ! -f "$kdir/.ok" ]; then
    log "fetching kernel linux-image-$kver (cached afterwards in $kdir)"
    mkdir -p "$cache/kernel"
    local tmp
    tmp=$(mktemp -d "$cache/kernel/.fetch.XXXXXX")
    if ! (cd "$tmp" && apt-get "${APT_OPTS[@]}" download -q "linux-image-$kver" >&2 2>"$tmp/apt.err"); then
      log "apt-get download failed (stale index?): running apt-get update and retrying"
      apt_update
      (cd "$tmp" && apt-get "${APT_OPTS[@]}" download -q "linux-image-$kver" >&2) \
        || { rm -rf "$tmp"; die "cannot download linux-image-$kver"; }
    fi
    mkdir -p "$tmp/root"
    dpkg -x "$tmp"/linux-image-*.deb "$tmp/root"
    rm -f "$tmp"/linux-image-*.deb "$tmp/apt.err"
    [ -f "$tmp/root/boot/vmlinuz-$kver" ] || { rm -rf "$tmp"; die "no vmlinuz in linux-image-$kver"; }
    depmod -b "$tmp/root" "$kver"
    touch "$tmp/.ok"
    rm -rf "$kdir"
    mv "$tmp" "$kdir"
  fi
  echo "$kver"
}

# ---------------------------------------------------------------------------------------
# Initramfs: static busybox + the virtio/9p modules, just enough to mount the host's /.
# Cached by kernel version and a digest of its inputs.
# ---------------------------------------------------------------------------------------
write_init() {
  cat <<'EOF'
#!/bin/busybox sh
# ctxmem VM initramfs: load virtio + 9p, mount the host's / read-only, hand over.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r m; do
  insmod "/lib/modules/$m" || echo "initramfs: insmod $m failed"
done < /modules.list
guest=
for a in $(cat /proc/cmdline); do
  case "$a" in ctxmem.guest=*) guest=${a#ctxmem.guest=} ;; esac
done
mkdir -p /newroot
if ! mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /newroot; then
  echo "initramfs: cannot mount the host root over 9p"
  echo o > /proc/sysrq-trigger
  sleep 60
fi
umount /proc /sys /dev
exec switch_root /newroot /bin/bash "$guest"
EOF
}

ensure_initramfs() {
  local kver=$1 kroot=$cache/kernel/$1/root
  local bb
  bb=$(command -v busybox)
  if ldd "$bb" >/dev/null 2>&1; then
    die "$bb is dynamically linked: install busybox-static (deploy/ci/vm-deps.sh)"
  fi
  local mods
  mods=$(modprobe -d "$kroot" -S "$kver" --show-depends -a virtio_pci virtio_net 9pnet_virtio 9p \
           | awk '$1 == "insmod" && !seen[$2]++ {print $2}')
  [ -n "$mods" ] || die "cannot resolve the initramfs modules in $kroot"
  local key
  key=$( { write_init; echo "$mods"; sha256sum "$bb"; } | sha256sum | cut -c1-16)
  local img=$cache/initramfs/initrd-$kver-$key.cpio.gz
  if [ ! -f "$img" ]; then
    log "building initramfs $img"
    mkdir -p "$cache/initramfs"
    local tmp
    tmp=$(mktemp -d "$cache/initramfs/.build.XXXXXX")
    mkdir -p "$tmp"/{bin,dev,proc,sys,newroot,lib/modules}
    cp "$bb" "$tmp/bin/busybox"
    write_init > "$tmp/init"
    chmod 755 "$tmp/init"
    : > "$tmp/modules.list"
    local m base
    while read -r m; do
      base=$(basename "$m")
      case "$base" in
        *.ko.xz)  xz -dc "$m" > "$tmp/lib/modules/${base%.xz}"; base=${base%.xz} ;;
        *.ko.zst) zstd -qdc "$m" > "$tmp/lib/modules/${base%.zst}"; base=${base%.zst} ;;
        *.ko.gz)  gzip -dc "$m" > "$tmp/lib/modules/${base%.gz}"; base=${base%.gz} ;;
        *)        cp "$m" "$tmp/lib/modules/$base" ;;
      esac
      echo "$base" >> "$tmp/modules.list"
    done <<< "$mods"
    (cd "$tmp" && find . -path ./.img -prune -o -print | cpio -o -H newc --quiet -R 0:0 | gzip -9 > "$tmp/.img")
    mv "$tmp/.img" "$img"
    rm -rf "$tmp"
    # Older images for this kernel (from an older recipe) are dead weight.
    find "$cache/initramfs" -maxdepth 1 -name "initrd-$kver-*.cpio.gz" ! -name "$(basename "$img")" -delete
  fi
  echo "$img"
}

t_start=$(date +%s.%N)
kver=$(ensure_kernel)
initrd=$(ensure_initramfs "$kver")
kroot=$cache/kernel/$kver/root
t_prep=$(date +%s.%N)

# ---------------------------------------------------------------------------------------
# Output share and the command handed to the guest.
# ---------------------------------------------------------------------------------------
if [ -n "${CTXMEM_VM_OUT_DIR:-}" ]; then
  out=$CTXMEM_VM_OUT_DIR
  mkdir -p "$out"
  rm -rf "$out/.ctxmem-vm" "$out/console.log"
else
  out=$repo/out/vm
  rm -rf "$out"
  mkdir -p "$out"
fi
out=$(cd "$out" && pwd)
ctl=$out/.ctxmem-vm
mkdir -p "$ctl"
printf '%q ' "$@" > "$ctl/cmd"
echo >> "$ctl/cmd"
# Directories the guest mounts at their own path after its tmpfs mounts: "TAG PATH".
: > "$ctl/mounts"
qemu_shares=()
for i in "${!shares[@]}"; do
  echo "share$i ${shares[$i]}" >> "$ctl/mounts"
  qemu_shares+=(-virtfs "local,path=${shares[$i]},mount_tag=share$i,security_model=none,readonly=on,multidevs=remap")
done
# Host variables named in CTXMEM_VM_PASSENV are exported in the guest too.
: > "$ctl/env"
for v in ${CTXMEM_VM_PASSENV:-}; do
  [[ "$v" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "bad name in CTXMEM_VM_PASSENV: $v"
  if [ -n "${!v+x}" ]; then printf 'export %s=%q\n' "$v" "${!v}" >> "$ctl/env"; fi
done
# SPDK built by deploy/ci/spdk-build.sh (cached under $cache/spdk/): the guest sees the
# host's / read-only, the cache included, so its tests run that build
# (CTXMEM_SPDK_PREFIX; tests/vm/README.md). Unset when no build is cached.
spdk_prefix=${CTXMEM_SPDK_PREFIX:-$(bash "$repo/deploy/ci/spdk-build.sh" --print 2>/dev/null || true)}
if [ -n "$spdk_prefix" ]; then
  printf 'export CTXMEM_SPDK_PREFIX=%q\n' "$spdk_prefix" >> "$ctl/env"
fi

if [ "$debug" = 1 ]; then
  kcon="loglevel=7"
else
  kcon="quiet"
fi
append="console=ttyS0 panic=-1 $kcon ctxmem.guest=$here/guest/guest.sh ctxmem.repo=$repo"
append+=" ctxmem.nvmet_mb=$nvmet_mb ctxmem.debug=$debug"

log "kernel $kver ($kernel_suite), SPDK ${spdk_prefix:-not built}, $smp vCPU, $mem, TCG (emulated: never a performance figure); timeout ${timeout_s}s"
log "out dir $out"

qemu=(
  qemu-system-x86_64
  -accel "tcg,thread=multi" -cpu max -smp "$smp" -m "$mem"
  -nodefaults -no-user-config -display none -no-reboot
  -chardev "stdio,id=con0,signal=off" -serial chardev:con0
  -kernel "$kroot/boot/vmlinuz-$kver" -initrd "$initrd" -append "$append"
  -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
  -virtfs "local,path=$out,mount_tag=out,security_model=none,multidevs=remap"
  -virtfs "local,path=$kroot,mount_tag=kmod,security_model=none,readonly=on"
  "${qemu_shares[@]}"
  # user-mode network with no way out: the guest only talks to itself (rxe loopback).
  -netdev "user,id=n0,restrict=on" -device "virtio-net-pci,netdev=n0"
  -device virtio-rng-pci
)

set +e
timeout -k 20 "$timeout_s" "${qemu[@]}" < /dev/null 2>&1 | tee "$out/console.log"
qrc=${PIPESTATUS[0]}
set -e
t_end=$(date +%s.%N)

wall() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
if [ -f "$ctl/status" ]; then
  rc=$(tr -dc '0-9' < "$ctl/status")
  rc=${rc:-1}
  [ -f "$ctl/error" ] && log "error: guest $(cat "$ctl/error") (dmesg in $ctl/dmesg.txt)"
  [ -f "$ctl/timings" ] && log "guest timings: $(cat "$ctl/timings")"
  log "host timings: prepare $(wall "$t_start" "$t_prep") s, qemu $(wall "$t_prep" "$t_end") s; command exit status $rc"
  exit "$rc"
fi
if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
  log "error: the guest never reported: timed out after ${timeout_s}s (CTXMEM_VM_TIMEOUT); console in $out/console.log"
  exit 124
fi
log "error: the guest never reported an exit status (qemu exit $qrc); console in $out/console.log"
exit 125
