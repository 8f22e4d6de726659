"""Lookup on the wire: keys in (repeated or packed), tiers out (repeated or one byte each).

A 10,000-key Lookup is bound by per-key work, not by the index: a repeated protobuf
field costs a Python object per key to build and to read at both ends, and a check per
key in Python costs as much as the dict probe itself. So the packed forms are the fast
path (``LookupRequest.packed_keys`` in, ``LookupResponse.tier_codes`` out, both one bytes
field), the keys are checked as one numpy pass (``ctxmem_common.keys.packed_key_array``), and
each block's tier becomes one int in one list comprehension. The repeated forms stay for
old clients and for keys of unequal length. Every input is bounded before work is done
on it: at most ``MAX_LOOKUP_KEYS`` keys, and a packed field a whole number of keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ctxmem_common.errors import InvalidArgument
from ctxmem_common.keys import check_key_count, packed_key_array
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_dpu.blocks import Block

_NONE, _DRAM, _FLASH = pb.TIER_UNSPECIFIED, pb.TIER_DRAM, pb.TIER_FLASH


def request_keys(request: pb.LookupRequest) -> tuple[list[bytes] | np.ndarray, bool]:
    """``(keys, checked)``: the request's keys, and whether they were validated already
    (packed keys are, by :func:`packed_key_array`; repeated ones are left to the store).
    Packed keys stay a numpy array (``V{key_len}``): the index turns into ``bytes`` only
    the ones a prefix probe reaches."""
    packed = request.packed_keys  # read once: each access copies the field
    if packed:
        if len(request.keys):
            raise InvalidArgument(
                f"Lookup carries {len(request.keys)} keys and {len(packed)} bytes of "
                f"packed_keys; send one or the other")
        return packed_key_array(packed, request.key_len), True
    check_key_count(len(request.keys))  # before the container is copied into a list
    return list(request.keys), False


def key_list(keys: list[bytes] | np.ndarray) -> list[bytes]:
    """:func:`request_keys`' keys as ``bytes`` objects (for paths that need them all)."""
    out: list[bytes] = keys.tolist() if isinstance(keys, np.ndarray) else keys
    return out


def tier_codes(found: Sequence[Block | None]) -> list[pb.Tier]:
    """Per block, its ``pb.Tier`` value: DRAM when it has a copy there, else FLASH;
    UNSPECIFIED for a miss."""
    return [_NONE if b is None else _DRAM if b.dram is not None else _FLASH for b in found]


def lookup_response(num_hits: int, codes: list[pb.Tier], packed: bool) -> pb.LookupResponse:
    """The answer in the form the client asked for: ``tier_codes`` (one byte per entry)
    with ``want_tier_codes``, else the repeated ``tiers`` old clients read."""
    if packed:
        return pb.LookupResponse(num_hits=num_hits, tier_codes=bytes(codes))
    return pb.LookupResponse(num_hits=num_hits, tiers=codes)
