"""The vLLM connector's plain data: transfer plans, namespace specs, keys (no vLLM or torch
imports; shared by :mod:`ctxmem.integrations.vllm_core` and the connector)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxmem.client import Client, Namespace
from ctxmem.group import NamespaceGroup
from ctxmem.integrations._common import fit_key, open_namespace, salt_tag
from ctxmem_common.layout import KVLayout


@dataclass
class TransferSpec:
    """Blocks of one request to load or save: ``keys[i]`` <-> paged block ``block_ids[i]``."""

    req_id: str
    salt: str | None
    keys: list[bytes]
    block_ids: list[int]
    is_async: bool = False
    """Load between scheduler steps; completion is reported through ``get_finished``."""
    parent: bytes | None = None
    """Saves, with KV events on: the block hash before ``keys[0]`` (None: the first)."""
    token_ids: list[int] = field(default_factory=list)
    """Saves, with KV events on: the tokens of the saved blocks."""
    group_block_ids: list[list[int]] = field(default_factory=list)
    """A model with several KV cache groups: the paged blocks of groups 1, 2, ... of each
    key (``block_ids`` are group 0's), :data:`NULL_BLOCK` where the group holds none
    (a sliding-window group's blocks that left the window)."""

    def groups(self) -> list[list[int]]:
        """Every group's block ids, group 0 first."""
        return [self.block_ids, *self.group_block_ids]


NULL_BLOCK = 0
"""vLLM's null block (``BlockPool.null_block``, the pool's first block): a group's block
table holds it where the group keeps no block, e.g. a sliding-window group's blocks
before the window."""


@dataclass
class CoreMetadata:
    """What the scheduler tells the workers for one step."""

    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)


@dataclass
class NamespaceSpec:
    """Everything that names the namespaces of one model deployment."""

    model_id: str
    tenant: str
    tp_size: int
    tags: dict[str, str]
    layout_for_rank: Callable[[int], KVLayout]
    heads: tuple[int, int] | None = None
    weights_revision: str = ""
    """The model weights' revision (``ctxmem.weights_revision``, else vLLM's
    ``--revision``): part of the namespace, so KV of other weights is never served."""
    """Head-sliced blocks (``ctxmem.tp_shared``): (the model's KV heads, heads per rank).
    Then one namespace serves every TP size and ``layout_for_rank`` gives the layout of
    one head's block; see :func:`ctxmem.integrations.vllm_layout.head_keys`."""

    groups: list[tuple[str, Callable[[int], KVLayout]]] = field(default_factory=list)
    """A model with several KV cache groups (vLLM's hybrid allocator: full attention and
    sliding window layers): each group's (namespace tag, layout per TP rank), group 0
    first; a key's blocks in every group are one block group. Empty: one group, named
    and laid out by ``layout_for_rank`` alone (the namespace of a single-group model)."""

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))

    def rank_heads(self, rank: int) -> range:
        assert self.heads is not None
        per = self.heads[1]
        return range(rank * per, (rank + 1) * per)


def block_keys(hashes: Sequence[Any]) -> list[bytes]:
    """vLLM block hashes (``BlockHash`` bytes; ints in old versions) as ctxmem keys."""
    out: list[bytes] = []
    for h in hashes:
        if isinstance(h, (bytes, bytearray)):
            out.append(fit_key(bytes(h)))
        elif isinstance(h, int):
            out.append(h.to_bytes(max(8, (h.bit_length() + 8) // 8), "big", signed=True))
        else:  # an old BlockHash named tuple: its hash_value is the chain hash
            out.append(block_keys([getattr(h, "hash_value", h)])[0])
    return out


class Namespaces:
    """The namespaces of one deployment, opened on first use per (KV cache group, TP
    rank, salt)."""

    def __init__(self, client: Client, spec: NamespaceSpec) -> None:
        self.client = client
        self.spec = spec
        self._ns: dict[tuple[int, int, str | None], Namespace] = {}
        self._groups: dict[tuple[int, str | None], NamespaceGroup] = {}
        self._lock = threading.Lock()

    def get(self, rank: int, salt: str | None) -> Namespace:
        """KV cache group 0's namespace (a single-group model's only one)."""
        return self.member(0, rank, salt)

    def member(self, group: int, rank: int, salt: str | None) -> Namespace:
        if self.spec.heads is not None:
            rank = 0  # one TP-free namespace of head-sliced blocks
        ident = (group, rank, salt)
        ns = self._ns.get(ident)
        if ns is None:
            with self._lock:
                ns = self._ns.get(ident)
                if ns is None:
                    tags = dict(self.spec.tags)
                    layout = self.spec.layout_for_rank
                    if self.spec.groups:
                        tag, layout = self.spec.groups[group]
                        tags["vllm_kv_group"] = tag
                    if salt is not None:
                        tags["cache_salt"] = salt_tag(salt)
                    ns = open_namespace(self.client, layout(rank),
                                        model_id=self.spec.model_id, tenant=self.spec.tenant,
                                        tags=tags,
                                        weights_revision=self.spec.weights_revision)
                    self._ns[ident] = ns
        return ns

    def group(self, rank: int, salt: str | None) -> NamespaceGroup:
        """Every KV cache group's namespace as one block group (:mod:`ctxmem.group`): a
        key is stored, counted and loaded in all of them or in none. A single-group
        model's group is its one namespace (that namespace's own calls)."""
        ident = (rank, salt)
        grp = self._groups.get(ident)
        if grp is None:
            members = [self.member(g, rank, salt) for g in range(self.spec.num_groups)]
            grp = self.client.open_group(members)
            with self._lock:
                grp = self._groups.setdefault(ident, grp)
        return grp
