"""The example service configs under deploy/ pass the service's own config validator.

Covers deploy/configs/*.yaml, the `config` value of the Helm chart and the config inside
the DPUService example, so that what the manifests ship is what the service accepts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "deploy" / "configs"
CHART_VALUES = ROOT / "deploy" / "helm" / "ctxmem" / "values.yaml"
DPUSERVICE = ROOT / "deploy" / "helm" / "dpuservice-example.yaml"

# The config schema's top-level and per-section keys as the service documents them;
# a typo here would be an unknown-key error at start.
SCHEMA_SECTIONS = {
    "mode", "service", "metrics", "dram", "flash", "eviction", "encryption", "logging",
    "tls",
}
# The tls: section the TLS branch adds to the service (docs/security.md); the chart adds
# the same section from its `tls` values.
TLS_DIR = "/etc/ctxmem/tls"


def _chart_tls(values: dict[str, Any]) -> dict[str, Any] | None:
    """The tls: section the chart generates for these values (templates/_helpers.tpl,
    ctxmem.configYaml), or None with TLS off."""
    tls = values.get("tls") or {}
    if not tls.get("enabled"):
        return None
    out: dict[str, Any] = {"cert_file": f"{TLS_DIR}/tls.crt", "key_file": f"{TLS_DIR}/tls.key"}
    if tls.get("clientCA"):
        out["client_ca_file"] = f"{TLS_DIR}/ca.crt"
    out["reload_interval_s"] = tls.get("reloadIntervalSeconds", 10)
    return out


def _chart_values() -> dict[str, dict[str, Any]]:
    """The chart values each embedded config is rendered with: the chart's defaults, and
    the DPUService's values over them."""
    values = yaml.safe_load(CHART_VALUES.read_text())
    dpusvc = yaml.safe_load(DPUSERVICE.read_text())["spec"]["helmChart"]["values"]
    merged = {**values, **dpusvc}
    return {"helm-values": values, "dpuservice-example": merged}


