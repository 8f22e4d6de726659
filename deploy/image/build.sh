#!/usr/bin/env bash
# Build the ctxmem service image without a container registry or a Docker engine.
#
#   deploy/image/build.sh --arch arm64|amd64 [--out DIR] [options]
#
# Steps (see docs/deploy.md, "Building the image"):
#   1. base layer: a minimal Debian root filesystem made by mmdebstrap from Debian's
#      package registry (foreign arch through qemu-user-static + binfmt_misc), written
#      straight to a tarball and cached under $CTXMEM_CACHE/image/rootfs/, keyed by
#      suite, arch and the package list;
#   2. wheels: the project's wheel is built on the build host from a clean copy of the
#      source tree (git-tracked + untracked-not-ignored files); its dependencies are
#      downloaded as binary wheels for the target (manylinux, the image's CPython) into
#      $CTXMEM_CACHE/image/wheels/, which later builds reuse;
#   3. app layer: umoci unpacks the base, the image's own python3 (emulated for a
#      foreign arch) makes /opt/ctxmem/venv and pip-installs the wheels offline, the
#      `ctxmem` user (uid/gid 10001) and its directories are added; umoci repacks the
#      difference as a second layer;
#   4. config: entrypoint tini -> ctxmem, cmd `serve --config /etc/ctxmem/ctxmem.yaml`,
#      user 10001:10001, ports 50051 (gRPC), 50052 (TCP data), 9464 (metrics/health);
#   5. output: OUT/ctxmem-VERSION-ARCH.oci.tar (an OCI image layout in a tar, tag
#      VERSION-ARCH; `skopeo ... oci-archive:FILE`, `ctr images import --base-name`,
#      `podman load`), a JSON build record, and with --docker-archive also
#      OUT/ctxmem-VERSION-ARCH.docker.tar (RepoTags ctxmem:VERSION-ARCH; `docker load`).
#
# Must run as root (mmdebstrap root mode, chroot, umoci unpack keeping ownership).
# Run deploy/image/deps.sh first. Environment: CTXMEM_CACHE (default ~/.cache/ctxmem),
# CTXMEM_DEBIAN_MIRROR (default http://deb.debian.org/debian), CTXMEM_DEBIAN_SECURITY
# (default http://deb.debian.org/debian-security; "none" to leave it out), PYTHON (the
# build host's Python with pip, default python3).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: deploy/image/build.sh --arch arm64|amd64 [--out DIR] [--suite SUITE]
                             [--extras LIST] [--wheels DIR] [--tag TAG]
                             [--refresh-base] [--docker-archive] [--keep-work]
  --arch           target architecture (arm64 for BlueField, amd64 for fallback hosts)
  --out            output directory (default: ./out/image)
  --suite          Debian suite of the base (default: bookworm)
  --extras         comma-separated extras of the ctxmem distribution (default: spdk);
                   "rdma" needs a pyverbs wheel for the target in --wheels
  --wheels         extra directory of target wheels (e.g. a pyverbs aarch64 wheel)
  --tag            image tag (default: VERSION-ARCH, VERSION from pyproject.toml)
  --refresh-base   rebuild the cached base root filesystem
  --docker-archive also write a docker-archive tarball (uncompressed layers, ~3x the
                   size) for `docker load` and older `ctr images import`
  --keep-work      keep the work directory (bundle, layout) for inspection
EOF
}

ARCH=""
OUT=""
SUITE="bookworm"
EXTRAS="spdk"
EXTRA_WHEELS=""
TAG=""
REFRESH_BASE=0
DOCKER_ARCHIVE=0
KEEP_WORK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --suite) SUITE="$2"; shift 2 ;;
    --extras) EXTRAS="$2"; shift 2 ;;
    --wheels) EXTRA_WHEELS="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    --refresh-base) REFRESH_BASE=1; shift ;;
    --docker-archive) DOCKER_ARCHIVE=1; shift ;;
    --keep-work) KEEP_WORK=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done

