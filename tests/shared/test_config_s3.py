"""The ``s3:`` section (docs/s3.md): off by default, and each rule names its key."""

from __future__ import annotations

import pytest

from ctxmem_common.config import parse_config
from ctxmem_common.config_s3 import S3AccessKey, s3_secret
from ctxmem_common.errors import ConfigError


def test_off_by_default() -> None:
    cfg = parse_config("mode: fallback\n")
    assert cfg.s3.listen == "" and cfg.s3.access_keys == {}


def test_a_full_section_loads() -> None:
    cfg = parse_config(
        "s3:\n  listen: 127.0.0.1:9000\n  domain: s3.local\n  chunk_size: 1MiB\n"
        "  access_keys:\n    AKIAEXAMPLE1: {tenant: alice, secret_env: S3_ALICE}\n")
    assert cfg.s3.chunk_size == 1 << 20
    assert cfg.s3.access_keys["AKIAEXAMPLE1"] == S3AccessKey("alice", "", "S3_ALICE")


@pytest.mark.parametrize(("section", "message"), [
    ("listen: 127.0.0.1:9000", r"s3.access_keys: the S3 endpoint \(s3.listen\) needs"),
    ("listen: 127.0.0.1:9000\n  access_keys: {AK: {tenant: a, secret: x}}",
     r"s3.access_keys.AK: an access key id is 4 to 128"),
    ("listen: 127.0.0.1:9000\n  access_keys: {AKIA1: {tenant: a, secret: x, secret_env: E}}",
     r"s3.access_keys.AKIA1: set exactly one of secret_env"),
    ("listen: 127.0.0.1:9000\n  access_keys: {AKIA1: {tenant: '', secret: x}}",
     r"s3.access_keys.AKIA1.tenant: required"),
    ("listen: 127.0.0.1:9000\n  access_keys: {AKIA1: {secret: x}}",
     r"s3.access_keys.AKIA1.tenant: required key is missing"),
    ("listen: 127.0.0.1:9000\n  chunk_size: 128MiB\n  access_keys: {AKIA1: {tenant: a, "
     "secret: x}}", r"s3.chunk_size: must be a multiple of 4 KiB, at most dram.slab_size"),
    ("listen: 127.0.0.1:9000\n  max_parts: 20000\n  access_keys: {AKIA1: {tenant: a, "
     "secret: x}}", r"s3.max_parts: 1..10000"),
    ("bogus: 1", r"s3.bogus: unknown key"),
])
def test_bad_sections_name_the_key(section: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(f"s3:\n  {section}\n")


def test_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    key = S3AccessKey("alice", secret_env="CTXMEM_S3_TEST_SECRET")
    monkeypatch.delenv("CTXMEM_S3_TEST_SECRET", raising=False)
    with pytest.raises(ConfigError, match="environment variable CTXMEM_S3_TEST_SECRET"):
        s3_secret("AKIA1", key)
    monkeypatch.setenv("CTXMEM_S3_TEST_SECRET", "from-env")
    assert s3_secret("AKIA1", key) == "from-env"


def test_the_docs_example_loads() -> None:
    """docs/s3.md's configuration block is a valid config."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "s3.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    assert blocks, "docs/s3.md lost its configuration example"
    cfg = parse_config(blocks[0])
    assert cfg.s3.listen and len(cfg.s3.access_keys) == 2
