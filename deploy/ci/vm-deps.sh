#!/usr/bin/env bash
# Install the Debian packages the QEMU guest harness (tests/vm/), the pyverbs wheel
# build (deploy/ci/pyverbs-wheel.sh) and the SPDK build (deploy/ci/spdk-build.sh) need.
# Idempotent: installs only what is missing and runs `apt-get update` only when a
# package is missing (or its index is absent).
# Works as root; uses sudo otherwise.
set -euo pipefail

PKGS=(
  # the guest: emulator, initramfs tools
  qemu-system-x86 busybox-static kmod cpio gzip
  # apt-get download + dpkg -x of the stock kernel happen at run time (dpkg/apt are base)
  # RDMA userspace (libibverbs + rxe provider, tools) and NVMe-oF initiator CLI
  rdma-core ibverbs-providers ibverbs-utils perftest nvme-cli iproute2
  # to build pyverbs from its sdist (it builds rdma-core)
  cmake ninja-build pkg-config gcc libnl-3-dev libnl-route-3-dev libudev-dev
  # to build SPDK from the vendored source (deploy/ci/spdk-build.sh) against Debian's
  # DPDK 22.11, ISA-L, liburing and rdma-core (../shared/notes/spdk-build.md); the
  # runtime libraries spdk_tgt needs come with these
  libdpdk-dev libisal-dev liburing-dev libnuma-dev libaio-dev uuid-dev libssl-dev
  libncurses-dev libkeyutils-dev libfuse3-dev libibverbs-dev librdmacm-dev nasm autoconf
  automake libtool make xz-utils python3-yaml python3-jinja2 python3-tabulate
)

if [ "$(id -u)" -eq 0 ]; then SUDO=(); else SUDO=(sudo); fi
export DEBIAN_FRONTEND=noninteractive

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "vm-deps: all ${#PKGS[@]} packages already installed"
  exit 0
fi

echo "vm-deps: installing: ${missing[*]}"
# Update the index only if installing fails without it (fresh machine: empty lists).
if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; then
  "${SUDO[@]}" apt-get update -q
  "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