case "$ARCH" in
  arm64) MARCH=aarch64; QEMU_HANDLER=qemu-aarch64 ;;
  amd64) MARCH=x86_64; QEMU_HANDLER=qemu-x86_64 ;;
  *) echo "build.sh: --arch must be arm64 or amd64" >&2; usage >&2; exit 2 ;;
esac
case "$SUITE" in
  bookworm) GLIBC_MINOR=36 ;;
  trixie) GLIBC_MINOR=41 ;;
  *) GLIBC_MINOR=${CTXMEM_GLIBC_MINOR:-28} ;;
esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$REPO/out/image}"
CACHE="${CTXMEM_CACHE:-$HOME/.cache/ctxmem}/image"
MIRROR="${CTXMEM_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY="${CTXMEM_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}"
PYTHON="${PYTHON:-python3}"

log() { printf '[build %s %s] %s\n' "$ARCH" "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'build.sh: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap root mode, chroot, umoci unpack)"
for tool in mmdebstrap umoci tar sha256sum chroot; do
  command -v "$tool" >/dev/null || die "$tool not found: run deploy/image/deps.sh"
done
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip (set PYTHON=)"

HOST_ARCH="$(dpkg --print-architecture)"
if [ "$HOST_ARCH" != "$ARCH" ]; then
  BINFMT=/proc/sys/fs/binfmt_misc
  if ! grep -qs '^enabled' "$BINFMT/$QEMU_HANDLER"; then
    die "no binfmt_misc handler $QEMU_HANDLER for a foreign-arch build: run deploy/image/deps.sh"
  fi
  grep -qs '^flags:.*F' "$BINFMT/$QEMU_HANDLER" \
    || die "binfmt handler $QEMU_HANDLER lacks the F flag (install qemu-user-static)"
fi

VERSION="$("$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print(tomllib.load(f)["project"]["version"])
EOF
)"
TAG="${TAG:-$VERSION-$ARCH}"
NAME="ctxmem"
T0=$(date +%s)

mkdir -p "$OUT" "$CACHE/rootfs" "$CACHE/wheels" "$CACHE/pip"
WORK="$(mktemp -d "${TMPDIR:-/var/tmp}/ctxmem-image.XXXXXX")"
ROOTFS=""          # set once the bundle is unpacked
MOUNTED=()

unmount_all() {
  local m
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    m="${MOUNTED[$i]}"
    if mountpoint -q "$m"; then umount "$m" || umount -l "$m" || true; fi
  done
  MOUNTED=()
}
cleanup() {
  unmount_all
  # Never delete through a mount point: check again before removing anything.
  if [ -n "$ROOTFS" ] && { mountpoint -q "$ROOTFS/proc" || mountpoint -q "$ROOTFS/dev"; }; then
    echo "build.sh: leaving $WORK (a mount is still active)" >&2
    return
  fi
  if [ "$KEEP_WORK" -eq 1 ]; then
    echo "build.sh: work directory kept: $WORK" >&2
  else
    rm -rf --one-file-system "$WORK"
  fi
}
trap cleanup EXIT

# On a terminal: "[i/5] STEP — elapsed, ETA" lines from the last run's step timings
# (deploy/image/progress.sh); quiet in CI and when stderr is not a terminal.
# shellcheck source=deploy/image/progress.sh
. "$HERE/progress.sh"
progress_init "$CACHE/timings-$ARCH.txt" base wheels layers config output

# ---------------------------------------------------------------- 1. base layer
progress_step base
# Runtime packages of the image. python3-venv brings ensurepip (pip for the venv);
# tini reaps and forwards signals as PID 1; libibverbs1/ibverbs-providers/librdmacm1
# are what pyverbs (the `rdma` extra) loads; nvme-cli serves the kernel NVMe-oF backend.
BASE_PKGS=(python3 python3-venv tini ca-certificates libibverbs1 ibverbs-providers librdmacm1 nvme-cli)
BASE_RECIPE_VERSION=1   # bump when the mmdebstrap options below change
base_key="$(printf '%s\n' "$BASE_RECIPE_VERSION" "$SUITE" "$ARCH" "$MIRROR" "$SECURITY" "${BASE_PKGS[@]}" \
  | sha256sum | cut -c1-12)"
