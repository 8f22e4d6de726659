"""Issue 14: the entry format, the pod config's rules, the default needing nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import pytest
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from ctxmem_common.config import load_config, parse_config
from ctxmem_common.errors import ConfigError
from ctxmem_common.podkeys import PodKeys
from ctxmem_dpu.pod.entries import (
    RemoteEntry,
    SharedLocation,
    blocks_key,
    node_prefix,
    pack_entry,
    unpack_entry,
)
from ctxmem_dpu.pod.fetch import RemoteFetch
from ctxmem_dpu.pod.sources import RemoteSource

entries = st.builds(
    RemoteEntry,
    node_id=st.text(st.characters(whitelist_categories=("Ll", "Nd")), min_size=1,
                    max_size=64),
    tier=st.sampled_from(["dram", "flash"]),
    seq=st.integers(0, 2**64 - 1), nbytes=st.integers(0, 2**64 - 1),
    crc32c=st.integers(0, 2**32 - 1),
    shared=st.none() | st.builds(SharedLocation, st.binary(min_size=16, max_size=16).map(
        bytes.hex), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    key=st.binary(min_size=1, max_size=64))


@given(entries)
def test_entries_round_trip_and_start_with_the_node_prefix(e: RemoteEntry) -> None:
    raw = pack_entry(e)
    assert raw.startswith(node_prefix(e.node_id))
    assert unpack_entry(raw, e.key) == e
    assert len(raw) == 28 + len(e.node_id.encode()) + (32 if e.shared else 0)


@given(st.binary(max_size=120))
def test_garbage_is_no_entry_never_an_error(raw: bytes) -> None:
    e = unpack_entry(raw)
    assert e is None or pack_entry(e) == raw


def test_truncated_entry_is_none() -> None:
    raw = pack_entry(RemoteEntry("n1", "dram", 1, 2, 3))
    assert all(unpack_entry(raw[:i]) is None for i in range(len(raw)))


def test_namespace_keys_share_one_hash_tag_that_is_no_digest() -> None:
    """The hash tag and fields are keyed hashes (issue 25 item 3): another master key,
    other names; neither the digest nor a block key appears in them."""
    ns = bytes(range(16))
    a, b = PodKeys(bytes(32)), PodKeys(bytes(31) + b"\x01")
    assert blocks_key(a.index_tag(ns)) == "ctxmem:{" + a.index_tag(ns) + "}:blocks"
    assert a.index_tag(ns) != b.index_tag(ns) and ns.hex() not in a.index_tag(ns)
    keys = [bytes([i]) * 32 for i in range(5)] + [b"odd-length-key"]
    fa = a.index_fields(ns, keys)
    assert fa != b.index_fields(ns, keys) and fa != a.index_fields(bytes(16), keys)
    assert len(set(fa)) == len(keys) and all(len(f) == 16 for f in fa)
    # A key's field does not depend on the batch it is in.
    assert [a.index_fields(ns, [k])[0] for k in keys] == fa


def test_the_default_config_has_the_pod_tier_off() -> None:
    cfg = load_config()
    assert cfg.pod.enabled is False and cfg.pod.index_url == ""


BASE = "service: {insecure: true}\npod:\n"


@pytest.mark.parametrize(("pod", "error"), [
    ("  enabled: true\n  index_url: http://x\n", "pod.index_url"),
    ("  enabled: true\n  index_url: redis://h:1\n  advertise: h:2\n", "pod.node_id"),
    ("  enabled: true\n  index_url: redis://h:1\n  node_id: a b\n  advertise: h:2\n",
     "pod.node_id"),
    ("  enabled: true\n  index_url: redis://h:1\n  node_id: a\n", "pod.advertise"),
    ("  enabled: true\n  index_url: redis://h:1\n  node_id: a\n  advertise: h:2\n"
     "  tls_cert_file: c\n  tls_key_file: k\n", "tls_ca_file"),
    ("  enabled: true\n  index_url: redis://h:1\n  node_id: a\n  advertise: h:2\n"
     "  heartbeat_s: 5\n  node_ttl_s: 5\n", "pod.node_ttl_s"),
    ("  enabled: true\n  index_url: redis://h:1/3\n  index_cluster: true\n",
     "pod.index_url: database '3' with pod.index_cluster"),
    ("  bogus: 1\n", "pod.bogus"),
])
def test_bad_pod_settings_name_the_key(pod: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error.replace(".", r"\.")):
        parse_config(BASE + pod)


def test_a_good_pod_section_loads() -> None:
    cfg = parse_config(BASE + "  enabled: true\n  index_url: rediss://h:1/0\n  node_id: n-1\n"
                       "  advertise: 10.0.0.1:7000\n")
    assert cfg.pod.node_id == "n-1" and cfg.pod.index_url.startswith("rediss://")


class _Unverified(RemoteSource):
    """A source that returns the right bytes but does not verify them."""

    name = "unverified"

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def fetch(self, ns_digest: bytes, entries: Sequence[RemoteEntry]
                    ) -> list[bytes | None]:
        return [self.data for _ in entries]


def test_the_fetch_path_adopts_nothing_a_source_did_not_verify() -> None:
    """Length and CRC32C match the index entry, but the source does not verify blocks
    (``RemoteSource.verifies``): a miss, counted; a source that does is used."""
    data = bytes(range(256)) * 16
    entry = RemoteEntry("n1", "dram", 1, len(data), crc32c(data), None, b"k" * 32)
    counters: Counter[str] = Counter()
    src = _Unverified(data)
    fetch = RemoteFetch(None, None, [src], counters, 16)  # type: ignore[arg-type]
    assert asyncio.run(fetch.fetch(bytes(16), [entry])) == [None]
    assert counters["pod_fetch_unauthenticated"] == 1
    src.verifies = True
    assert asyncio.run(fetch.fetch(bytes(16), [entry])) == [data]
