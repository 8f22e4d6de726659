"""`ctxmem config check FILE` (issue 18, item 6): the typed loader's verdict without
starting anything; the effective config printed with defaults; missing files warned."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import yaml

from ctxmem_common.config import load_config, parse_config
from ctxmem_common.configcheck import config_command

REPO = Path(__file__).resolve().parents[2]


def _check(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = config_command(["check", str(path)])
    return rc, out.getvalue(), err.getvalue()


def _write(tmp_path: Path, cfg: dict[str, object]) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_valid_config_prints_effective_config(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "nvme0.img"
    p = _write(tmp_path, {
        "service": {"insecure": True},
        "dram": {"size": "256MiB"},
        "flash": {"devices": [{"name": "d0", "path": str(missing), "size": "1GiB"}]},
        "encryption": {"key_file": str(tmp_path / "no.key")},
    })
    rc, out, err = _check(p)
    assert rc == 0, err
    eff = yaml.safe_load(out)
    assert eff["dram"]["size"] == 256 << 20
    assert eff["dram"]["slab_size"] == 64 << 20  # a default filled in
    assert eff["service"]["lease_ttl_s"] == 30.0
    assert eff["flash"]["devices"][0]["backend"] == "local"
    # The output is itself a valid config, and the same one.
    assert parse_config(out) == load_config(p)
    # Nothing was created or opened: the device and key file are warnings only.
    assert not missing.parent.exists() and not (tmp_path / "no.key").exists()
    assert f"flash.devices[0].path: {missing} does not exist" in err
    assert f"encryption.key_file: {tmp_path / 'no.key'} does not exist" in err


def test_kernel_and_spdk_subkeys_checked(tmp_path: Path) -> None:
    rc, out, err = _check(_write(tmp_path, {"flash": {"devices": [
        {"name": "k", "backend": "kernel", "size": "1GiB",
         "kernel": {"transport": "tcp", "traddr": "10.0.0.2", "trsvcid": "4420",
                    "subnqn": "nqn.2024-01.io.x:ns", "bogus": 1}}]}}))
    assert rc == 2 and out == ""
    assert "flash.devices[0].kernel.bogus: unknown key" in err


@pytest.mark.parametrize("cfg, message", [
    ({"dram": {"size": "1MiB"}}, "dram.size"),
    ({"service": {"transports": ["smoke-signals"]}}, "service.transports"),
    ({"service": {"listen": "0.0.0.0:50051", "insecure": True}}, "insecure"),
    ({"bogus": 1}, "bogus"),
])
def test_invalid_config_names_the_key(tmp_path: Path, cfg: dict[str, object],
                                      message: str) -> None:
    rc, out, err = _check(_write(tmp_path, cfg))
    assert rc == 2 and out == ""
    assert err.startswith("ctxmem config check: invalid: ")
    assert message in err


def test_tokens_redacted(tmp_path: Path) -> None:
    rc, out, err = _check(_write(tmp_path, {"service": {"tenant_tokens": {
        "a": "s3cret-token-0123456789"}}}))
    assert rc == 0, err
    assert "s3cret" not in out
    assert yaml.safe_load(out)["service"]["tenant_tokens"] == {"a": "<redacted>"}


@pytest.mark.parametrize("name", sorted(os.listdir(REPO / "deploy" / "configs")))
def test_shipped_configs_check(name: str) -> None:
    rc, out, err = _check(REPO / "deploy" / "configs" / name)
    assert rc == 0, err
    assert out.startswith(f"# {REPO / 'deploy' / 'configs' / name}: valid")


def test_unreadable_file(tmp_path: Path) -> None:
    rc, _, err = _check(tmp_path / "absent.yaml")
    assert rc == 2 and "cannot read config file" in err
