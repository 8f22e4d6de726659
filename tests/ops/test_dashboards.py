"""The Grafana dashboard and the Prometheus rules in deploy/ (issue 18, item 3).

Every PromQL expression is parsed by promtool (the dashboard's as recording rules of a
throwaway rules file), the alert rules are unit-tested with `promtool test rules`, and
every metric any of them names must exist: in a real service's /metrics, or defined in
the service's code (a metric only a configured feature exports), or be one Prometheus
itself makes (`up`). Names not defined yet are listed in :data:`PENDING`, one place, and a
test fails once the service defines them, so they are then checked for real.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServiceHandle

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "ctxmem-dashboard.json"
RULES = sorted((REPO / "deploy" / "prometheus").glob("*.rules.yaml"))
RULE_TESTS = sorted((REPO / "deploy" / "prometheus").glob("*.rules.test.yaml"))
SERVICE_SRC = REPO / "dpu" / "ctxmem_dpu"

# Metrics the rules or the dashboard use before the service defines them. The pod tier
# (cluster index on Redis) is being built: its reachability gauge, 1/0, is assumed to be
# this name. Remove an entry when the service defines it (a test below says when).
PENDING = {"ctxmem_pod_index_up"}
# Series Prometheus adds to every scrape target itself.
PROMETHEUS_BUILTIN = {"up"}

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus; "
                             "deploy/setup.sh installs it)")

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan", "atan2"}
_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (strings, label matchers, ranges, grouping
    clauses and function names left out). promtool checks the syntax; this only needs
    to find names in valid PromQL."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    out = set()
    for m in re.finditer(r"(?<![0-9.A-Za-z_:$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        name = m.group(0)
        if name.lower() in _KEYWORDS or re.match(r"\s*\(", e[m.end():]):
            continue
        out.add(name)
    return out


def grafana_exprs(node: Any) -> Iterator[str]:
    """Every ``expr`` of every target, nested rows included."""
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node["expr"]
        for v in node.values():
            yield from grafana_exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from grafana_exprs(v)


def promql_of_grafana(expr: str) -> str:
    """A Grafana query as plain PromQL: its variables replaced by what they stand for."""
    return (expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
            .replace("$__range", "1h").replace("$job", ".*").replace("$instance", ".*"))


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def dashboard_queries() -> list[str]:
    d = dashboard()
    exprs = list(grafana_exprs(d["panels"]))
    for var in d["templating"]["list"]:
        if var["type"] == "query":  # label_values(METRIC{...}, label)
            m = re.match(r"label_values\((.*),\s*\w+\)$", var["definition"])
            assert m, f"template variable {var['name']}: unexpected query {var['definition']}"
            exprs.append(m.group(1))
    return exprs


def rules() -> list[dict[str, Any]]:
    return [r for f in RULES for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"]]


def recorded_names() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def defined_in_code() -> set[str]:
    """``ctxmem_*`` metric family names the service's code spells out."""
    names: set[str] = set()
    for p in SERVICE_SRC.rglob("*.py"):
        names.update(re.findall(r'"(ctxmem_[a-z0-9_]+)"', p.read_text()))
    return names


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Family and sample names on a real service's /metrics."""
    from ctxmem_tools.launcher import local_config

    workdir = tmp_path_factory.mktemp("svc")
    svc = ServiceHandle(workdir, local_config(workdir))
    try:
        with urllib.request.urlopen(svc.metrics_url_for("/metrics"), timeout=10) as r:
            text = r.read().decode()
    finally:
        svc.stop()
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    return names


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def unknown(names: set[str], scraped: set[str]) -> set[str]:
    code = defined_in_code()
    return {n for n in names
            if n not in scraped and _base(n) not in code and n not in PROMETHEUS_BUILTIN
            and n not in recorded_names() and n not in PENDING}


# ---------------------------------------------------------------- the extractor itself
@pytest.mark.parametrize("expr, names", [
    ('sum by (tier) (rate(ctxmem_hits_total{job=~".*"}[5m]))', {"ctxmem_hits_total"}),
    ("a / on (instance) group_left (x) b offset 1h > bool 0.5", {"a", "b"}),
    ('ctxmem:hit_ratio:rate15m < 0.5 * avg_over_time(x[6h]) and y{z="on(q)"} > 1',
     {"ctxmem:hit_ratio:rate15m", "x", "y"}),
    ("sum(c) without (tenant) or vector(0)", {"c"}),
])
def test_metric_names_extractor(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_unknown_names_are_reported(scraped: set[str]) -> None:
    """The check can fail: a misspelt metric is caught."""
    assert unknown({"ctxmem_hit_total", "ctxmem_hits_total"}, scraped) == {"ctxmem_hit_total"}


# ---------------------------------------------------------------- the dashboard
def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["description"], f"panel {p['title']!r} says what it shows"
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "job", "instance"}


def test_dashboard_metrics_exist(scraped: set[str]) -> None:
    names: set[str] = set()
    for e in dashboard_queries():
        names |= metric_names(promql_of_grafana(e))
    assert "ctxmem_hits_total" in names and "ctxmem_tenant_used_bytes" in names
    assert not unknown(names, scraped), "the dashboard names metrics the service lacks"


@needs_promtool
def test_dashboard_promql_parses(tmp_path: Path) -> None:
    exprs = [promql_of_grafana(e) for e in dashboard_queries()]
    f = tmp_path / "dashboard.rules.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    proc = subprocess.run([str(PROMTOOL), "check", "rules", str(f)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout


# ---------------------------------------------------------------- the rules
def test_rules_metrics_exist(scraped: set[str]) -> None:
    names: set[str] = set()
    for r in rules():
        names |= metric_names(r["expr"])
    assert not unknown(names, scraped), "a rule names a metric the service lacks"
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert {"CtxmemFlashDeviceFailed", "CtxmemIntegrityFailures", "CtxmemTierFull",
            "CtxmemPodIndexUnreachable", "CtxmemHitRateCollapse"} <= alerts
    for r in rules():
        if "alert" in r:
            assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
            assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_pending_metrics_stay_apart(scraped: set[str]) -> None:
    """A pending metric is not defined yet (else drop it from PENDING so it is checked
    for real), and only the pod rules file uses one: the main file never alerts on a
    metric that does not exist."""
    defined = scraped | defined_in_code()
    assert not {n for n in PENDING if n in defined or _base(n) in defined}, \
        "the service defines it now: remove it from PENDING"
    for f in RULES:
        used = {n for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
                for n in metric_names(r["expr"])}
        if f.name != "ctxmem-pod.rules.yaml":
            assert not used & PENDING, f"{f.name} uses pending metrics {used & PENDING}"


@needs_promtool
def test_promtool_check_rules() -> None:
    proc = subprocess.run([str(PROMTOOL), "check", "rules", *map(str, RULES)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    """Each alert fires on the series that should fire it, and not on a healthy one."""
    assert {p.name for p in RULE_TESTS} == {p.name.replace(".rules.yaml", ".rules.test.yaml")
                                             for p in RULES}
    proc = subprocess.run([str(PROMTOOL), "test", "rules", *map(str, RULE_TESTS)],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=RULE_TESTS[0].parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(RULE_TESTS)


def test_tests_cover_every_alert() -> None:
    tested = {t["alertname"] for f in RULE_TESTS for case in yaml.safe_load(f.read_text())[
        "tests"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert tested == {r["alert"] for r in rules() if "alert" in r}


