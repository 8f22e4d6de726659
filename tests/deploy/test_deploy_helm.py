"""The Helm chart that DPF deploys as a DPUService.

Two layers of checks:
- renderer-free: Chart.yaml, values.yaml and the template sources carry DPF's chart
  contract (one DaemonSet, `serviceDaemonSet.*` values, Release.Name in every object
  name, the doca-version annotation). These always run.
- rendered: the chart is rendered by Helm's own Go engine (v4) through the PyPI package
  `helm-python-sdk` (import name `helm_python`, a ctypes binding of Helm's Go SDK; no
  helm binary, which Debian does not package). Skipped, with the reason, where that
  package is not installed: `pip install helm-python-sdk`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "ctxmem"
DPUSERVICE = ROOT / "deploy" / "helm" / "dpuservice-example.yaml"
TEMPLATES = CHART / "templates"


def _values() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(values, dict)
    return values


# ---------------------------------------------------------------- renderer-free
def test_chart_metadata(project_version: str) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "ctxmem"
    assert chart["type"] == "application"
    assert chart["appVersion"] == project_version
    assert re.match(r"^\d+\.\d+\.\d+", chart["version"])
    assert chart["annotations"]["dpu.nvidia.com/doca-version"].startswith(">=")


def test_values_have_dpf_contract_keys() -> None:
    values = _values()
    sds = values["serviceDaemonSet"]
    for key in ("nodeSelector", "labels", "annotations", "updateStrategy", "resources"):
        assert key in sds, f"serviceDaemonSet.{key}"
    assert values["nodeSelector"]["kubernetes.io/arch"] == "arm64"
    for kind in ("requests", "limits"):
        assert values["resources"][kind]["nvidia.com/bf_sf"] >= 1
    assert values["probes"]["liveness"]["httpGet"]["path"] == "/healthz"
    assert values["probes"]["readiness"]["httpGet"]["path"] == "/readyz"
    assert values["metrics"]["scrapeAnnotations"] is True
    assert values["config"]["metrics"]["listen"].endswith(f":{values['ports']['metrics']}")


def test_templates_one_daemonset_and_release_names() -> None:
    sources = {p.name: p.read_text() for p in TEMPLATES.glob("*.yaml")}
    kinds = [k for text in sources.values() for k in re.findall(r"^kind:\s*(\S+)", text, re.M)]
    assert kinds.count("DaemonSet") == 1, kinds
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    assert ".Release.Name" in helpers
    for name, text in sources.items():
        for line in re.findall(r"^  name:.*$", text, re.M):
            named = ('include "ctxmem.fullname"', 'include "ctxmem.keySecretName"')
            assert any(n in line for n in named), (
                f"{name}: object name without the release name: {line.strip()}"
            )
    ds = sources["daemonset.yaml"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in ds
    assert ".Values.serviceDaemonSet.nodeSelector" in ds
    assert ".Values.serviceDaemonSet.updateStrategy" in ds


# ---------------------------------------------------------------- rendered by Helm
def _helm() -> Any:
    """The helm_python module, or skip the calling test (renderer-free tests still run)."""
    return pytest.importorskip(
        "helm_python",
        reason="helm-python-sdk (Helm's Go engine for Python) is not installed: "
        "pip install helm-python-sdk",
    )


def _render(values: dict[str, Any] | None = None, name: str = "ctxmem",
            namespace: str = "dpf-operator-system") -> dict[str, list[dict[str, Any]]]:
    """Render the chart; returns the parsed documents by template file name."""
    helm = _helm()
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name=name, namespace=namespace)
    docs: dict[str, list[dict[str, Any]]] = {}
    for path, text in out.items():
        if not path.endswith((".yaml", ".yml")):
            continue
        parsed = [d for d in yaml.safe_load_all(text) if d]
        docs[Path(path).name] = parsed
    return docs


def _objects(docs: dict[str, list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    for parsed in docs.values():
        yield from parsed


def _daemonset(docs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ds = [o for o in _objects(docs) if o["kind"] == "DaemonSet"]
    assert len(ds) == 1
    return ds[0]


def _dpf_values() -> dict[str, Any]:
    """What DPF passes to Helm for the example DPUService: spec.helmChart.values, plus
    serviceID and serviceDaemonSet from the spec."""
    spec = yaml.safe_load(DPUSERVICE.read_text())["spec"]
    values = copy.deepcopy(spec["helmChart"]["values"])
    values["serviceID"] = spec["serviceID"]
    values["serviceDaemonSet"] = spec["serviceDaemonSet"]
    return values


def test_render_defaults() -> None:
    docs = _render()
    kinds = sorted(o["kind"] for o in _objects(docs))
    assert kinds == ["ConfigMap", "DaemonSet"], "Secret only with masterKey.create"
    ds = _daemonset(docs)
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    c = spec["containers"][0]
    assert spec["nodeSelector"] == {"kubernetes.io/arch": "arm64"}
    assert "affinity" not in spec, "no DPF node selector given"
    assert spec["hostNetwork"] is True
    assert c["image"] == "registry.example.com/ctxmem:0.1.0-arm64"
    assert c["args"] == ["serve", "--config", "/etc/ctxmem/ctxmem.yaml"]
    # Metrics (unauthenticated) on loopback; the kubelet reaches it there (hostNetwork).
    local = {"host": "127.0.0.1", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {**local, "path": "/healthz"}
    assert c["readinessProbe"]["httpGet"] == {**local, "path": "/readyz"}
    assert c["startupProbe"]["httpGet"] == {**local, "path": "/healthz"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == 9464
    for kind in ("requests", "limits"):
        assert c["resources"][kind]["nvidia.com/bf_sf"] == 1
    ann = pod["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in ann, "a loopback endpoint cannot be scraped"
    assert re.fullmatch(r"[0-9a-f]{64}", ann["checksum/config"])
    assert pod["metadata"]["labels"]["svc.dpu.nvidia.com/service"] == "ctxmem"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert set(m["name"] for m in c["volumeMounts"]) <= set(volumes)
    # A subPath mount: the key is a plain file, not the symbolic link a Secret volume
    # holds (the service opens it O_NOFOLLOW).
    key_mount = mounts["/etc/ctxmem/keys/master.key"]
    assert key_mount["subPath"] == "master.key" and key_mount["readOnly"] is True
    key_volume = volumes[key_mount["name"]]
    assert key_volume["secret"]["secretName"] == "ctxmem-master-key"
    config_volume = volumes[mounts["/etc/ctxmem/ctxmem.yaml"]["name"]]
    assert config_volume["configMap"]["name"] == "ctxmem-config"
    assert "/hugepages" in mounts
    # Mutual TLS by default: the kubernetes.io/tls Secret as a directory (rotation).
    tls_mount = mounts["/etc/ctxmem/tls"]
    assert tls_mount["readOnly"] is True and "subPath" not in tls_mount
    tls_volume = volumes[tls_mount["name"]]["secret"]
    assert tls_volume["secretName"] == "ctxmem-tls"
    assert {i["key"] for i in tls_volume["items"]} == {"tls.crt", "tls.key", "ca.crt"}
    assert tls_volume["defaultMode"] == 0o400
    assert "initContainers" not in spec, "no tenant tokens configured"


def _config_of(docs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    cm = next(o for o in _objects(docs) if o["kind"] == "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["ctxmem.yaml"])
    assert isinstance(cfg, dict)
    return cfg


TLS_SECTION = {"cert_file": "/etc/ctxmem/tls/tls.crt", "key_file": "/etc/ctxmem/tls/tls.key",
               "client_ca_file": "/etc/ctxmem/tls/ca.crt", "reload_interval_s": 10}


def test_render_config_is_values_config_plus_tls() -> None:
    cfg = _config_of(_render())
    assert cfg == {**_values()["config"], "tls": TLS_SECTION}
    assert "tenant_tokens" not in cfg["service"], "no secret in the ConfigMap"


def test_render_generated_config_passes_service_schema(tmp_path: Path) -> None:
    """The config the chart generates (tls: included) is what the service accepts and
    starts with: mutual TLS satisfies the non-loopback rule."""
    from ctxmem_common.config import load_config
    from ctxmem_common.identity import check_identity_mode

    for values in ({}, _dpf_values()):
        path = tmp_path / "ctxmem.yaml"
        path.write_text(yaml.safe_dump(_config_of(_render(values))))
        cfg = load_config(path)
        assert cfg.tls.client_ca_file == "/etc/ctxmem/tls/ca.crt"
        check_identity_mode(cfg)


def test_render_tls_server_only_with_tokens() -> None:
    docs = _render({"tls": {"clientCA": False},
                    "tenantTokens": {"existingSecret": "ctxmem-tenant-tokens"}})
    cfg = _config_of(docs)
    assert cfg["tls"] == {k: v for k, v in TLS_SECTION.items() if k != "client_ca_file"}
    spec = _daemonset(docs)["spec"]["template"]["spec"]
    tls = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert {i["key"] for i in tls["secret"]["items"]} == {"tls.crt", "tls.key"}


def test_render_tls_off_with_tokens_from_secret() -> None:
    """Tokens never pass through values: an init container merges the Secret's keys
    (tenant -> token) into a 0600 config in a memory emptyDir that the service reads."""
    docs = _render({"tls": {"enabled": False},
                    "tenantTokens": {"existingSecret": "ctxmem-tenant-tokens"}})
    cfg = _config_of(docs)
    assert "tls" not in cfg and "tenant_tokens" not in cfg["service"]
    spec = _daemonset(docs)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    c = spec["containers"][0]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert "/etc/ctxmem/tls" not in mounts and "tls" not in volumes
    (init,) = spec["initContainers"]
    assert init["image"] == c["image"]
    assert init["securityContext"] == c["securityContext"], "same uid writes and reads it"
    init_mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    tok = volumes[init_mounts["/etc/ctxmem/tenant-tokens"]["name"]]
    assert tok["secret"] == {"secretName": "ctxmem-tenant-tokens", "defaultMode": 0o400}
    rendered = init_mounts["/etc/ctxmem/rendered"]["name"]
    assert volumes[rendered]["emptyDir"]["medium"] == "Memory"
    cfg_mount = mounts["/etc/ctxmem/ctxmem.yaml"]
    assert cfg_mount["name"] == rendered and cfg_mount["subPath"] == "ctxmem.yaml"
    assert init["command"][1:] == ["/etc/ctxmem/chart/merge-tokens.py",
                                   "/etc/ctxmem/chart/ctxmem.yaml",
                                   "/etc/ctxmem/tenant-tokens",
                                   "/etc/ctxmem/rendered/ctxmem.yaml"]
    assert volumes[init_mounts["/etc/ctxmem/chart"]["name"]]["configMap"]["name"] == (
        "ctxmem-config")
    cm = next(o for o in _objects(docs) if o["kind"] == "ConfigMap")
    assert cm["data"]["merge-tokens.py"] == (CHART / "files" / "merge-tokens.py").read_text()


def test_merge_tokens_script(tmp_path: Path) -> None:
    """The init container's script, run on a directory laid out like a Secret volume
    (..data symlinks), on the config the chart renders; the result starts the service
    in tokens mode."""
    import os
    import subprocess
    import sys

    from ctxmem_common.config import load_config
    from ctxmem_common.identity import check_identity_mode

    docs = _render({"tls": {"enabled": False},
                    "tenantTokens": {"existingSecret": "ctxmem-tenant-tokens"}})
    cm = next(o for o in _objects(docs) if o["kind"] == "ConfigMap")
    chart_dir = tmp_path / "chart"
    chart_dir.mkdir()
    for key, text in cm["data"].items():
        (chart_dir / key).write_text(text)
    secret = tmp_path / "tokens"
    stamp = secret / "..2026_11_24_00_00_00.000000001"
    stamp.mkdir(parents=True)
    tokens = {"team-a": "a" * 32, "team-b": "b-token-0123456789"}
    for tenant, token in tokens.items():
        (stamp / tenant).write_text(token + "\n")
    os.symlink(stamp.name, secret / "..data")
    for tenant in tokens:
        os.symlink(f"..data/{tenant}", secret / tenant)
    out = tmp_path / "rendered" / "ctxmem.yaml"
    out.parent.mkdir()
    res = subprocess.run([sys.executable, str(chart_dir / "merge-tokens.py"),
                          str(chart_dir / "ctxmem.yaml"), str(secret), str(out)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert "team-a" in res.stdout and "a" * 32 not in res.stdout, "names logged, not tokens"
    assert out.stat().st_mode & 0o777 == 0o600
    cfg = load_config(out)
    assert cfg.service.tenant_tokens == tokens
    assert check_identity_mode(cfg) == "tokens"
    # An empty Secret is an init-container failure that says why.
    empty = tmp_path / "empty"
    empty.mkdir()
    res = subprocess.run([sys.executable, str(chart_dir / "merge-tokens.py"),
                          str(chart_dir / "ctxmem.yaml"), str(empty), str(out)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 1 and "no tenant tokens" in res.stderr


def test_render_metrics_exposed_on_purpose() -> None:
    values = _values()
    values["config"]["metrics"]["listen"] = "0.0.0.0:9464"
    values["metrics"]["exposed"] = True
    pod = _daemonset(_render(values))["spec"]["template"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9464"
    probe = pod["spec"]["containers"][0]["livenessProbe"]["httpGet"]
    assert "host" not in probe, "probes go to the pod IP"


def test_render_loopback_without_tls_or_tokens() -> None:
    """A loopback-only config may run insecure (one trust domain): nothing is refused."""
    values = _values()
    values["tls"]["enabled"] = False
    svc = values["config"]["service"]
    svc.update(listen="127.0.0.1:50051", data_listen="127.0.0.1:50052", insecure=True)
    cfg = _config_of(_render(values))
    assert "tls" not in cfg and cfg["service"]["insecure"] is True


def test_render_dpuservice_example_values() -> None:
    values = _dpf_values()
    ds = _daemonset(_render(values))
    spec = ds["spec"]
    pod = spec["template"]
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == values["serviceDaemonSet"]["nodeSelector"]
    assert pod["spec"]["nodeSelector"]["kubernetes.io/arch"] == "arm64"
    assert spec["updateStrategy"] == values["serviceDaemonSet"]["updateStrategy"]
    for key, val in values["serviceDaemonSet"]["labels"].items():
        assert ds["metadata"]["labels"][key] == val
        assert pod["metadata"]["labels"][key] == val
    for key, val in values["serviceDaemonSet"]["annotations"].items():
        assert pod["metadata"]["annotations"][key] == val
    c = pod["spec"]["containers"][0]
    assert c["image"] == "registry.example.com/ctxmem:0.1.0-arm64"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "dpf-pull-secret"}]
    for kind in ("requests", "limits"):
        assert c["resources"][kind]["nvidia.com/bf_sf"] == 1


def test_render_release_name_in_every_object() -> None:
    docs = _render({"masterKey": {"create": True, "value": "00" * 32}}, name="cm-v2")
    objs = list(_objects(docs))
    assert sorted(o["kind"] for o in objs) == ["ConfigMap", "DaemonSet", "Secret"]
    for o in objs:
        assert "cm-v2" in o["metadata"]["name"], o["metadata"]["name"]


def test_render_resources_from_service_daemonset_override() -> None:
    ds = _daemonset(_render({"serviceDaemonSet": {"resources": {"nvidia.com/bf_sf": 2,
                                                               "memory": "16Gi"}}}))
    res = ds["spec"]["template"]["spec"]["containers"][0]["resources"]
    for kind in ("requests", "limits"):
        assert res[kind]["nvidia.com/bf_sf"] == 2
        assert res[kind]["memory"] == "16Gi"
    assert res["requests"]["cpu"] == "4", "untouched entries keep the chart's values"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ports": {"metrics": 9999}}, "ports.metrics"),
        ({"config": {"encryption": {"enabled": True, "key_file": "/tmp/k"}}}, "key_file"),
        ({"masterKey": {"create": True, "value": ""}}, "masterKey.value"),
    ],
)
def test_render_rejects_inconsistent_values(values: dict[str, Any], message: str) -> None:
    merged = _values()
    for key, val in values.items():
        if isinstance(val, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **val}
        else:
            merged[key] = val
    with pytest.raises(Exception, match=re.escape(message)):
        _render(merged)


def _with(values: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = values
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return values


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # 0.0.0.0 with neither mutual TLS nor tokens (gRPC and TCP data plane).
        ({"tls.enabled": False}, "neither mutual TLS nor tenant tokens"),
        ({"tls.enabled": False, "config.service.transports": ["rdma"]},
         "service.listen=0.0.0.0:50051"),
        ({"tls.enabled": False, "config.service.listen": "127.0.0.1:50051"},
         "service.data_listen=0.0.0.0:50052"),
        # server-only TLS does not say who the tenant is
        ({"tls.clientCA": False}, "does not identify tenants"),
        ({"tls.secretName": ""}, "tls.secretName"),
        # secrets never in values
        ({"config.service.tenant_tokens": {"a": "s3cret-token-0123456789"}},
         "tenantTokens.existingSecret"),
        ({"config.tls": {"cert_file": "/x"}}, "config.tls is generated by the chart"),
        ({"tenantTokens.existingSecret": "t", "config.service.insecure": True},
         "refused beyond loopback"),
        # the unauthenticated metrics endpoint stays on loopback unless exposed on purpose
        ({"config.metrics.listen": "0.0.0.0:9464"}, "metrics.exposed"),
        ({"hostNetwork": False}, "hostNetwork is false"),
    ],
    ids=["no-tls-no-tokens", "grpc-only", "data-plane-only", "server-tls-no-tokens",
         "tls-no-secret", "inline-tokens", "inline-tls", "insecure-exposed",
         "metrics-exposed", "loopback-metrics-no-hostnetwork"],
)
def test_render_refuses_trust_boundary_violations(changes: dict[str, Any],
                                                  message: str) -> None:
    values = _values()
    for path, value in changes.items():
        _with(values, path, value)
    with pytest.raises(Exception, match=re.escape(message)):
        _render(values)


def test_render_tls_off_dpuservice_refused() -> None:
    """The DPUService example, TLS turned off, would bind 0.0.0.0 with no identity."""
    values = _dpf_values()
    values["tls"]["enabled"] = False
    with pytest.raises(Exception, match="neither mutual TLS nor tenant tokens"):
        _render(values)


def test_helm_lint() -> None:
    result = _helm().lint(str(CHART))
    assert not result["errors"], result
    severe = [m for m in result["messages"] if m["severity"] > 1]
    assert not severe, severe
