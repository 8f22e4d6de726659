"""Static checks of the deployment manifests: they parse, and carry the fields the
BlueField kubelet, DPF and systemd need (probes, arm64 selection, the SF resource,
scrape annotations, mounts, hardening)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
STATIC_POD = DEPLOY / "kubelet" / "ctxmem-static-pod.yaml"
DPUSERVICE = DEPLOY / "helm" / "dpuservice-example.yaml"
CHART = DEPLOY / "helm" / "ctxmem"
UNITS = [DEPLOY / "systemd" / "ctxmem.service", DEPLOY / "systemd" / "ctxmem-dpu.service"]
SERVE_ARGS = ["serve", "--config", "/etc/ctxmem/ctxmem.yaml"]


def _plain_yaml_files() -> list[Path]:
    """Every YAML file under deploy/ except Helm templates (Go templates, not YAML)."""
    files = [*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]
    return sorted(p for p in files if "templates" not in p.relative_to(DEPLOY).parts)


@pytest.mark.parametrize("path", _plain_yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs)


# ---------------------------------------------------------------- static pod
@pytest.fixture(scope="module")
def pod() -> dict[str, Any]:
    doc = yaml.safe_load(STATIC_POD.read_text())
    assert isinstance(doc, dict)
    return doc


def _container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec["containers"]
    assert len(containers) == 1
    c = containers[0]
    assert isinstance(c, dict)
    return c


def test_static_pod_basics(pod: dict[str, Any], project_version: str) -> None:
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    spec = pod["spec"]
    assert spec["hostNetwork"] is True
    assert spec["nodeSelector"]["kubernetes.io/arch"] == "arm64"
    c = _container(spec)
    assert c["image"].endswith(f"ctxmem:{project_version}-arm64")
    assert c["imagePullPolicy"] == "Never", "no registry on the card: the image is imported"
    assert c["args"] == SERVE_ARGS
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "data": 50052, "metrics": 9464}


def test_static_pod_probes_and_annotations(pod: dict[str, Any]) -> None:
    c = _container(pod["spec"])
    # The metrics endpoint is unauthenticated, so it listens on loopback (the example
    # config); with hostNetwork the kubelet reaches the pod's loopback there.
    local = {"host": "127.0.0.1", "port": 9464}
    assert c["livenessProbe"]["httpGet"] == {**local, "path": "/healthz"}
    assert c["readinessProbe"]["httpGet"] == {**local, "path": "/readyz"}
    assert c["startupProbe"]["httpGet"] == {**local, "path": "/healthz"}
    ann = pod["metadata"].get("annotations") or {}
    assert "prometheus.io/scrape" not in ann, "nothing can scrape a loopback endpoint"
    dpu = yaml.safe_load((DEPLOY / "configs" / "dpu-spdk-rdma.yaml").read_text())
    assert dpu["metrics"]["listen"] == "127.0.0.1:9464"


def test_static_pod_mounts(pod: dict[str, Any]) -> None:
    spec = pod["spec"]
    c = _container(spec)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for m in c["volumeMounts"]:
        assert m["name"] in volumes, f"mount {m['name']} has no volume"
    assert mounts["/etc/ctxmem"]["readOnly"] is True
    assert mounts["/etc/ctxmem/keys"]["readOnly"] is True
    assert volumes[mounts["/etc/ctxmem/keys"]["name"]]["hostPath"]["path"] == "/etc/ctxmem/keys"
    # TLS files from the card (a static pod has no Secrets): the directory the example
    # config's tls: section names.
    tls = mounts["/etc/ctxmem/tls"]
    assert tls["readOnly"] is True and "subPath" not in tls
    assert volumes[tls["name"]]["hostPath"] == {"path": "/etc/ctxmem/tls", "type": "Directory"}
    dpu = yaml.safe_load((DEPLOY / "configs" / "dpu-spdk-rdma.yaml").read_text())
    for key in ("cert_file", "key_file", "client_ca_file"):
        assert dpu["tls"][key].startswith("/etc/ctxmem/tls/"), key
    assert volumes[mounts["/dev"]["name"]]["hostPath"]["path"] == "/dev"
    assert "/var/tmp" in mounts, "SPDK's RPC socket directory"
    hp = [v for v in spec["volumes"]
          if v.get("emptyDir", {}).get("medium", "").startswith("HugePages")]
    assert hp and any(m["name"] == hp[0]["name"] for m in c["volumeMounts"])
    res = c["resources"]
    assert res["requests"]["hugepages-2Mi"] == res["limits"]["hugepages-2Mi"]
    # A static pod has no device plugin: device access comes from privileged mode.
    assert c["securityContext"]["privileged"] is True


# ---------------------------------------------------------------- DPUService CR
@pytest.fixture(scope="module")
def dpuservice() -> dict[str, Any]:
    doc = yaml.safe_load(DPUSERVICE.read_text())
    assert isinstance(doc, dict)
    return doc


def test_dpuservice_points_at_chart(dpuservice: dict[str, Any]) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert dpuservice["apiVersion"] == "svc.dpu.nvidia.com/v1alpha1"
    assert dpuservice["kind"] == "DPUService"
    assert len(dpuservice["metadata"]["name"]) <= 63
    src = dpuservice["spec"]["helmChart"]["source"]
    assert re.match(r"^(oci|https)://.+", src["repoURL"]), "DPF accepts oci:// or https://"
    assert src["chart"] == chart["name"]
    assert str(src["version"]) == chart["version"]


def test_dpuservice_daemonset_values(dpuservice: dict[str, Any]) -> None:
    spec = dpuservice["spec"]
    sds = spec["serviceDaemonSet"]
    # The fields of DPF's ServiceDaemonSetValues, nothing else.
    assert set(sds) <= {"nodeSelector", "updateStrategy", "labels", "annotations", "resources"}
    assert sds["nodeSelector"]["nodeSelectorTerms"], "a core/v1 NodeSelector"
    assert sds["resources"]["nvidia.com/bf_sf"] >= 1
    assert sds["updateStrategy"]["type"] in ("RollingUpdate", "OnDelete")
    assert spec["serviceID"]
    values = spec["helmChart"]["values"]
    assert values["image"]["tag"].endswith("-arm64")


# ---------------------------------------------------------------- systemd units
def _parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's INI dialect: repeated keys accumulate, `#`/`;` start comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: key outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not a key=value line: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_unit_hardening(path: Path) -> None:
    unit = _parse_unit(path)
    svc = unit["Service"]

    def one(key: str) -> str:
        assert key in svc, f"{path.name}: [Service] {key}= missing"
        return svc[key][-1]

    assert one("User") == "ctxmem"
    assert one("Group") == "ctxmem"
    assert one("ExecStart").endswith("ctxmem " + " ".join(SERVE_ARGS))
    assert one("ProtectSystem") == "strict"
    assert one("NoNewPrivileges") == "yes"
    assert one("ProtectHome") == "yes"
    assert one("LimitMEMLOCK") == "infinity", "RDMA memory registration"
    assert one("Restart") == "on-failure"
    # Readiness from the service itself (sd_notify READY=1: tests/ops/test_sdnotify.py).
    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main", "ExecStart runs the service itself, no wrapper"
    assert one("StateDirectory") == "ctxmem"
    assert one("RuntimeDirectory") == "ctxmem"
    # Device access must stay possible: no private /dev, no closed device policy.
    assert svc.get("PrivateDevices", ["no"])[-1] == "no"
    assert svc.get("DevicePolicy", ["auto"])[-1] == "auto"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_dpu_unit_capabilities() -> None:
    svc = _parse_unit(DEPLOY / "systemd" / "ctxmem-dpu.service")["Service"]
    assert svc["AmbientCapabilities"] == ["CAP_IPC_LOCK"]
    assert svc["CapabilityBoundingSet"] == ["CAP_IPC_LOCK"]
    assert "disk" in svc["SupplementaryGroups"][-1].split(), "ublk devices are group disk"
    assert "PrivateTmp" not in svc, "SPDK's socket is in the real /var/tmp"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd's own parser: unknown keys or bad values are reported. The ExecStart
    binary does not exist on a build machine, so that one complaint is expected."""
    copies = []
    for unit in UNITS:
        dst = tmp_path / unit.name
        dst.write_text(unit.read_text())
        copies.append(str(dst))
    proc = subprocess.run(["systemd-analyze", "verify", *copies], capture_output=True,
                          text=True, timeout=60, check=False)
    problems = [
        line for line in (proc.stdout + proc.stderr).splitlines()
        if line.strip() and "is not executable" not in line
    ]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- build scripts
@pytest.mark.parametrize("script", sorted((DEPLOY / "image").glob("*.sh")), ids=lambda p: p.name)
def test_image_scripts_are_valid_bash(script: Path) -> None:
    assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr


def test_build_script_arguments() -> None:
    build = DEPLOY / "image" / "build.sh"
    ok = subprocess.run(["bash", str(build), "--help"], capture_output=True, text=True,
                        timeout=30, check=False)
    assert ok.returncode == 0 and "--arch arm64|amd64" in ok.stdout
    bad = subprocess.run(["bash", str(build), "--arch", "sparc64"], capture_output=True,
                         text=True, timeout=30, check=False)
    assert bad.returncode == 2 and "--arch must be arm64 or amd64" in bad.stderr
