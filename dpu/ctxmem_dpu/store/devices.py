"""Opening the store's flash devices: each one's file, format and owner record, and on
a pod's shared devices the slab fence and this node's slab leases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ctxmem_common.config import Config
from ctxmem_common.errors import InvalidArgument
from ctxmem_dpu.store.context import IOPool
from ctxmem_dpu.tiers.flash import FlashDevice
from ctxmem_dpu.tiers.flash_fence import SlabFence

if TYPE_CHECKING:  # the pod's modules (and redis) load only where a device is shared
    from ctxmem_dpu.pod.slab_leases import SlabLeaseKeeper, SlabLeases


async def open_devices(cfg: Config, io: IOPool, flash_paths: Sequence[tuple[str, str]],
                       leases: SlabLeases | None
                       ) -> tuple[list[FlashDevice], SlabLeaseKeeper | None]:
    """Open every (name, path) device on the I/O threads; a device named shared in
    ``cfg.flash.devices`` gets a :class:`SlabFence` and, once all are open, its slabs are
    leased again (:meth:`SlabLeaseKeeper.attach`). On any failure the devices already
    opened are closed (lock, owner record) and the error propagates."""
    shared = {d.name for d in cfg.flash.devices if d.shared}
    devices: list[FlashDevice] = []
    keeper: SlabLeaseKeeper | None = None
    try:
        for i, (name, path) in enumerate(flash_paths):
            fence = None
            if name in shared:
                if leases is None:
                    raise InvalidArgument(
                        f"flash device {name!r} is shared (flash.devices[].shared) but the "
                        f"service has no pod index for its slab leases; set pod.index_url "
                        f"and pod.node_id, or make the device non-shared")
                fence = SlabFence(name, leases.node_id)
            devices.append(await io.run(FlashDevice, i, name, path, cfg.flash.slab_size,
                                        cfg.flash.o_direct, True, fence))
            devices[-1].slow_io_s = cfg.flash.slow_io_s
        if leases is not None and any(d.fence is not None for d in devices):
            from ctxmem_dpu.pod.slab_leases import SlabLeaseKeeper

            keeper = SlabLeaseKeeper(leases, devices, io.run, cfg.pod.shared_spare_slabs,
                                     cfg.pod.dead_slab_grace_s)
            await keeper.attach()
    except BaseException:
        for dev in devices:
            dev.close()
        raise
    return devices, keeper
