"""Block authenticators (ctxmem_common.codecs.blockauth): what a tag binds, and that
nobody without the namespace's key makes one that verifies."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ctxmem_common.codecs.blockauth import (
    TAG_BYTES,
    BlockAuthenticator,
    binding,
    derive_auth_key,
)
from ctxmem_common.codecs.xts import derive_namespace_key

MASTER = bytes(range(32))
NS = b"\x01" * 16


def _auth(master: bytes = MASTER, ns: bytes = NS) -> BlockAuthenticator:
    return BlockAuthenticator.for_namespace(master, ns)


def test_a_tag_verifies_for_exactly_what_it_bound() -> None:
    a = _auth()
    data = os.urandom(65536)
    tag = a.tag(b"k1", data, context=b"seq7")
    assert len(tag) == TAG_BYTES
    assert a.verify(b"k1", data, tag, context=b"seq7")
    assert a.verify(b"k1", memoryview(data), tag, context=b"seq7")
    assert a.verify(b"k1", np.frombuffer(data, np.uint8), tag, context=b"seq7")
    flipped = bytearray(data)
    flipped[40_000] ^= 1
    assert not a.verify(b"k1", flipped, tag, context=b"seq7")
    assert not a.verify(b"k2", data, tag, context=b"seq7")
    assert not a.verify(b"k1", data, tag, context=b"seq8")
    assert not a.verify(b"k1", data[:-1], tag, context=b"seq7")
    assert not _auth(ns=b"\x02" * 16).verify(b"k1", data, tag, context=b"seq7")
    assert not _auth(master=bytes(32)).verify(b"k1", data, tag, context=b"seq7")


def test_malformed_or_forged_tags_are_false_not_errors() -> None:
    a = _auth()
    data = b"x" * 4096
    tag = a.tag(b"k", data)
    for bad in (b"", tag[:-1], tag + b"\0", bytes(TAG_BYTES)):
        assert not a.verify(b"k", data, bad)
    forged = bytearray(tag)
    forged[-1] ^= 0x80
    assert not a.verify(b"k", data, bytes(forged))
    nonce_changed = bytearray(tag)
    nonce_changed[0] ^= 1
    assert not a.verify(b"k", data, bytes(nonce_changed))


def test_nonces_are_fresh() -> None:
    a = _auth()
    tags = {a.tag(b"k", b"same bytes") for _ in range(64)}
    assert len(tags) == 64
    assert len({t[:12] for t in tags}) == 64


def test_binding_is_unambiguous() -> None:
    # moving a byte between key and context must change what is bound
    assert binding(NS, b"ab", 1, b"c") != binding(NS, b"a", 1, b"bc")
    assert binding(NS, b"a", 1) != binding(NS, b"a", 2)


def test_keys_differ_per_namespace_and_from_the_xts_key() -> None:
    k1 = derive_auth_key(MASTER, NS)
    assert k1 != derive_auth_key(MASTER, b"\x02" * 16)
    assert k1 not in derive_namespace_key(MASTER, NS)
    with pytest.raises(ValueError, match="32 bytes"):
        derive_auth_key(b"short", NS)
    with pytest.raises(ValueError, match="32 bytes"):
        BlockAuthenticator(b"short", NS)
