from __future__ import annotations

import pytest

from ctxmem_common.errors import InvalidArgument
from ctxmem_common.keys import chain_hashes, namespace_digest, validate_keys
from ctxmem_common.layout import KVLayout


def test_block_nbytes_exact_for_mha_gqa() -> None:
    lay = KVLayout(dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128,
                   tokens_per_block=16)
    assert lay.block_nbytes == 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB: Llama-3-8B, 16 tokens


def test_block_nbytes_exact_for_mla() -> None:
    lay = KVLayout(dtype="bfloat16", num_layers=61, tokens_per_block=64, kv_lora_rank=512,
                   qk_rope_head_dim=64)
    assert lay.is_mla
    assert lay.block_nbytes == 61 * 64 * (512 + 64) * 2


def test_layout_digest_covers_every_field() -> None:
    base = dict(dtype="float16", num_layers=4, num_kv_heads=2, head_dim=64, tokens_per_block=16)
    d0 = KVLayout(**base).digest()  # type: ignore[arg-type]
    for change in ({"dtype": "bfloat16"}, {"tp_rank": 1, "tp_size": 2}, {"tokens_per_block": 32},
                   {"num_kv_heads": 4}, {"head_dim": 128}, {"num_layers": 5}):
        assert KVLayout(**{**base, **change}).digest() != d0, change  # type: ignore[arg-type]
    assert KVLayout(**base).digest() == d0  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    {"dtype": "float13"}, {"num_layers": 0}, {"head_dim": 0}, {"tp_rank": 2, "tp_size": 2},
    {"tokens_per_block": -1},
])
def test_invalid_layouts_are_rejected_with_the_field_named(bad: dict[str, object]) -> None:
    base = dict(dtype="float16", num_layers=4, num_kv_heads=2, head_dim=64, tokens_per_block=16)
    with pytest.raises(InvalidArgument, match="layout"):
        KVLayout(**{**base, **bad})  # type: ignore[arg-type]


def test_namespace_identity_separates_tenants_models_and_tags() -> None:
    lay = KVLayout(dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8)
    d = namespace_digest("t1", "m", lay, {"cache_salt": "a"})
    assert d != namespace_digest("t2", "m", lay, {"cache_salt": "a"})
    assert d != namespace_digest("t1", "m2", lay, {"cache_salt": "a"})
    assert d != namespace_digest("t1", "m", lay, {"cache_salt": "b"})
    assert d == namespace_digest("t1", "m", lay, {"cache_salt": "a"})
    # Length-prefixed parts: ("ab", "c") and ("a", "bc") must not collide.
    assert namespace_digest("ab", "c", lay) != namespace_digest("a", "bc", lay)


def test_weights_revision_is_part_of_the_namespace_and_none_keeps_old_digests() -> None:
    """Issue 25, item 6. Fixed vectors: the digests of namespaces without a revision are
    the ones every earlier version computed (blocks already stored stay readable)."""
    lay = KVLayout(dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=64,
                   tokens_per_block=16)
    plain = namespace_digest("t1", "m", lay)
    salted = namespace_digest("t1", "m", lay, {"cache_salt": "a"})
    assert plain.hex() == "68a841c2a74e5a3b3bdb78d4f4c8180d"
    assert salted.hex() == "30d5c9c550167bdd6ecb7c4535b49564"
    assert namespace_digest("t1", "m", lay, {}, "") == plain
    r1 = namespace_digest("t1", "m", lay, {}, "sha256:aaaa")
    r2 = namespace_digest("t1", "m", lay, {}, "sha256:bbbb")
    assert len({plain, r1, r2}) == 3
    assert namespace_digest("t1", "m", lay, {"cache_salt": "a"}, "sha256:aaaa") not in (
        salted, r1)
    # No tag can spell a revision: the tags' encoding is self-delimiting.
    assert namespace_digest("t1", "m", lay, {"weights-revision": "sha256:aaaa"}) != r1
    with pytest.raises(InvalidArgument, match="weights_revision"):
        namespace_digest("t1", "m", lay, {}, "x" * 257)


def test_chain_hashes_full_blocks_prefix_property_and_salt() -> None:
    toks = list(range(100))
    keys = chain_hashes(toks, 16)
    assert len(keys) == 6 and all(len(k) == 32 for k in keys)
    assert chain_hashes(toks[:64], 16) == keys[:4]  # a key covers only its prefix
    changed = chain_hashes([999, *toks[1:]], 16)
    assert all(a != b for a, b in zip(keys, changed, strict=True))  # chained: all differ
    assert chain_hashes(toks, 16, salt=b"s") != keys


