#!/usr/bin/env bash
# Install what deploy/image/build.sh and deploy/image/smoke.sh need, from Debian's
# package registry only (no container registry, no Docker engine):
#   mmdebstrap      the Debian root filesystem (base layer), straight to a tarball
#   arch-test       lets mmdebstrap check that foreign-arch binaries run
#   umoci           OCI image layout: layers, config, tags (no daemon)
#   skopeo          checks the OCI archive and writes the docker-archive copy
#   qemu-user-static + binfmt-support
#                   run arm64 programs (dpkg maintainer scripts, pip, the service)
#                   on an x86-64 build machine; the `F` (fix-binary) flag means the
#                   interpreter works inside chroots too
# and makes sure the kernel's binfmt_misc is mounted and the qemu handler enabled.
# Idempotent: installs only what is missing. Works as root; uses sudo otherwise.
set -euo pipefail

#   gcc-aarch64-linux-gnu + libc6-dev-arm64-cross
#                   cross-compile the native CRC32C helper for the arm64 image
PKGS=(mmdebstrap arch-test umoci skopeo qemu-user-static binfmt-support ca-certificates
      gcc-aarch64-linux-gnu libc6-dev-arm64-cross)

if [ "$(id -u)" -eq 0 ]; then SUDO=(); else SUDO=(sudo); fi
export DEBIAN_FRONTEND=noninteractive

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "image-deps: installing: ${missing[*]}"
  if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
else
  echo "image-deps: all ${#PKGS[@]} packages already installed"
fi

# binfmt_misc: needed only to run binaries of the other architecture. In a container
# the mount may be refused; build.sh then reports what is missing for a foreign arch.
BINFMT=/proc/sys/fs/binfmt_misc
if [ ! -e "$BINFMT/status" ]; then
  "${SUDO[@]}" mount -t binfmt_misc binfmt_misc "$BINFMT" 2>/dev/null \
    || echo "image-deps: could not mount binfmt_misc (foreign-arch builds will fail)" >&2
fi
host_arch="$(dpkg --print-architecture)"
want=()
case "$host_arch" in
  amd64) want=(qemu-aarch64) ;;
  arm64) want=(qemu-x86_64) ;;
esac
for h in "${want[@]}"; do
  if [ -e "$BINFMT/status" ] && [ ! -e "$BINFMT/$h" ]; then
    "${SUDO[@]}" update-binfmts --enable "$h" 2>/dev/null \
      || echo "image-deps: could not enable binfmt handler $h" >&2
  fi
  if [ -e "$BINFMT/$h" ]; then
    echo "image-deps: binfmt $h: $(head -n1 "$BINFMT/$h")"
  fi
done
