"""What ``ctxmem bench ttft`` measured per prefix length, and how it is reported.

:class:`LengthResult` holds one prefix length's timings; the functions turn a list of them
into the JSON ``results`` list, the markdown table printed to stdout and the PNG plot.
Kept apart from the measuring loop (:mod:`ctxmem_tools.bench.ttft`) so each stays small.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LengthResult", "best", "jsonable", "plot", "results", "table"]


@dataclass
class LengthResult:
    """Timings of one prefix length (lists: one entry per repeat)."""

    prefix_tokens: int
    new_tokens: int
    kv_bytes: int
    recompute_s: float
    store_s: float
    load_dram_s: list[float] = field(default_factory=list)
    load_flash_s: list[float] = field(default_factory=list)
    get_dram_s: list[float] = field(default_factory=list)
    get_flash_s: list[float] = field(default_factory=list)
    prefill_new_s: list[float] = field(default_factory=list)
    flash_tiers_ok: bool = True
    same_first_token: bool = True
    # per path ("load_dram", "load_flash"): the phases of its fastest run, in seconds
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)

    def note(self, path: str, total: float, phases: dict[str, float]) -> None:
        best = self.breakdown.get(path)
        if best is None or total < best["total"]:
            self.breakdown[path] = {"total": total, **phases}


def best(values: Sequence[float]) -> float:
    """The fastest of repeated timings (NaN when there were none)."""
    return min(values) if values else math.nan


def results(rows: Sequence[LengthResult]) -> list[dict[str, Any]]:
    """The ``--json`` ``results`` list: one ``{name, value, unit, prefix_tokens}`` per metric."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float, unit: str, row: LengthResult) -> None:
        out.append({"name": name, "value": value, "unit": unit, "prefix_tokens": row.prefix_tokens})

    for r in rows:
        dram, flash = best(r.load_dram_s), best(r.load_flash_s)
        add("ttft.recompute", r.recompute_s, "s", r)
        add("ttft.load_dram", dram, "s", r)
        if r.load_flash_s:
            add("ttft.load_flash", flash, "s", r)
        add("prefill.new_tokens", best(r.prefill_new_s), "s", r)
        add("prefill.throughput", (r.prefix_tokens + r.new_tokens) / r.recompute_s, "tokens/s", r)
        add("store.put", r.store_s, "s", r)
        add("store.bandwidth", r.kv_bytes / r.store_s / 1e9, "GB/s", r)
        add("kv.bytes", r.kv_bytes, "bytes", r)
        add("get.dram", best(r.get_dram_s), "s", r)
        add("get.dram_bandwidth", r.kv_bytes / best(r.get_dram_s) / 1e9, "GB/s", r)
        add("speedup.load_dram", r.recompute_s / dram, "x", r)
        for path, phases in r.breakdown.items():
            for phase, seconds in phases.items():
                if phase != "total":
                    add(f"{path}.{phase}", seconds, "s", r)
        if r.load_flash_s:
            add("get.flash", best(r.get_flash_s), "s", r)
            add("get.flash_bandwidth", r.kv_bytes / best(r.get_flash_s) / 1e9, "GB/s", r)
            add("speedup.load_flash", r.recompute_s / flash, "x", r)
    return out


def table(rows: Sequence[LengthResult]) -> str:
    """A markdown table of the main timings, one row per prefix length."""
    lines = [
        "| prefix tokens | KV MiB | recompute s | load DRAM s | load flash s | new-tokens-only s "
        "| speedup DRAM | speedup flash | get DRAM GB/s | get flash GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(value: float, fmt: str) -> str:
        return "—" if math.isnan(value) else format(value, fmt)

    for r in rows:
        dram, flash = best(r.load_dram_s), best(r.load_flash_s)
        gd, gf = best(r.get_dram_s), best(r.get_flash_s)
        cells = [
            str(r.prefix_tokens),
            f(r.kv_bytes / 2**20, ".1f"),
            f(r.recompute_s, ".3f"),
            f(dram, ".3f"),
            f(flash, ".3f"),
            f(best(r.prefill_new_s), ".3f"),
            f(r.recompute_s / dram, ".1f") + "x",
            f(r.recompute_s / flash, ".1f") + ("x" if r.load_flash_s else ""),
            f(r.kv_bytes / gd / 1e9, ".2f"),
            f(r.kv_bytes / gf / 1e9, ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[LengthResult], path: str, title: str) -> None:
    """TTFT against prefix length (log-log), written to ``path`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.prefix_tokens for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    ax.plot(x, [r.recompute_s for r in rows], "o-", label="recompute (full prefill)")
    ax.plot(x, [best(r.load_dram_s) for r in rows], "s-", label="load prefix from DRAM tier")
    if any(r.load_flash_s for r in rows):
        ax.plot(x, [best(r.load_flash_s) for r in rows], "^-", label="load prefix from flash tier")
    ax.plot(
        x, [best(r.prefill_new_s) for r in rows], "k:", label="new tokens only (prefix resident)"
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v // 1024}K" if v >= 1024 else str(v) for v in x])
    ax.set_xlabel("reused prefix length (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def jsonable(value: Any) -> Any:
    """``value`` with anything ``json`` cannot encode replaced by its ``repr``."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        if isinstance(value, dict):
            return {str(k): jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [jsonable(v) for v in value]
        return repr(value)