def test_validate_keys_errors_name_the_index() -> None:
    with pytest.raises(InvalidArgument, match=r"keys\[1\] is 65 bytes"):
        validate_keys([b"a", b"x" * 65])
    with pytest.raises(InvalidArgument, match=r"keys\[2\] duplicates keys\[0\]"):
        validate_keys([b"a", b"b", b"a"])
    with pytest.raises(InvalidArgument, match=r"keys\[0\] is 0 bytes"):
        validate_keys([b""])
    with pytest.raises(InvalidArgument, match="must be bytes"):
        validate_keys(["str"])  # type: ignore[list-item]


def test_validate_keys_returns_the_common_length_a_get_packs_with() -> None:
    """A get packs its keys with this length (no second pass in pack_keys): it must be
    the length of every key, and 0 whenever pack_keys has to decide instead."""
    assert validate_keys([b"ab", b"cd", b"ef"]) == 2
    assert validate_keys([b"k" * 64]) == 64
    assert validate_keys([b"a", b"bc"]) == 0  # several lengths
    assert validate_keys([b"ab", bytearray(b"cd")]) == 0  # not all bytes: valid all the same
    assert validate_keys([]) == 0


def test_packed_keys_round_trip_and_errors() -> None:
    from ctxmem_common.keys import pack_keys, unpack_keys

    keys = chain_hashes(range(64), 1)
    packed = pack_keys(keys)
    assert packed is not None and packed[1] == 32
    assert unpack_keys(*packed) == keys
    assert pack_keys([b"a", b"bb"]) is None  # unequal lengths: send them repeated
    with pytest.raises(InvalidArgument, match="not a multiple of key_len=32"):
        unpack_keys(packed[0][:-1], 32)
    with pytest.raises(InvalidArgument, match="key_len=65"):
        unpack_keys(b"x" * 65, 65)


def test_pack_keys_refuses_unequal_lengths_with_an_equal_total() -> None:
    from ctxmem_common.keys import pack_keys

    # 3 keys, the first 2 bytes long, 6 bytes in all: only the lengths tell them apart.
    assert pack_keys([b"aa", b"b", b"ccc"]) is None
    assert pack_keys([b"aa", b"bb", b"cc"]) == (b"aabbcc", 2)
    assert pack_keys([]) is None


def test_unpack_keys_bounds_and_duplicates() -> None:
    from ctxmem_common.keys import unpack_keys

    with pytest.raises(InvalidArgument, match="holds 5 keys; one request takes at most 4"):
        unpack_keys(b"abcde", 1, max_keys=4)
    assert unpack_keys(b"abcd", 1, max_keys=4) == [b"a", b"b", b"c", b"d"]
    assert unpack_keys(b"abcdefgcd", 3) == [b"abc", b"def", b"gcd"]
    with pytest.raises(InvalidArgument, match=r"keys\[2\] duplicates keys\[0\]"):
        unpack_keys(b"abcdab", 2)
    long_keys = [b"12345678" + bytes([i]) * 8 for i in range(3)]  # equal first 8 bytes
    assert unpack_keys(b"".join(long_keys), 16) == long_keys
    with pytest.raises(InvalidArgument, match=r"keys\[3\] duplicates keys\[1\]"):
        unpack_keys(b"".join([*long_keys, long_keys[1]]), 16)


@pytest.mark.parametrize("key_len", [1, 7, 8, 9, 33, 64])
def test_packed_key_array_finds_every_duplicate_at_every_key_length(key_len: int) -> None:
    """The duplicate check reads each key's first 8 bytes in place (a strided view for
    keys of 8 bytes or more, unaligned for odd lengths): a wrong offset or stride would
    miss duplicates or split keys wrongly."""
    import numpy as np

    from ctxmem_common.keys import packed_key_array

    rng = np.random.default_rng(key_len)
    n = min(200, 256 ** key_len)
    keys = list(dict.fromkeys(rng.bytes(key_len) for _ in range(2 * n)))[:n]
    if key_len > 8:  # keys equal in their first 8 bytes, different after: no duplicate
        keys[1] = keys[0][:8] + bytes(b ^ 1 for b in keys[0][8:9]) + keys[0][9:]
    arr = packed_key_array(b"".join(keys), key_len)
    assert arr.tolist() == keys
    for i, j in ((0, 1), (5, len(keys) - 1), (len(keys) - 2, len(keys) - 1)):
        dup = [*keys[:j], keys[i], *keys[j:]]
        with pytest.raises(InvalidArgument, match=rf"keys\[{j}\] duplicates keys\[{i}\]"):
            packed_key_array(b"".join(dup), key_len)
