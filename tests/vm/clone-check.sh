#!/usr/bin/env bash
# Proof that a checkout under /tmp passes the guest stage: git-clone this checkout into a
# fresh directory under /tmp, give the clone its own .venv (a venv made there that
# borrows the installed packages of VENV through a .pth, so nothing is downloaded), and
# run tests/vm/test_vm_paths.py in the QEMU guest from the clone (one guest boot, about
# 1-2 minutes under TCG). The guest hides /tmp behind tmpfs, so this passes only when
# run.sh mounts the repo by its own share.
#
#   bash tests/vm/clone-check.sh [VENV]     (VENV: default <repo>/.venv)
#
# The clone has what is committed (git clone), not uncommitted changes.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=$(cd "${1:-$repo/.venv}" && pwd -P)
[ -x "$venv/bin/python" ] || { echo "clone-check: no python in $venv" >&2; exit 2; }
tmp=$(mktemp -d /tmp/ctxmem-clone.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
clone=$tmp/ctxmem
git clone -q --no-hardlinks "$repo" "$clone"
read -r base site pyver < <("$venv/bin/python" -c \
  'import sys, sysconfig; print(sys._base_executable, sysconfig.get_path("purelib"), "%d.%d" % sys.version_info[:2])')
"$base" -m venv --without-pip "$clone/.venv"
echo "$site" > "$clone/.venv/lib/python$pyver/site-packages/ctxmem-borrowed.pth"
cd "$clone"
# VENV's packages are shared too, in case VENV itself lives under /tmp.
CTXMEM_VM_SHARES="$venv ${CTXMEM_VM_SHARES:-}" \
CTXMEM_VM_EXPECT_REPO=$clone CTXMEM_VM_EXPECT_PREFIX=$clone/.venv \
CTXMEM_VM_PASSENV="CTXMEM_VM_EXPECT_REPO CTXMEM_VM_EXPECT_PREFIX" \
CTXMEM_VM_OUT_DIR=${CTXMEM_VM_OUT_DIR:-$tmp/out} CTXMEM_VM_TIMEOUT=${CTXMEM_VM_TIMEOUT:-900} \
  bash tests/vm/run.sh .venv/bin/python -m pytest -q -m vm \
  tests/vm/test_vm_paths.py
