"""What the cluster index says about one stored block: where in the pod it lives."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SharedLocation:
    """A block's record on a pod's shared flash device: the device (its superblock UUID,
    hex), the byte offset of the record's payload and the payload's length."""

    device_uuid: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RemoteEntry:
    """One block as another node published it: the node, its tier there, the block's
    sequence number, length and CRC32C, and its shared-flash location if it has one."""

    node_id: str
    tier: str
    seq: int
    nbytes: int
    crc32c: int
    shared: SharedLocation | None
