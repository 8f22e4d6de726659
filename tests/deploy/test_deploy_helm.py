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
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == 9464
    for kind in ("requests", "limits"):
        assert c["resources"][kind]["nvidia.com/bf_sf"] == 1
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == "9464"
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


def test_render_config_is_values_config() -> None:
    docs = _render()
    cm = next(o for o in _objects(docs) if o["kind"] == "ConfigMap")
    assert yaml.safe_load(cm["data"]["ctxmem.yaml"]) == _values()["config"]


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


def test_helm_lint() -> None:
    result = _helm().lint(str(CHART))
    assert not result["errors"], result
    severe = [m for m in result["messages"] if m["severity"] > 1]
    assert not severe, severe
