"""Helpers of the tests that speak the peer wire or read the index themselves: the pod's
keys from its master key and token, a blocking client handshake (``ctxmem fuzz``'s own,
:mod:`ctxmem_tools.fuzz.peer`, re-exported), and the index's keyed names of a namespace's
blocks."""

from __future__ import annotations

from collections.abc import Sequence

from ctxmem_common.keys import namespace_digest
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.pod.entries import blocks_key
from ctxmem_tools.fuzz.peer import handshake, read_exactly
from ctxmem_tools.pod_launcher import LocalPod
from tests.pod.podtest import LAYOUT

__all__ = ["FIXED_MASTER", "handshake", "index_keys", "index_names", "pod_keys",
           "read_exactly"]


def pod_keys(pod: LocalPod) -> PodKeys:
    """The keys every node of ``pod`` derives."""
    return PodKeys(pod.master_key, pod.token.encode())


#: A fixed master key for tests that must know the index's names before the pod starts.
FIXED_MASTER = bytes(range(32))


def index_keys(master: bytes = FIXED_MASTER) -> PodKeys:
    """Keys that name the index's entries (they depend on the master key only)."""
    return PodKeys(master)


def index_names(keys: PodKeys, block_keys: Sequence[bytes], model: str = "m",
                tenant: str = "default") -> tuple[str, list[bytes]]:
    """The Redis hash of the namespace (tenant, model, the tests' layout) and the fields
    of ``block_keys`` in it."""
    digest = namespace_digest(tenant, model, LAYOUT)
    return (blocks_key(keys.index_tag(digest)),
            keys.index_fields(digest, list(block_keys)))
