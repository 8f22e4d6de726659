"""The status document drawn with rich: a header line, then tiers, traffic, tenants,
grants, devices and integrity tables."""

from __future__ import annotations

import datetime
import io
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

DASH = "—"
INTEGRITY_COLUMNS = {"integrity_failures": "failed checks", "put_crc_mismatch": "put CRC",
                     "dram_crc_mismatch": "DRAM CRC", "flash_read_errors": "read errors",
                     "flash_write_errors": "write errors"}


def _bytes(n: float | None) -> str:
    if n is None:
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return DASH  # unreachable


def _pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.1f}%"


def _rate(x: float | None) -> str:
    return DASH if x is None else f"{_bytes(x)}/s"


def status_renderable(doc: dict[str, Any]) -> Group:
    """Everything on one screen."""
    h = doc["health"]
    style = "green" if h["status"] == "serving" else "red" if not h["ready"] else "yellow"
    when = datetime.datetime.fromtimestamp(doc["time"], datetime.timezone.utc)
    head = Text.assemble(("ctxmem ", "bold"), (h["status"], f"bold {style}"),
                         f"   {doc['endpoint']}   {when:%Y-%m-%d %H:%M:%S} UTC")

    tiers = Table(title="Tiers", title_justify="left", expand=False)
    for col in ("tier", "used", "capacity", "occupancy", "blocks", "hit rate", "full events"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in doc["tiers"].items():
        tiers.add_row(name, _bytes(t["used_bytes"]), _bytes(t["capacity_bytes"]),
                      _pct(t["occupancy"]), f"{t['blocks']:.0f}", _pct(t["hit_rate"]),
                      f"{t['full_events']:.0f}")
    tiers.add_row("all", "", "", "", "", _pct(doc["hit_rate"]), "",
                  style="bold")

    r = doc["rates"]
    interval = DASH if doc["interval_s"] is None else f"{doc['interval_s']:.1f} s"
    traffic = Table(title=f"Bytes moved (over {interval})", title_justify="left")
    for col in ("put", "get", "demote"):
        traffic.add_column(col, justify="right")
    traffic.add_row(_rate(r["put_bytes_per_s"]), _rate(r["get_bytes_per_s"]),
                    _rate(r["demote_bytes_per_s"]))

    tenants = Table(title="Tenants", title_justify="left")
    for col in ("tenant", "dram", "share", "quota", "flash", "share", "quota", "evicted",
                "refused"):
        tenants.add_column(col, justify="left" if col == "tenant" else "right")
    for t in doc["tenants"]:
        tenants.add_row(t["name"], _bytes(t["dram_bytes"]), _pct(t["dram_share"]),
                        _bytes(t["dram_quota_bytes"]), _bytes(t["flash_bytes"]),
                        _pct(t["flash_share"]), _bytes(t["flash_quota_bytes"]),
                        f"{t['dram_evictions'] + t['flash_evictions']:.0f}",
                        f"{t['refusals']:.0f}")
    if not doc["tenants"]:
        tenants.add_row("(none yet)", *[""] * 8)

    grants = Table(title="Grants", title_justify="left")
    for col in ("sessions", "allocations", "leases", "dirty blocks", "puts shed"):
        grants.add_column(col, justify="right")
    grants.add_row(*(f"{doc[k]:.0f}" for k in ("sessions", "allocations", "leases",
                                                "dirty_blocks", "puts_shed")))

    devices = Table(title="Flash devices", title_justify="left")
    devices.add_column("device")
    devices.add_column("state")
    for d in doc["devices"]:
        state = d["state"] + (f" (shared: {d['fencing'].replace('_', ' ')})" if "fencing" in d
                              else "")
        devices.add_row(d["name"], Text(state, style="green" if d["state"] == "healthy"
                                        and d.get("fencing") != "preempted" else "red"))
    if not doc["devices"]:
        devices.add_row("(none: DRAM only)", "")
    ev = doc["device_events"]
    events = Text(f"device events: {ev['failed']:.0f} failed, {ev['recovered']:.0f} "
                  f"recovered, {ev['reattached']:.0f} reattached")

    integ = Table(title="Integrity", title_justify="left")
    for col in INTEGRITY_COLUMNS.values():
        integ.add_column(col, justify="right")
    integ.add_row(*(Text(f"{doc['integrity'][k]:.0f}", style="red" if doc["integrity"][k]
                         else "") for k in INTEGRITY_COLUMNS))
    return Group(head, tiers, tenants, _side_by_side(traffic, grants),
                 _side_by_side(devices, integ), events)


def _side_by_side(*parts: Table) -> Table:
    grid = Table.grid(padding=(0, 3))
    for _ in parts:
        grid.add_column(vertical="top")
    grid.add_row(*parts)
    return grid


def render_text(doc: dict[str, Any], width: int = 100) -> str:
    """The screen as plain text (no colour codes), ``width`` columns wide."""
    console = Console(record=True, width=width, force_terminal=False, color_system=None,
                      file=io.StringIO())
    console.print(status_renderable(doc))
    return console.export_text()
