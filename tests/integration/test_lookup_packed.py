"""Lookup's packed wire forms against a real service (issue 17, item 5): ``packed_keys``
in, ``tier_codes`` out, exact per key; old clients' repeated forms still answered; every
input bounded (INVALID_ARGUMENT, nothing counted) before the service works on it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

import ctxmem
from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_common.keys import MAX_LOOKUP_KEYS
from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.proto import ctxmem_pb2_grpc as pb_grpc
from tests.conftest import ServiceHandle
from tests.kit import byte_layout, salted_keys

LAYOUT = byte_layout(4 << 10)  # 4 KiB blocks


class RawLookup:
    """A raw gRPC client with one open namespace: sends LookupRequests as built."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = pb_grpc.ContextMemoryStub(channel)
        s = self.stub.Connect(pb.ConnectRequest(tenant="t", transport=pb.TRANSPORT_TCP))
        self.session_id = s.session_id
        self.md = ((SESSION_TOKEN_METADATA_KEY, s.session_token),)
        ns = self.stub.OpenNamespace(pb.OpenNamespaceRequest(
            session_id=s.session_id, model_id="packed",
            layout=pb.Layout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=2048,
                             tokens_per_block=1)), metadata=self.md)
        self.handle = ns.namespace_handle

    def __call__(self, **fields: object) -> pb.LookupResponse:
        req = pb.LookupRequest(session_id=self.session_id, namespace_handle=self.handle,
                               **fields)  # type: ignore[arg-type]
        resp: pb.LookupResponse = self.stub.Lookup(req, metadata=self.md, timeout=30)
        return resp

    def refused(self, match: str, **fields: object) -> None:
        with pytest.raises(grpc.RpcError) as exc:
            self(**fields)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
        assert match in (exc.value.details() or ""), exc.value.details()


@pytest.fixture
def raw(service: ServiceHandle) -> Iterator[RawLookup]:
    with grpc.insecure_channel(service.endpoint) as ch:
        yield RawLookup(ch)


def _store(service: ServiceHandle, keys: list[bytes]) -> None:
    """Store ``keys`` in the namespace RawLookup opens (same tenant, model and layout)."""
    with ctxmem.Client(service.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="packed", tenant="t")
        ns.put(keys, [np.full(LAYOUT.block_nbytes, 7, np.uint8)] * len(keys))


def test_packed_answers_exact_per_key_with_mixed_presence_and_tiers(
        service: ServiceHandle, raw: RawLookup) -> None:
    keys = salted_keys("packed", 3000)  # > PREFIX_PROBE_KEYS: the prefix probe crosses chunks
    present = {i for i in range(len(keys)) if i % 3 != 2 or i < 1500}  # first miss: 1502
    _store(service, [keys[i] for i in sorted(present)])
    with ctxmem.Client(service.endpoint) as c:  # some of them to flash only
        ns = c.open_namespace(LAYOUT, model_id="packed", tenant="t")
        flash = [keys[i] for i in sorted(present) if i % 5 == 0]
        ns.evict(flash)
    is_flash = {i for i in present if i % 5 == 0}
    want = bytes(0 if i not in present else 2 if i in is_flash else 1
                 for i in range(len(keys)))

    r = raw(packed_keys=b"".join(keys), key_len=32, want_tier_codes=True)
    assert (r.num_hits, r.tier_codes, list(r.tiers)) == (len(present), want, [])
    r = raw(packed_keys=b"".join(keys), key_len=32, prefix=True, want_tier_codes=True)
    assert (r.num_hits, r.tier_codes) == (1502, want[:1502])
    # Old clients: no want_tier_codes, the repeated answer, packed or repeated keys alike.
    for form in ({"packed_keys": b"".join(keys), "key_len": 32}, {"keys": keys}):
        r = raw(prefix=True, **form)
        assert (r.num_hits, bytes(r.tiers), r.tier_codes) == (1502, want[:1502], b"")
    # Every key present: the prefix probe runs to the end.
    r = raw(packed_keys=b"".join(keys[:1500]), key_len=32, prefix=True, want_tier_codes=True)
    assert (r.num_hits, r.tier_codes) == (1500, want[:1500])

    # The shim (packed both ways) gives the same answer as names.
    with ctxmem.Client(service.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="packed", tenant="t")
        names = {0: "", 1: "dram", 2: "flash"}
        assert ns.tiers(keys) == [names[t] for t in want]
        assert ns.lookup(keys) == ctxmem.LookupResult(1502, [names[t] for t in want[:1502]])
        assert ns.lookup(keys[1502:1600]) == ctxmem.LookupResult(0, [])
        assert ns.lookup(keys[:1]).tiers == ["flash"]  # below 64 keys: repeated, same answer


