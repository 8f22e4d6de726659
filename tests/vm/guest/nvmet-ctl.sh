#!/bin/bash
# Control the guest's kernel NVMe-oF target (configfs nvmet). Runs inside the ctxmem
# test guest only (tests/vm/run.sh); tests find it as $CTXMEM_NVMET_CTL.
#
#   nvmet-ctl.sh setup                    create subsystem, namespace 1, both ports
#   nvmet-ctl.sh disable [rdma|tcp|all]   unlink the subsystem from the port(s): the
#                                         target disappears, connected hosts lose it
#   nvmet-ctl.sh enable  [rdma|tcp|all]   link it again: the target comes back
#   nvmet-ctl.sh ns-disable | ns-enable   take namespace 1 away / bring it back
#   nvmet-ctl.sh status                   print which ports export the subsystem
#
# A port left with no subsystem stops listening: `nvme connect`/`discover` get
# "connection refused"; a connected host's controller is torn down and the host keeps
# trying to reconnect (every reconnect_delay, 10 s by default, until ctrl_loss_tmo,
# 600 s by default), so it comes back by itself after `enable` within that window.
set -euo pipefail

NQN=${CTXMEM_NVMET_NQN:-nqn.2024-01.io.ctxmem:vm-target}
ADDR=${CTXMEM_NVMET_ADDR:-10.0.2.15}
RDMA_PORT=${CTXMEM_NVMET_RDMA_PORT:-4420}
TCP_PORT=${CTXMEM_NVMET_TCP_PORT:-4421}
BACKING=${CTXMEM_NVMET_BACKING:-/run/nvmet/ns1.img}
CFG=/sys/kernel/config/nvmet
SUB=$CFG/subsystems/$NQN
# configfs port ids: 1 = rdma, 2 = tcp
port_id() { case "$1" in rdma) echo 1 ;; tcp) echo 2 ;; *) echo "bad transport $1" >&2; exit 2 ;; esac; }
which_ports() { case "${1:-all}" in all) echo "rdma tcp" ;; rdma|tcp) echo "$1" ;; *) echo "bad transport $1" >&2; exit 2 ;; esac; }

make_port() {  # transport svcid
  local p
  p=$CFG/ports/$(port_id "$1")
  mkdir -p "$p"
  echo ipv4 > "$p/addr_adrfam"
  echo "$1" > "$p/addr_trtype"
  echo "$ADDR" > "$p/addr_traddr"
  echo "$2" > "$p/addr_trsvcid"
}

case "${1:-}" in
  setup)
    [ -d "$CFG" ] || { echo "nvmet-ctl: $CFG missing (nvmet not loaded?)" >&2; exit 1; }
    [ -f "$BACKING" ] || { echo "nvmet-ctl: backing file $BACKING missing" >&2; exit 1; }
    mkdir -p "$SUB"
    echo 1 > "$SUB/attr_allow_any_host"
    echo ctxmem-vm-0001 > "$SUB/attr_serial" 2>/dev/null || true
    mkdir -p "$SUB/namespaces/1"
    echo "$BACKING" > "$SUB/namespaces/1/device_path"
    # tmpfs has no O_DIRECT: without buffered_io, enable fails with EINVAL.
    echo 1 > "$SUB/namespaces/1/buffered_io"
    echo 1 > "$SUB/namespaces/1/enable"
    make_port rdma "$RDMA_PORT"
    make_port tcp "$TCP_PORT"
    for t in rdma tcp; do
      l=$CFG/ports/$(port_id $t)/subsystems/$NQN
      [ -L "$l" ] || ln -s "$SUB" "$l"
    done
    ;;
  disable)
    for t in $(which_ports "${2:-all}"); do
      rm -f "$CFG/ports/$(port_id "$t")/subsystems/$NQN"
    done
    ;;
  enable)
    for t in $(which_ports "${2:-all}"); do
      l=$CFG/ports/$(port_id "$t")/subsystems/$NQN
      [ -L "$l" ] || ln -s "$SUB" "$l"
    done
    ;;
  ns-disable) echo 0 > "$SUB/namespaces/1/enable" ;;
  ns-enable) echo 1 > "$SUB/namespaces/1/enable" ;;
  status)
    for t in rdma tcp; do
      p=$CFG/ports/$(port_id "$t")
      if [ -L "$p/subsystems/$NQN" ]; then s=enabled; else s=disabled; fi
      echo "$t $(cat "$p/addr_traddr"):$(cat "$p/addr_trsvcid") $s"
    done
    echo "namespace 1 enable=$(cat "$SUB/namespaces/1/enable")"
    ;;
  *)
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
