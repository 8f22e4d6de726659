"""Fetch ``/metrics`` and ``/readyz`` and reduce them to the status document.

The document (``--json``; schema version :data:`SCHEMA`) is stable: keys are only ever
added. Rates need two samples: :func:`status_document` takes the previous scrape and
gives ``null`` rates on the first one.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

SCHEMA = 1
TIERS = ("dram", "flash")
MOVES = ("put", "get", "demote")


class StatusError(Exception):
    """The endpoint could not be read; the message says which URL and what to check."""


@dataclass
class Scrape:
    """One read of the endpoint: samples by (name, sorted labels), when, and readiness."""

    url: str
    at: float
    ready: bool
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 if none)."""
        return sum(v for lab, v in self.samples.get(name, [])
                   if all(lab.get(k) == x for k, x in labels.items()))

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self.samples.get(name, [])


def _get(url: str, timeout_s: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(
            f"cannot read {url}: {reason}; is the service running, and is this its "
            f"metrics.listen (pass --config FILE or --url http://HOST:PORT)?") from None


def scrape(base_url: str, timeout_s: float = 5.0) -> Scrape:
    """One scrape of ``base_url`` (``http://HOST:PORT``), each request within
    ``timeout_s``."""
    base = base_url.rstrip("/")
    code, text = _get(base + "/metrics", timeout_s)
    if code != 200:
        raise StatusError(f"{base}/metrics answered HTTP {code}; the service is stopping "
                          f"or its event loop is stalled: check its log")
    ready_code, _ = _get(base + "/readyz", timeout_s)
    out = Scrape(url=base, at=time.time(), ready=ready_code == 200)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def status_document(now: Scrape, prev: Scrape | None = None) -> dict[str, Any]:
    """The ``--json`` document (docs/operations.md lists every key)."""
    hits = {t: now.value("ctxmem_hits_total", tier=t) for t in TIERS}
    misses = now.value("ctxmem_misses_total")
    # Every tier's hits: in a pod a fetched copy's first read is "remote" or "remote→dram".
    served = now.value("ctxmem_hits_total")
    asked = served + misses
    tiers: dict[str, Any] = {}
    for t in TIERS:
        used = now.value("ctxmem_tier_used_bytes", tier=t)
        cap = now.value("ctxmem_tier_capacity_bytes", tier=t)
        tiers[t] = {"used_bytes": used, "capacity_bytes": cap, "occupancy": _ratio(used, cap),
                    "blocks": now.value("ctxmem_blocks", tier=t), "hits": hits[t],
                    "hit_rate": _ratio(hits[t], asked),
                    "full_events": now.value("ctxmem_tier_full_total", tier=t)}
    dt = now.at - prev.at if prev is not None else 0.0
    rates: dict[str, float | None] = {}
    for op in MOVES:
        total = now.value("ctxmem_bytes_total", op=op)
        rates[f"{op}_bytes_per_s"] = (
            max(0.0, total - prev.value("ctxmem_bytes_total", op=op)) / dt
            if prev is not None and dt > 0 else None)
    tenants: dict[str, dict[str, Any]] = defaultdict(dict)
    for lab, v in now.series("ctxmem_tenant_used_bytes"):
        tenants[lab["tenant"]][f"{lab['tier']}_bytes"] = v
    for lab, v in now.series("ctxmem_tenant_quota_bytes"):
        tenants[lab["tenant"]][f"{lab['tier']}_quota_bytes"] = v
    for lab, v in now.series("ctxmem_tenant_evictions_total"):
        tenants[lab["tenant"]][f"{lab['tier']}_evictions"] = v
    for lab, v in now.series("ctxmem_tenant_refusals_total"):
        tenants[lab["tenant"]]["refusals"] = v
    tenant_rows = []
    for name in sorted(tenants):
        row: dict[str, Any] = {"name": name}
        for t in TIERS:
            b = tenants[name].get(f"{t}_bytes", 0.0)
            row[f"{t}_bytes"] = b
            row[f"{t}_share"] = _ratio(b, tiers[t]["used_bytes"])
            row[f"{t}_quota_bytes"] = tenants[name].get(f"{t}_quota_bytes")
            row[f"{t}_evictions"] = tenants[name].get(f"{t}_evictions", 0.0)
        row["refusals"] = tenants[name].get("refusals", 0.0)
        tenant_rows.append(row)
    devices: dict[str, str] = {}
    for lab, v in now.series("ctxmem_flash_device_state"):
        if v >= 1:
            devices[lab["device"]] = lab["state"]
    fencing: dict[str, str] = {}  # shared devices only: reservation, epoch_only, preempted
    for lab, v in now.series("ctxmem_flash_shared_fencing"):
        if v >= 1:
            fencing[lab["device"]] = lab["mode"]
    bad = [f"flash device {d} {s.replace('_', ' ')}" for d, s in sorted(devices.items())
           if s != "healthy"]
    bad += [f"flash device {d}: this node's reservation was preempted (it writes nothing "
            f"more there; restart it)" for d, m in sorted(fencing.items()) if m == "preempted"]
    health = ("serving" if not bad else "degraded: " + "; ".join(bad)) if now.ready \
        else "not ready"
    return {
        "schema": SCHEMA,
        "endpoint": now.url,
        "time": now.at,
        "interval_s": dt if prev is not None else None,
        "health": {"ready": now.ready, "status": health},
        "tiers": tiers,
        "hit_rate": _ratio(served, asked),
        "misses": misses,
        "rates": rates,
        "tenants": tenant_rows,
        "sessions": now.value("ctxmem_sessions"),
        "allocations": now.value("ctxmem_allocations"),
        "leases": now.value("ctxmem_leases"),
        "dirty_blocks": now.value("ctxmem_dirty_blocks"),
        "puts_shed": now.value("ctxmem_puts_shed_total"),
        "devices": [{"name": d, "state": s} | ({"fencing": fencing[d]} if d in fencing else {})
                    for d, s in sorted(devices.items())],
        "device_events": {e: now.value("ctxmem_flash_device_events_total", event=e)
                          for e in ("failed", "recovered", "reattached")},
        "integrity": {
            "integrity_failures": now.value("ctxmem_integrity_failures_total"),
            "put_crc_mismatch": now.value("ctxmem_put_crc_mismatch_total"),
            "dram_crc_mismatch": now.value("ctxmem_dram_crc_mismatch_total"),
            "flash_read_errors": now.value("ctxmem_flash_io_errors_total", op="read"),
            "flash_write_errors": now.value("ctxmem_flash_io_errors_total", op="write"),
        },
    }
