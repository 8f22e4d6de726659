#!/usr/bin/env bash
# Build SPDK (spdk_tgt, spdk_dd and their shared libraries) from the vendored source
# tarballs against Debian 12's DPDK, ISA-L and liburing, and cache the result.
#
#   deploy/ci/spdk-build.sh            # prints the cached SPDK prefix on its last line
#   deploy/ci/spdk-build.sh --print    # only print the prefix if it is cached (exit 1 if not)
#
# Source: SPDK at commit 3230130e and ISA-L crypto (software AES-XTS for SPDK's accel
# framework), as tarballs in ${CTXMEM_VENDOR_DIR:-<repo>/../shared/vendor}/{spdk,isa-l_crypto}/.
# Nothing of SPDK's source enters this repository: the tarballs are unpacked into a
# scratch directory under the cache, the few changes a Debian 12 build needs are applied
# there by this script (each with a comment saying why), and only the built binaries and
# libraries are kept.
#
# Cache: ${CTXMEM_CACHE:-$HOME/.cache/ctxmem}/spdk/<key>/ where key digests the two
# tarballs' sha256, the recipe number below and the Debian versions of the libraries SPDK
# links against. A run that finds <key>/.ok builds nothing. Layout of a cached prefix:
#   bin/spdk_tgt bin/spdk_dd     lib/*.so* (SPDK + ISA-L crypto)     env.sh
# Run the binaries with LD_LIBRARY_PATH=<prefix>/lib (SPDK's RUNPATH lacks its own lib dir).
#
# Build (2 cores, nice 19): ISA-L crypto about 4 min, SPDK about 4 min; see
# docs/testing.md for the measured cold and warm times. Needs the Debian packages that
# deploy/ci/vm-deps.sh installs (libdpdk-dev libisal-dev liburing-dev nasm ...).
# Facts behind every flag and change: ../shared/notes/spdk-build.md.
set -euo pipefail

# Bump when the way SPDK is built changes (invalidates the cache).
RECIPE=2
SPDK_TARBALL=spdk/spdk-3230130e.tar.xz
ISAL_CRYPTO_TARBALL=isa-l_crypto/isa-l_crypto-2.26-5-gad5aab1.tar.xz
# Debian packages whose libraries the build links against (their versions key the cache).
LINKED_PKGS=(libdpdk-dev libisal-dev liburing-dev libssl-dev libnuma-dev libaio-dev libfuse3-dev
             libibverbs-dev librdmacm-dev)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}
jobs=${CTXMEM_BUILD_JOBS:-$(nproc)}

log() { echo "spdk-build: $*" >&2; }
die() { log "error: $*"; exit 2; }

print_only=0
case "${1:-}" in
  --print) print_only=1 ;;
  "") ;;
  *) die "unknown argument $1 (usage: spdk-build.sh [--print])" ;;
esac

vendor=${CTXMEM_VENDOR_DIR:-$repo/../shared/vendor}
for t in "$SPDK_TARBALL" "$ISAL_CRYPTO_TARBALL"; do
  [ -f "$vendor/$t" ] || die "missing $vendor/$t: SPDK is built from the vendored tarballs \
beside the repository (<repo>/../shared/vendor); set CTXMEM_VENDOR_DIR to the folder that holds \
spdk/ and isa-l_crypto/"
done
vendor=$(cd "$vendor" && pwd)

pkg_versions() {
  dpkg-query -W -f='${Package}=${Version}\n' "${LINKED_PKGS[@]}" 2>/dev/null || true
}

key=$( {
  echo "recipe=$RECIPE"
  sha256sum "$vendor/$SPDK_TARBALL" "$vendor/$ISAL_CRYPTO_TARBALL" | awk '{print $1}'
  pkg_versions
} | sha256sum | cut -c1-16)
prefix=$cache/spdk/$key

if [ -f "$prefix/.ok" ]; then
  log "cached $prefix"
  echo "$prefix"
  exit 0
fi
[ "$print_only" = 0 ] || { log "no cached SPDK build for key $key in $cache/spdk"; exit 1; }

mkdir -p "$cache/spdk" "$cache/build"
# One build at a time per cache (a second caller waits, then finds the prefix).
exec 9>"$cache/spdk/.build.lock"
flock 9
if [ -f "$prefix/.ok" ]; then
  log "cached $prefix (built by a concurrent run)"
  echo "$prefix"
  exit 0
fi

missing=()
for p in "${LINKED_PKGS[@]}" uuid-dev libncurses-dev libkeyutils-dev nasm autoconf automake \
         libtool make gcc python3-yaml python3-jinja2 python3-tabulate xz-utils; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
[ "${#missing[@]}" -eq 0 ] || die "Debian packages missing: ${missing[*]} (run deploy/ci/vm-deps.sh)"

