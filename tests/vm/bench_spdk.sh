#!/bin/bash
# `ctxmem bench` with the flash tier on SPDK, inside the QEMU guest (a fidelity check of
# DPU mode's data path, never a performance figure: the guest CPU is emulated).
#
#   bash tests/vm/run.sh bash tests/vm/bench_spdk.sh [TRANSPORT [BATCH_MIB]]
#
# Starts spdk_tgt (CTXMEM_SPDK_PREFIX), then runs `ctxmem bench --quick` twice with one
# `spdk` flash device on the guest's kernel nvmet target over TRANSPORT (rdma or tcp,
# default rdma): once on the namespace bdev (ctxmem encrypts in software), once on
# SPDK's AES-XTS crypto bdev (SPDK encrypts; ctxmem does not). The O_DIRECT limit each
# figure is held against is the same namespace through the kernel initiator
# (`nvme connect`, measured while the service is stopped). JSON results go to
# $CTXMEM_VM_OUT/bench-spdk-{plain,crypto}.json.
set -euo pipefail
transport=${1:-rdma}
batch_mib=${2:-16}
[ "${CTXMEM_VM:-}" = 1 ] || { echo "bench_spdk.sh: run it in the guest (tests/vm/run.sh)" >&2; exit 2; }
case "$transport" in
  rdma) port=$CTXMEM_NVMET_RDMA_PORT ;;
  tcp) port=$CTXMEM_NVMET_TCP_PORT ;;
  *) echo "bench_spdk.sh: transport rdma or tcp, not $transport" >&2; exit 2 ;;
esac
work=$(mktemp -d "${TMPDIR:-/tmp}/bench-spdk.XXXXXX")
python=$(command -v python3)
[ -x "$(dirname "$0")/../../.venv/bin/python" ] && python=$(dirname "$0")/../../.venv/bin/python
python=${CTXMEM_BENCH_PYTHON:-$python}
openssl rand -hex 64 > "$work/xts.key"
chmod 600 "$work/xts.key"
for variant in plain crypto; do
  crypto='"crypto": {"enabled": false}'
  if [ "$variant" = crypto ]; then
    crypto="\"crypto\": {\"enabled\": true, \"key_name\": \"bench_xts\", \"key_file\": \"$work/xts.key\"}"
  fi
  cat > "$work/device-$variant.json" <<EOF
{"name": "spdk0", "backend": "spdk", "spdk": {
  "rpc_socket": "$work/spdk/spdk.sock", "bdev_name": "Bench0", "trtype": "$transport",
  "traddr": "$CTXMEM_NVMET_ADDR", "trsvcid": "$port", "subnqn": "$CTXMEM_NVMET_NQN",
  "expose": "nbd", "ctrlr_loss_timeout_sec": -1, "reconnect_delay_sec": 1,
  "fast_io_fail_timeout_sec": 2, $crypto}}
EOF
done
nvme connect -t "$transport" -a "$CTXMEM_NVMET_ADDR" -s "$port" -n "$CTXMEM_NVMET_NQN" >/dev/null
trap 'nvme disconnect -n "$CTXMEM_NVMET_NQN" >/dev/null 2>&1 || true' EXIT
limit_dev=
for _ in $(seq 100); do
  for sub in /sys/class/nvme-subsystem/nvme-subsys*; do
    [ "$(cat "$sub/subsysnqn" 2>/dev/null)" = "$CTXMEM_NVMET_NQN" ] || continue
    for ns in "$sub"/nvme*n*; do [ -b "/dev/${ns##*/}" ] && limit_dev=/dev/${ns##*/} && break; done
  done
  [ -n "$limit_dev" ] && break
  sleep 0.2
done
[ -n "$limit_dev" ] || { echo "bench_spdk.sh: no block device after nvme connect" >&2; exit 1; }
echo "O_DIRECT limit measured on $limit_dev (kernel initiator, same namespace)"
"$python" -m ctxmem_tools.spdk_app --workdir "$work/spdk" -- bash -c '
  set -e
  for v in plain crypto; do
    echo "== ctxmem bench, flash on SPDK ('"$transport"', $v)"
    "$0" -m ctxmem_common.cli bench --quick --batch-mib '"$batch_mib"' \
      --flash-device "$1/device-$v.json" --workdir "$1/bench-$v" --odirect-path "$2" \
      --json "${CTXMEM_VM_OUT:-$1}/bench-spdk-$v.json"
  done' "$python" "$work" "$limit_dev"
