"""``ctxmem chaos``: a fault campaign against a live ctxmem service.

The service runs as a child process (``python -m ctxmem_dpu serve``, via
:class:`ctxmem_tools.launcher.ServiceProcess`) on two flash files, with two tenants writing
through the shim; this program injects faults and checks, after every operation, that
nothing wrong is ever served and that durable blocks survive. It never imports the
service: it edits the flash files directly (with the format code in
``ctxmem_common.flash_format``), drives the service's fault layer through its control
file (``CTXMEM_FAULT_CTL``; the protocol is ``ctxmem_common.faultpoints``), and kills it.

Fault kinds (``KINDS``):

* on-device corruption, many per round, cheap: bit flips in a payload or a header, a
  zeroed payload sector or header, a record copied over another slot (same device or the
  other one), a record of the other tenant's namespace copied over a slot, a stale record
  of a deleted block written back over a live slot, a truncated payload area, a zeroed
  slab header, a damaged superblock copy;
* device faults through the file layer: EIO on reads, EIO or ENOSPC on writes, EIO on
  fdatasync, a slow device, a flaky one (30% of calls fail), and the two devices swapped
  under the running service (contents exchanged, then put back);
* crashes: SIGKILL at a named fault point (``kill``), a power cut at a named point
  (unsynced writes dropped or torn, then SIGKILL), SIGKILL at a random moment, SIGKILL
  during the index rebuild itself, the device files swapped between restarts, a device
  truncated between restarts;
* scenarios (issue 13, :mod:`.scenarios`; not in the default selection, ``--kinds``): a
  stalled shared-memory client writing into slots after its allocation expired, a full
  filesystem under the flash files, both superblock copies damaged (refused start, then
  ``ctxmem check --repair``), a second service on the same bytes (same file, loop device).

The model: every key's content is a function of the key (keys are content hashes, as
engines' block hashes are), so "what was committed under this key" is known exactly and
every served block is compared byte for byte. Per key it tracks: committed, durable (seen
flash-only after Evict, or recovered by a restart), tainted (its record was damaged on
purpose: a miss is expected), uncertain (an operation on it was cut by a crash), deleted.

Checks, counted in the JSON (``faults_injected``, ``blocks_committed``, ``blocks_served``,
``wrong_blocks`` and ``blocks_lost`` at the top level):

* ``wrong_blocks`` — served bytes that differ from the key's content: must be 0;
* ``durable_blocks_lost`` — after a restart, a durable, undamaged block not served:
  must be 0; ``blocks_lost`` counts committed blocks that were not yet durable at a crash
  and did not come back (allowed), with ``lost_fraction`` of all committed blocks;
* ``resurrected_blocks`` — a block whose delete was acknowledged served again: must be 0;
* ``space_leak_bytes`` — after every restart, the service's ``flash_used_bytes`` minus the
  slot bytes of the valid records on the files: must be 0 (no leaked or doubly used
  extent); at the end ``ctxmem check --repair`` then ``ctxmem check`` must be clean.

Modules: :mod:`.records` (kinds, key model, records on the files), :mod:`.driver` (the
service and its fault controls), :mod:`.workload` (operations and checks), :mod:`.inject`
(the faults), :mod:`.scenarios` (the scenario episodes), :mod:`.campaign` (schedule,
report, :func:`run_campaign`), :mod:`.cli`; :mod:`.pod` is the pod campaign
(``ctxmem chaos pod``: three nodes, Redis, shared flash; issue 26 item 6).
"""

from ctxmem_tools.chaos.campaign import (
    DEFAULT_KINDS,
    KINDS,
    Campaign,
    run_campaign,
    select_kinds,
)
from ctxmem_tools.chaos.cli import chaos_command
from ctxmem_tools.chaos.driver import fresh_client
from ctxmem_tools.chaos.records import CORRUPTION, CRASH, DEVICE
from ctxmem_tools.chaos.scenarios import SCENARIO

__all__ = ["CORRUPTION", "CRASH", "DEFAULT_KINDS", "DEVICE", "KINDS", "SCENARIO", "Campaign",
           "chaos_command", "fresh_client", "run_campaign", "select_kinds"]