def test_empty_and_odd_length_keys(service: ServiceHandle, raw: RawLookup) -> None:
    r = raw(packed_keys=b"", key_len=32, prefix=True, want_tier_codes=True)
    assert (r.num_hits, r.tier_codes, list(r.tiers)) == (0, b"", [])
    with ctxmem.Client(service.endpoint) as c:
        ns = c.open_namespace(LAYOUT, model_id="packed", tenant="t")
        assert ns.lookup([]) == ctxmem.LookupResult(0, [])
        assert ns.tiers([]) == []
        # Keys of 5 bytes, and keys of unequal length (sent repeated), exact per key.
        short = [i.to_bytes(5, "big") for i in range(200)]
        ns.put(short[:100:2], [np.zeros(LAYOUT.block_nbytes, np.uint8)] * 50)
        assert ns.tiers(short) == ["dram" if i < 100 and i % 2 == 0 else ""
                                   for i in range(200)]
        mixed = [b"x" * (1 + i % 60) + i.to_bytes(2, "big") for i in range(100)]
        assert ns.tiers(mixed) == [""] * 100


def test_bad_requests_are_refused_and_change_nothing(service: ServiceHandle,
                                                     raw: RawLookup) -> None:
    keys = salted_keys("packed", 100)
    _store(service, keys[:10])
    before = service.stats()
    raw.refused("not a multiple of key_len=32", packed_keys=b"".join(keys)[:-1], key_len=32,
                want_tier_codes=True)
    raw.refused("key_len=0", packed_keys=b"abc", key_len=0)
    raw.refused("key_len=65", packed_keys=b"a" * 130, key_len=65)
    over = MAX_LOOKUP_KEYS + 1
    raw.refused(f"holds {over} keys; one request takes at most {MAX_LOOKUP_KEYS}",
                packed_keys=bytes(over), key_len=1)
    raw.refused(f"holds {over} keys", keys=[b"k"] * over)
    raw.refused("send one or the other", keys=keys[:1], packed_keys=b"".join(keys[1:]),
                key_len=32)
    # Duplicates, found by the vectorised check and named by the exact one.
    raw.refused("keys[99] duplicates keys[3]", packed_keys=b"".join([*keys[:99], keys[3]]),
                key_len=32)
    raw.refused("keys[2] duplicates keys[0]", packed_keys=b"abcdab", key_len=2)
    after = service.stats()
    assert after["lookup_keys"] == before["lookup_keys"]  # nothing was looked up
    assert after["lookup_hits"] == before["lookup_hits"]
    # Equal first 8 bytes but different keys: not duplicates (the exact check passes).
    twins = [b"samehead" + bytes([i]) * 24 for i in range(2)] + keys[:10]
    r = raw(packed_keys=b"".join(twins), key_len=32, want_tier_codes=True)
    assert (r.num_hits, r.tier_codes) == (10, bytes(2) + b"\x01" * 10)
    # The limit itself is allowed.
    r = raw(packed_keys=np.arange(MAX_LOOKUP_KEYS, dtype=">u4").tobytes(), key_len=4,
            prefix=True, want_tier_codes=True)
    assert (r.num_hits, r.tier_codes) == (0, b"")
