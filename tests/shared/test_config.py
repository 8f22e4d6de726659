from __future__ import annotations

from pathlib import Path

import pytest

from ctxmem_common.config import default_config_yaml, load_config, parse_config
from ctxmem_common.errors import ConfigError


def test_embedded_default_is_valid() -> None:
    cfg = load_config()
    assert cfg.mode == "fallback"
    assert cfg.dram.size == 1 << 30 and cfg.flash.devices[0].size == 4 << 30
    assert parse_config(default_config_yaml()) == cfg


@pytest.mark.parametrize(("text", "message"), [
    ("dram: {sise: 1GiB}",
     r"dram\.sise: unknown key; allowed keys here are \['prefault', 'size', 'slab_size'\]"),
    ("flash: {write_policy: wb}", r"flash\.write_policy: 'wb' is not one of"),
    ("dram: {size: lots}", r"dram\.size: cannot parse size 'lots'"),
    ("service: {lease_ttl_s: soon}", r"service\.lease_ttl_s: expected a number"),
    ("flash: {devices: [{backend: local, path: /x}]}", r"flash\.devices\[0\]\.name: required"),
    ("flash: {devices: [{name: a, backend: local}]}", r"flash\.devices\[0\]\.path: required"),
    ("flash: {devices: [{name: a, path: /x}, {name: a, path: /y}]}", "used twice"),
    ("encryption: {enabled: yes please}", r"encryption\.enabled: expected true or false"),
    ("service: {transports: [shm], shm_socket: ''}", "shm_socket: required"),
    ("dram: {size: 1MiB, slab_size: 64MiB}", "smaller than one slab"),
    ("flash: {demote_batch: 0}", r"flash\.demote_batch: must be >= 1"),
    ("flash: {demote_batch_bytes: 2GiB}", r"flash\.demote_batch_bytes: must be at most 1 GiB"),
    ("flash: {demote_batch_bytes: lots}", r"flash\.demote_batch_bytes: cannot parse size"),
    ("mode: turbo", r"mode: 'turbo' is not one of \['fallback', 'dpu'\]"),
    ("- not a mapping", "expected a mapping"),
    ("dram: [unclosed", "not valid YAML"),
])
def test_invalid_configs_name_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*nope\.yaml.*errno 2"):
        load_config(tmp_path / "nope.yaml")


def test_sizes_accept_units_and_integers() -> None:
    cfg = parse_config("dram: {size: 2GiB, slab_size: 4194304}")
    assert cfg.dram.size == 2 << 30 and cfg.dram.slab_size == 4 << 20


def test_config_reference_doc_is_current() -> None:
    from ctxmem_common.config import reference_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == reference_markdown(), (
        "docs/config.md is stale: regenerate with python -c 'from ctxmem_common.config import "
        "reference_markdown as r; open(\"docs/config.md\", \"w\").write(r())'")
