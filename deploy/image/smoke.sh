#!/usr/bin/env bash
# The arm64 image smoke test, end to end: install the tools (Debian packages), build the
# image (cached: the base root filesystem and the wheels are reused from
# $CTXMEM_CACHE/image), then run tests/deploy/test_image_arm64.py, which starts the
# image's service under qemu-aarch64 (binfmt_misc) and drives a put/get round trip from
# this machine's x86-64 shim over TCP.
#
#   deploy/image/smoke.sh [--arch arm64|amd64] [--out DIR] [--no-build]
#
# --no-build reuses an image already in --out. Needs root. Exit status is pytest's.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
ARCH=arm64
OUT="$REPO/out/image"
BUILD=1
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "smoke.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done

VERSION="$(sed -n '/^\[project\]/,/^\[/s/^version *= *"\([^"]*\)".*/\1/p' "$REPO/pyproject.toml")"
IMAGE="$OUT/ctxmem-$VERSION-$ARCH.oci.tar"

bash "$HERE/deps.sh"
if [ "$BUILD" -eq 1 ]; then
  t0=$(date +%s)
  nice -n 10 bash "$HERE/build.sh" --arch "$ARCH" --out "$OUT"
  echo "smoke: image built in $(( $(date +%s) - t0 )) s: $IMAGE ($(du -h "$IMAGE" | cut -f1))"
fi
[ -f "$IMAGE" ] || { echo "smoke.sh: no image at $IMAGE" >&2; exit 1; }

if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY="${PYTHON:-python3}"; fi
cd "$REPO"
CTXMEM_IMAGE_TEST=1 CTXMEM_IMAGE="$IMAGE" CTXMEM_IMAGE_ARCH="$ARCH" \
  "$PY" -m pytest -m slow -v -s -p no:cacheprovider tests/deploy/test_image_arm64.py