start=$(date +%s)
tmp=$(mktemp -d "$cache/build/spdk-$key.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
log "building SPDK (key $key) in $tmp: $jobs jobs, about 8 minutes on 2 cores"

# SPDK's genrpc.py runs as `/usr/bin/env python3` during make and needs Debian's
# python3-yaml/jinja2/tabulate: keep a pyenv (or venv) python3 from shadowing it.
export PATH=/usr/bin:/bin:$PATH

tar -xJf "$vendor/$ISAL_CRYPTO_TARBALL" -C "$tmp"
tar -xJf "$vendor/$SPDK_TARBALL" -C "$tmp"
isal_src=$(find "$tmp" -mindepth 1 -maxdepth 1 -type d -name 'isa-l_crypto*' | head -n1)
spdk_src=$(find "$tmp" -mindepth 1 -maxdepth 1 -type d -name 'spdk*' | head -n1)
[ -n "$isal_src" ] && [ -n "$spdk_src" ] || die "unexpected tarball layout in $tmp"

# 1. ISA-L crypto into a scratch prefix.
isal=$tmp/isal-crypto-prefix
t0=$(date +%s)
(
  cd "$isal_src"
  ./autogen.sh >"$tmp/isal-autogen.log" 2>&1
  # --libdir=lib64: SPDK's mk/spdk.common.mk hard-codes <dir>/lib64 for --with-isal-crypto.
  ./configure --prefix="$isal" --libdir="$isal/lib64" CFLAGS="-fPIC -g -O2" >"$tmp/isal-configure.log" 2>&1
  nice -n 19 make -j"$jobs" >"$tmp/isal-make.log" 2>&1
  make install >"$tmp/isal-install.log" 2>&1
) || { tail -n 40 "$tmp"/isal-*.log >&2; die "ISA-L crypto build failed (logs above)"; }
# SPDK includes <isa-l-crypto/aes_xts.h> (hyphen); ISA-L crypto installs isa-l_crypto/.
ln -s isa-l_crypto "$isal/include/isa-l-crypto"
log "ISA-L crypto built in $(( $(date +%s) - t0 )) s"

# 2. SPDK: changes for Debian 12, applied to the scratch copy only.
cd "$spdk_src"
patch_line() { # FILE SED-EXPR WHY: apply and check that the expression changed FILE
  local before
  before=$(sha256sum "$1")
  sed -i "$2" "$1"
  [ "$(sha256sum "$1")" != "$before" ] || die "build change did not apply to $1 ($3): SPDK source changed?"
}
# Debian's ISA-L 2.30 <isa-l/crc64.h> lacks crc64_rocksoft_refl: use SPDK's own table
# implementation (the file's #else branch).
patch_line lib/util/crc64.c \
  's|^#ifdef SPDK_CONFIG_ISAL$|#if 0 /* Debian ISA-L 2.30 lacks crc64_rocksoft_refl: use the table fallback */|' \
  "crc64 table fallback"
# SPDK rejects DPDK 22.11.x with minor > 4 at run time; Debian ships 22.11.11. The LTS
# line keeps its private ABI, so keep fn_table_2211 for every 22.11.x.
patch_line lib/env_dpdk/pci_dpdk.c \
  's|if (minor > 4) {|if (0 \&\& minor > 4) { /* allow Debian 22.11.x LTS */|' \
  "DPDK 22.11.x"
# env.mk links rte_log and rte_argparse, which Debian's DPDK 22.11 does not have:
# keep only the DPDK libraries that exist.
patch_line lib/env_dpdk/env.mk \
  's|^DPDK_LIB_LIST_SORTED = \$(sort \$(DPDK_LIB_LIST))$|DPDK_LIB_LIST := $(foreach l,$(DPDK_LIB_LIST),$(if $(wildcard $(DPDK_LIB_DIR)/lib$(l).so),$(l)))\n&|' \
  "DPDK library list"

t0=$(date +%s)
# --with-rdma: NVMe-oF over RDMA (Soft-RoCE in the guest) against Debian's rdma-core;
# --with-crypto: bdev_crypto; software AES-XTS comes from ISA-L crypto (accel_sw).
./configure --with-shared --with-dpdk=/usr --with-isal=/usr --with-isal-crypto="$isal" \
  --with-rdma --with-crypto --with-ublk --disable-unit-tests --disable-tests --disable-examples \
  >"$tmp/spdk-configure.log" 2>&1 || { tail -n 40 "$tmp/spdk-configure.log" >&2; die "SPDK configure failed"; }
# CONFIG_IPSEC_MB=n: configure turns it on because Debian's DPDK was built with it, and
# the top Makefile would then build the absent intel-ipsec-mb submodule.
nice -n 19 make -j"$jobs" CONFIG_IPSEC_MB=n >"$tmp/spdk-make.log" 2>&1 \
  || { grep -n -m 20 -E 'error|Error' "$tmp/spdk-make.log" >&2 || true; tail -n 30 "$tmp/spdk-make.log" >&2; die "SPDK make failed"; }
log "SPDK built in $(( $(date +%s) - t0 )) s"

# 3. Keep only what runs: the binaries, SPDK's and ISA-L crypto's shared libraries.
stage=$tmp/prefix
mkdir -p "$stage/bin" "$stage/lib"
for b in spdk_tgt spdk_dd; do cp -a "build/bin/$b" "$stage/bin/"; done
cp -a build/lib/*.so* "$stage/lib/"
cp -a "$isal"/lib64/libisal_crypto.so* "$stage/lib/"
cat > "$stage/env.sh" <<EOF
# Source to run this SPDK build: SPDK's RUNPATH lacks its own lib directory.
export CTXMEM_SPDK_PREFIX=$prefix
export LD_LIBRARY_PATH=$prefix/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
EOF
{
  echo "spdk $(basename "$spdk_src") from $SPDK_TARBALL"
  echo "isa-l_crypto $(basename "$isal_src") from $ISAL_CRYPTO_TARBALL"
  pkg_versions
  echo "built $(date -u +%FT%TZ) in $(( $(date +%s) - start )) s"
} > "$stage/BUILDINFO"
missing_libs=$(LD_LIBRARY_PATH=$stage/lib ldd "$stage/bin/spdk_tgt" | grep 'not found' || true)
[ -z "$missing_libs" ] || die "spdk_tgt has unresolved libraries: $missing_libs"
touch "$stage/.ok"
rm -rf "$prefix"
mv "$stage" "$prefix"
# The env.sh written above already names the final prefix.
log "built $prefix in $(( $(date +%s) - start )) s"
echo "$prefix"