def _effective(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A config as the service gets it: an embedded one with the chart's tls: section."""
    values = _chart_values().get(name)
    if values is None:
        return cfg
    tls = _chart_tls(values)
    return {**cfg, "tls": tls} if tls else cfg


def _embedded_configs() -> dict[str, dict[str, Any]]:
    values = yaml.safe_load(CHART_VALUES.read_text())
    dpusvc = yaml.safe_load(DPUSERVICE.read_text())
    return {
        "helm-values": values["config"],
        "dpuservice-example": dpusvc["spec"]["helmChart"]["values"]["config"],
    }


def _all_configs(tmp_path: Path, with_tls: bool = True) -> list[Path]:
    """Every shipped config as a file: deploy/configs/*.yaml and the embedded ones (with
    the chart's tls: section added). ``with_tls`` False: the tls: section removed (the
    loopback-only variants, checked in insecure mode)."""
    out_dir = tmp_path / ("tls" if with_tls else "notls")
    out_dir.mkdir(exist_ok=True)
    raw = {p.stem: yaml.safe_load(p.read_text()) for p in sorted(CONFIG_DIR.glob("*.yaml"))}
    for name, cfg in _embedded_configs().items():
        raw[name] = _effective(name, cfg)
    paths = []
    for name, cfg in raw.items():
        if not with_tls:
            cfg = {k: v for k, v in cfg.items() if k != "tls"}
        p = out_dir / f"{name}.yaml"
        p.write_text(yaml.safe_dump(cfg, sort_keys=False))
        paths.append(p)
    return paths


def test_expected_example_configs_exist() -> None:
    names = {p.name for p in CONFIG_DIR.glob("*.yaml")}
    assert {"dpu-spdk-rdma.yaml", "fallback.yaml"} <= names


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_config_shape(path: Path) -> None:
    cfg = yaml.safe_load(path.read_text())
    assert isinstance(cfg, dict)
    assert set(cfg) <= SCHEMA_SECTIONS, f"unknown sections: {set(cfg) - SCHEMA_SECTIONS}"
    assert cfg["mode"] in ("dpu", "fallback")
    assert cfg["metrics"]["listen"].endswith(":9464"), "probes and scrape annotations use 9464"
    if cfg["mode"] == "dpu":
        # Hosts reach a DPU service over the network; no shared memory with the host.
        assert cfg["service"]["listen"].startswith("0.0.0.0:")
        assert cfg["service"]["shm_socket"] == ""
        assert "shm" not in cfg["service"]["transports"]
    if cfg["encryption"].get("enabled"):
        assert cfg["encryption"]["key_file"].startswith("/etc/ctxmem/keys/")


def test_embedded_configs_match_dpu_example() -> None:
    """The chart's default config and the DPU example file agree on everything that
    the deployment depends on (ports, mode, key location)."""
    dpu = yaml.safe_load((CONFIG_DIR / "dpu-spdk-rdma.yaml").read_text())
    for name, cfg in _embedded_configs().items():
        for section, key in [("service", "listen"), ("service", "data_listen"),
                             ("service", "transports"), ("service", "rdma_listen"),
                             ("metrics", "listen"), ("encryption", "key_file")]:
            assert cfg[section][key] == dpu[section][key], f"{name}: {section}.{key}"
        assert cfg["mode"] == "dpu", name


def _listens(cfg: dict[str, Any]) -> list[str]:
    """The addresses clients reach (ctxmem_common.identity.network_listens), from the raw
    YAML: gRPC, and the TCP data plane when tcp is a transport."""
    svc = cfg.get("service") or {}
    out = [svc.get("listen", "127.0.0.1:50051")]
    if "tcp" in svc.get("transports", ["shm", "tcp"]):
        out.append(svc.get("data_listen", "127.0.0.1:50052"))
    return out


def test_no_config_listens_beyond_loopback_without_tls_or_tokens(tmp_path: Path) -> None:
    """Issue 12: no shipped config binds beyond loopback without mutual TLS or tenant
    tokens; none carries a secret inline (no tokens, no placeholders); metrics, which are
    unauthenticated, listen on loopback; fallback.yaml stays on loopback."""
    from ctxmem_common.identity import is_local_listen

    for path in _all_configs(tmp_path, with_tls=True):
        cfg = yaml.safe_load(path.read_text())
        svc = cfg.get("service") or {}
        assert not svc.get("tenant_tokens"), f"{path.name}: tokens inline in a shipped file"
        exposed = [a for a in _listens(cfg) if not is_local_listen(a)]
        if exposed:
            tls = cfg.get("tls") or {}
            assert tls.get("client_ca_file") and tls.get("cert_file") and tls.get("key_file"), (
                f"{path.name}: listens on {exposed} without mutual TLS")
            assert all(str(tls[k]).startswith(f"{TLS_DIR}/")
                       for k in ("cert_file", "key_file", "client_ca_file")), path.name
            assert not svc.get("insecure"), path.name
        assert is_local_listen(cfg["metrics"]["listen"]), f"{path.name}: metrics beyond loopback"
    fallback = yaml.safe_load((CONFIG_DIR / "fallback.yaml").read_text())
    assert all(is_local_listen(a) for a in _listens(fallback))
    assert "tls" not in fallback and fallback["service"]["insecure"] is True


def test_dpu_configs_pass_identity_check_with_tls(tmp_path: Path) -> None:
    """With the TLS branch merged: the DPU configs' mutual TLS satisfies the service's
    start-up rule (check_identity_mode) on their non-loopback addresses."""
    from ctxmem_common.config import load_config
    from ctxmem_common.identity import check_identity_mode, is_local_listen, network_listens

    for path in _all_configs(tmp_path, with_tls=True):
        cfg = load_config(path)
        check_identity_mode(cfg)  # raises ConfigError if the service would refuse it
        if any(not is_local_listen(a) for _k, a in network_listens(cfg)):
            assert cfg.tls.client_ca_file, path


def test_loopback_configs_pass_identity_check(tmp_path: Path) -> None:
    """The configs that listen on loopback only start as they are (insecure mode)."""
    from ctxmem_common.config import load_config
    from ctxmem_common.identity import check_identity_mode, is_local_listen, network_listens

    for path in _all_configs(tmp_path, with_tls=False):
        cfg = load_config(path)
        if all(is_local_listen(a) for _k, a in network_listens(cfg)):
            assert check_identity_mode(cfg) == "insecure", path


def test_tokens_mode_still_works_for_exposed_configs() -> None:
    """An operator who adds real tenant tokens (instead of, or with, TLS) gets a config
    the service starts with; a placeholder is refused."""
    from ctxmem_common.config import load_config
    from ctxmem_common.errors import ConfigError
    from ctxmem_common.identity import check_identity_mode

    cfg = load_config(CONFIG_DIR / "fallback.yaml")
    svc = dataclasses.replace(cfg.service, insecure=False, listen="0.0.0.0:50051",
                              tenant_tokens={"team-a": "s3cret-token-0123456789"})
    assert check_identity_mode(cfg.replace(service=svc)) == "tokens"
    bad = dataclasses.replace(svc, tenant_tokens={"team-a": "CHANGE-ME-to-a-secret"})
    with pytest.raises(ConfigError, match="placeholder"):
        check_identity_mode(cfg.replace(service=bad))


def test_configs_load_with_service_validator(tmp_path: Path) -> None:
    from ctxmem_common.config import load_config

    for path in _all_configs(tmp_path, with_tls=False):
        cfg = load_config(path)
        assert cfg.mode in ("dpu", "fallback"), path


def test_configs_with_tls_load_with_service_validator(tmp_path: Path) -> None:
    from ctxmem_common.config import load_config

    for path in _all_configs(tmp_path, with_tls=True):
        cfg = yaml.safe_load(path.read_text())
        loaded = load_config(path)
        if "tls" in cfg:
            tls = loaded.tls
            assert tls.cert_file == cfg["tls"]["cert_file"], path
            assert tls.client_ca_file == cfg["tls"].get("client_ca_file", ""), path


def test_flash_devices_validate(tmp_path: Path) -> None:
    """Each flash device entry passes the storage layer's stricter per-backend check."""
    from ctxmem_dpu.storage import parse_device_spec

    for path in _all_configs(tmp_path):
        cfg = yaml.safe_load(path.read_text())
        for i, dev in enumerate(cfg["flash"]["devices"]):
            spec = parse_device_spec(dev, f"{path.name}: flash.devices[{i}]")
            assert spec.name == dev["name"]