BASE_TAR="$CACHE/rootfs/debian-$SUITE-$ARCH-$base_key.tar"

build_base() {
  local tmp="$BASE_TAR.partial.$$"
  local sources=("deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main")
  if [ "$SECURITY" != "none" ]; then sources+=("deb $SECURITY $SUITE-security main"); fi
  local includes
  includes="$(IFS=,; echo "${BASE_PKGS[*]}")"
  log "base: mmdebstrap $SUITE/$ARCH (+$includes)"
  mmdebstrap --mode=root --variant=minbase --arch="$ARCH" --format=tar \
    --include="$includes" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -f "$1"/etc/machine-id "$1"/var/log/*.log "$1"/var/cache/ldconfig/aux-cache' \
    "$SUITE" "$tmp" "${sources[@]}"
  mv "$tmp" "$BASE_TAR"
}

t_base0=$(date +%s)
exec 9>"$CACHE/rootfs/.lock"
flock 9
if [ "$REFRESH_BASE" -eq 1 ] || [ ! -s "$BASE_TAR" ]; then
  rm -f "$BASE_TAR" "$BASE_TAR".partial.*
  build_base
  BASE_CACHED=False
else
  log "base: cached $BASE_TAR"
  BASE_CACHED=True
fi
flock -u 9
t_base=$(( $(date +%s) - t_base0 ))

# The image's CPython decides which wheels fit it.
# (sort reads everything: `head` would cut tar off with SIGPIPE, fatal under pipefail)
PYBIN="$(tar -tf "$BASE_TAR" | sed -n 's#^\./usr/bin/\(python3\.[0-9][0-9]*\)$#\1#p' | sort -V | tail -n1)"
[ -n "$PYBIN" ] || die "no python3.X in $BASE_TAR"
PYVER="${PYBIN#python}"            # e.g. 3.11
PYTAG="cp${PYVER/./}"              # e.g. cp311
log "base: $PYBIN ($PYTAG), glibc 2.$GLIBC_MINOR"

# ---------------------------------------------------------------- 2. wheels
progress_step wheels
t_wheels0=$(date +%s)
SRC="$WORK/src"
mkdir -p "$SRC" "$WORK/wheels"
# A clean copy of the source (what a fresh clone has), so the build never writes
# build/ or *.egg-info into the working tree.
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$REPO" ls-files -z --cached --others --exclude-standard \
    | (cd "$REPO" && xargs -0 -r cp --parents -t "$SRC" 2>/dev/null || true)
else
  (cd "$REPO" && tar --exclude=./.venv --exclude=./out --exclude=./.git -cf - .) | tar -C "$SRC" -xf -
fi
[ -f "$SRC/pyproject.toml" ] || die "source copy has no pyproject.toml"
# The native CRC32C helper (setup.py; the ARMv8 CRC32C instructions on a BlueField) is
# C: on the image's own architecture the wheel is built as usual (cp311-abi3); for another
# one it is cross-compiled with Debian's ${MARCH}-linux-gnu-gcc (deploy/image/deps.sh
# installs it), against this host's Python headers: the limited API's structures are the
# same on every 64-bit little-endian Linux, and the image's python3.11 loads the module
# (its service logs "CRC32C native/armv8-crc" at start). Without that compiler the wheel is
# py3-none-any and the image runs the pure path ("CRC32C pure": the crc32c package).
wheel_env=(CTXMEM_BUILD_NATIVE=1)
wheel_opts=()
if [ "$(uname -m)" = "$MARCH" ]; then
  native="yes"
elif command -v "$MARCH-linux-gnu-gcc" >/dev/null; then
  native="yes, cross-compiled with $MARCH-linux-gnu-gcc"
  wheel_env+=(CC="$MARCH-linux-gnu-gcc" LDSHARED="$MARCH-linux-gnu-gcc -shared")
  wheel_opts=(-C--build-option=--plat-name=linux_$MARCH)
else
  native="NO: no $MARCH-linux-gnu-gcc (run deploy/image/deps.sh); the image gets the pure path"
  wheel_env=(CTXMEM_BUILD_NATIVE=0)
fi
log "wheels: building the ctxmem-kv wheel (native CRC32C helper: $native)"
env "${wheel_env[@]}" PIP_CACHE_DIR="$CACHE/pip" "$PYTHON" -m pip wheel --quiet --no-deps \
  "${wheel_opts[@]}" -w "$WORK/wheels" "$SRC"
# The distribution is ctxmem-kv (pyproject.toml): its wheel is
# ctxmem_kv-VERSION-cp311-abi3-linux_ARCH.whl (py3-none-any without the native helper).
built=("$WORK"/wheels/ctxmem_kv-*.whl)
CTX_WHEEL="${built[0]}"
[ -f "$CTX_WHEEL" ] || die "the ctxmem_kv wheel was not built in $WORK/wheels"

WHEELHOUSE="$CACHE/wheels/$PYTAG-manylinux-$MARCH"
mkdir -p "$WHEELHOUSE"
platforms=()
for ((y = GLIBC_MINOR; y >= 17; y--)); do platforms+=(--platform "manylinux_2_${y}_${MARCH}"); done
platforms+=(--platform "manylinux2014_${MARCH}")
# (and linux_ARCH: the project's own wheel, with the native helper, carries that tag)
platforms+=(--platform "linux_${MARCH}")
# Name the wheel by path: by name it would resolve against the index (and "ctxmem", the
# old distribution name, is another project there).
req="$CTX_WHEEL"
[ -n "$EXTRAS" ] && req="$CTX_WHEEL[$EXTRAS]"
find_links=(--find-links "$WORK/wheels" --find-links "$WHEELHOUSE")
[ -n "$EXTRA_WHEELS" ] && find_links+=(--find-links "$EXTRA_WHEELS")
# pip download evaluates environment markers against THIS interpreter, not the image's:
# a dependency behind a marker the image's CPython meets but ours does not is named here.
# redis needs async-timeout on Python < 3.11.3; Debian 12's python3.11 is 3.11.2.
marker_deps=("async-timeout>=4.0.3")
log "wheels: resolving ctxmem[$EXTRAS] deps for $PYTAG/$MARCH into $WHEELHOUSE"
PIP_CACHE_DIR="$CACHE/pip" "$PYTHON" -m pip download --quiet \
  --only-binary=:all: "${platforms[@]}" \
  --python-version "$PYVER" --implementation cp --abi "$PYTAG" \
  "${find_links[@]}" -d "$WHEELHOUSE" "$req" "${marker_deps[@]}" \
  || die "could not get binary wheels for ctxmem[$EXTRAS] on $PYTAG/$MARCH (for the rdma extra, pass --wheels DIR with a pyverbs wheel)"
# The wheelhouse may now hold a ctxmem wheel copied from WORK; the install below
# takes the fresh one by path, and the stale copy is dropped so it never wins.
rm -f "$WHEELHOUSE"/ctxmem_kv-*.whl "$WHEELHOUSE"/ctxmem-*.whl
t_wheels=$(( $(date +%s) - t_wheels0 ))

# ---------------------------------------------------------------- 3. layers
progress_step layers
t_layers0=$(date +%s)
LAYOUT="$WORK/oci"
BUNDLE="$WORK/bundle"
umoci init --layout "$LAYOUT"
umoci new --image "$LAYOUT:$TAG"
log "layers: base layer ($(du -h "$BASE_TAR" | cut -f1))"
umoci raw add-layer --image "$LAYOUT:$TAG" \
  --history.created_by "mmdebstrap --variant=minbase $SUITE $ARCH: ${BASE_PKGS[*]}" \
  --history.comment "ctxmem base layer" "$BASE_TAR"
umoci unpack --image "$LAYOUT:$TAG" "$BUNDLE" >/dev/null
ROOTFS="$BUNDLE/rootfs"

in_root() {
  # Run a command chrooted into the image with /proc mounted for its duration only.
  mount -t proc proc "$ROOTFS/proc"
  MOUNTED+=("$ROOTFS/proc")
  local rc=0
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    chroot "$ROOTFS" "$@" || rc=$?
  unmount_all
  return "$rc"
}

# /dev: mmdebstrap's tarball carries the basic device nodes; make sure of /dev/null.
[ -c "$ROOTFS/dev/null" ] || { rm -f "$ROOTFS/dev/null"; mknod -m 666 "$ROOTFS/dev/null" c 1 3; }

log "layers: venv + pip install (ctxmem[$EXTRAS]) inside the image"
mkdir -p "$ROOTFS/tmp/wheels"
cp "$WHEELHOUSE"/*.whl "$CTX_WHEEL" "$ROOTFS/tmp/wheels/"
[ -n "$EXTRA_WHEELS" ] && cp "$EXTRA_WHEELS"/*.whl "$ROOTFS/tmp/wheels/" 2>/dev/null || true
wheel_name="$(basename "$CTX_WHEEL")"
if [ -n "$EXTRAS" ]; then inst="/tmp/wheels/$wheel_name[$EXTRAS]"; else inst="/tmp/wheels/$wheel_name"; fi
t_pip0=$(date +%s)
in_root "/usr/bin/$PYBIN" -m venv /opt/ctxmem/venv
in_root /opt/ctxmem/venv/bin/pip install --no-index --find-links /tmp/wheels \
  --no-cache-dir --disable-pip-version-check --quiet "$inst"
t_pip=$(( $(date +%s) - t_pip0 ))
rm -rf "$ROOTFS/tmp/wheels"
in_root /opt/ctxmem/venv/bin/python -c "import ctxmem_common" \
  || die "ctxmem_common does not import inside the image"
# The service's entry point; a tree without it yet (work in progress) still builds.
if ! in_root /opt/ctxmem/venv/bin/ctxmem serve --help >/dev/null 2>&1; then
  log "layers: WARNING: 'ctxmem serve --help' fails inside the image (service not complete?)"
fi

log "layers: user ctxmem (10001) and directories"
in_root groupadd --system --gid 10001 ctxmem
in_root useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/ctxmem \
  --no-create-home --shell /usr/sbin/nologin ctxmem
install -d -m 0755 "$ROOTFS/etc/ctxmem"
install -d -m 0750 -o 10001 -g 10001 "$ROOTFS/etc/ctxmem/keys"
install -d -m 0750 -o 10001 -g 10001 "$ROOTFS/var/lib/ctxmem" "$ROOTFS/run/ctxmem"
install -d -m 0755 "$ROOTFS/usr/share/ctxmem/configs"
install -m 0644 "$REPO"/deploy/configs/*.yaml "$ROOTFS/usr/share/ctxmem/configs/"
ln -sf /opt/ctxmem/venv/bin/ctxmem "$ROOTFS/usr/local/bin/ctxmem"
cat > "$ROOTFS/etc/ctxmem/README" <<'EOF'
Mount the service config at /etc/ctxmem/ctxmem.yaml and the master key at
/etc/ctxmem/keys/master.key (or set CTXMEM_MASTER_KEY and key_env in the config).
Examples: /usr/share/ctxmem/configs/. Docs: docs/deploy.md in the ctxmem repository.
EOF
rm -rf "$ROOTFS/root/.cache" "$ROOTFS/var/cache/debconf"/*-old "$ROOTFS/tmp"/* "$ROOTFS/var/tmp"/*
[ -z "$(ls -A "$ROOTFS/proc")" ] || die "$ROOTFS/proc is not empty after unmount"

log "layers: repack the application layer"
umoci repack --image "$LAYOUT:$TAG" \
  --history.created_by "deploy/image/build.sh: venv /opt/ctxmem/venv (ctxmem[$EXTRAS]), user ctxmem" \
  --history.comment "ctxmem application layer" "$BUNDLE"
t_layers=$(( $(date +%s) - t_layers0 ))

# ---------------------------------------------------------------- 4. config
progress_step config
created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
revision="$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
umoci config --image "$LAYOUT:$TAG" \
  --architecture "$ARCH" --os linux --created "$created" --author "ctxmem" \
  --config.user 10001:10001 \
  --config.entrypoint /usr/bin/tini --config.entrypoint -- \
  --config.entrypoint /opt/ctxmem/venv/bin/ctxmem \
  --config.cmd serve --config.cmd --config --config.cmd /etc/ctxmem/ctxmem.yaml \
  --config.env PATH=/opt/ctxmem/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env PYTHONUNBUFFERED=1 --config.env PYTHONDONTWRITEBYTECODE=1 \
  --config.env LANG=C.UTF-8 \
  --config.workingdir /var/lib/ctxmem \
  --config.exposedports 50051/tcp --config.exposedports 50052/tcp \
  --config.exposedports 9464/tcp \
  --config.volume /var/lib/ctxmem \
  --config.stopsignal SIGTERM \
  --config.label "org.opencontainers.image.title=ctxmem" \
  --config.label "org.opencontainers.image.version=$VERSION" \
  --config.label "org.opencontainers.image.revision=$revision" \
  --config.label "org.opencontainers.image.created=$created" \
  --config.label "org.opencontainers.image.base.name=debian:$SUITE" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0" \
  --manifest.annotation "org.opencontainers.image.version=$VERSION" \
  --history.created_by "deploy/image/build.sh: entrypoint, user, ports" \
  --history.comment "ctxmem config"
umoci gc --layout "$LAYOUT"

# ---------------------------------------------------------------- 5. output
progress_step output
OCI_TAR="$OUT/$NAME-$TAG.oci.tar"
DOCKER_TAR="$OUT/$NAME-$TAG.docker.tar"
rm -f "$OCI_TAR" "$DOCKER_TAR"
tar -C "$LAYOUT" --sort=name --owner=0 --group=0 --numeric-owner -cf "$OCI_TAR.partial" \
  oci-layout index.json blobs
mv "$OCI_TAR.partial" "$OCI_TAR"
log "output: $OCI_TAR"
if [ "$DOCKER_ARCHIVE" -eq 1 ]; then
  if command -v skopeo >/dev/null; then
    skopeo --insecure-policy copy --quiet "oci:$LAYOUT:$TAG" \
      "docker-archive:$DOCKER_TAR:$NAME:$TAG"
    log "output: $DOCKER_TAR"
  else
    log "output: skopeo not found, no docker-archive written"
  fi
fi

T1=$(date +%s)
"$PYTHON" - "$LAYOUT" "$OCI_TAR" "$OUT/$NAME-$TAG.build.json" <<EOF
import json, os, sys
layout, oci_tar, record = sys.argv[1:4]
index = json.load(open(os.path.join(layout, "index.json")))
desc = index["manifests"][0]
blob = lambda d: os.path.join(layout, "blobs", *d["digest"].split(":"))
manifest = json.load(open(blob(desc)))
layers = manifest["layers"]
json.dump({
    "name": "$NAME", "tag": "$TAG", "version": "$VERSION", "arch": "$ARCH",
    "suite": "$SUITE", "python": "$PYBIN", "extras": "$EXTRAS",
    "manifest_digest": desc["digest"],
    "layers": [{"digest": l["digest"], "size": l["size"]} for l in layers],
    "compressed_size": sum(l["size"] for l in layers),
    "oci_archive": oci_tar, "oci_archive_size": os.path.getsize(oci_tar),
    "base_cached": $BASE_CACHED,
    "seconds": {"total": $T1 - $T0, "base": $t_base, "wheels": $t_wheels,
                "layers": $t_layers, "pip_in_image": $t_pip},
}, open(record, "w"), indent=2)
print(open(record).read())
EOF
progress_finish
log "done in $((T1 - T0)) s"
