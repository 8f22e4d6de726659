"""Figures to look at rather than read: ``ctxmem bench --png`` and ``ctxmem chaos --png``.

* :func:`plot_bench`: one horizontal bar chart, every throughput figure (median batch)
  and the Lookup as a fraction of its limit (memcpy for DRAM, the device's O_DIRECT rate
  for flash, and with encryption AES-XTS too; the 2 ms target for a 10,000-key Lookup), the limit
  marked at 1.0. Per-batch p50/p99 rows restate the same fractions, and the twins of a
  figure held against another limit (``*_paired``: the device beside each round;
  ``*_of_two_pass``: a put's two passes), stay in the JSON: one bar per figure.
* :func:`plot_chaos`: the campaign over time (faults injected, blocks committed and
  served, and wrong blocks / durable blocks lost, which must stay at 0) above the faults
  injected per kind. A report written before the timeline was recorded gets the totals
  instead of the curves.

Both take the JSON document the command writes (so ``--from-json`` renders a past run),
write a PNG with matplotlib's Agg backend, and return the data they drew, for tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LIMIT_NAMES = {"dram": "memcpy", "flash_get": "O_DIRECT read", "flash_demote": "O_DIRECT write"}
#: Rows that repeat a figure against another limit (``ctxmem bench``): not drawn again.
TWIN_SUFFIXES = ("_paired", "_of_two_pass")


@dataclass(frozen=True)
class Bar:
    label: str
    fraction: float
    text: str


def bench_bars(doc: Mapping[str, Any]) -> list[Bar]:
    """The bars of :func:`plot_bench`: each non-limit result except per-batch p50/p99
    and a figure's twins against other limits (:data:`TWIN_SUFFIXES`)."""
    bars = []
    for r in doc["results"]:
        name, unit = str(r["name"]), str(r["unit"])
        if name.startswith("limit_") or unit == "ms/batch" or r["limit"] != r["limit"] \
                or name.endswith(TWIN_SUFFIXES):
            continue  # limits, per-batch rows, no target (NaN), the same figure again
        if unit == "GB/s":
            kind = next((v for k, v in LIMIT_NAMES.items() if name.startswith(k)), "limit")
            if "_xts" in name and name.startswith("flash"):
                kind = f"min({kind}, AES-XTS)"
            text = f"{r['value']:.2f} GB/s of {r['limit']:.2f} ({kind})"
        else:  # latency against a target: the fraction is target / value
            text = f"{r['value']:.1f} {unit}, target {r['limit']:.0f} {unit}"
        bars.append(Bar(name, float(r["fraction_of_limit"]), text))
    if not bars:
        raise ValueError("no benchmark figures in this JSON (is it `ctxmem bench --json`?)")
    return bars


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--png needs matplotlib: pip install 'ctxmem-kv[tools]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colour(label: str) -> str:
    # Light fills: the black labels drawn over the bars stay readable.
    if label.startswith("dram"):
        return "#A6C1E8"
    if label.startswith("flash"):
        return "#F5BE96"
    return "#CFCFCF"


def plot_bench(doc: Mapping[str, Any], path: str, title: str = "") -> list[Bar]:
    """Draw :func:`bench_bars` into ``path`` (PNG); returns the bars drawn."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    bars = bench_bars(doc)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.32 * len(bars)), dpi=110)
    y = list(range(len(bars)))[::-1]
    top = max(1.25, max(b.fraction for b in bars) + 0.1)
    ax.barh(y, [min(b.fraction, top) for b in bars], color=[_colour(b.label) for b in bars])
    ax.axvline(1.0, color="#C44E52", linestyle="--", linewidth=1.2)
    ax.text(1.0, len(bars) - 0.3, " limit", color="#C44E52", va="bottom", fontsize=8)
    for yi, b in zip(y, bars, strict=True):
        ax.text(0.01, yi, f" {b.fraction:.2f} — {b.text}", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels([b.label for b in bars], fontsize=8)
    ax.set_xlim(0, top)
    ax.legend(handles=[Patch(color=_colour(k), label=v) for k, v in
                       (("dram", "DRAM tier"), ("flash", "flash tier"), ("lookup", "Lookup"))],
              fontsize=7, loc="lower right")
    ax.set_xlabel("fraction of the machine's limit (1.0 = as fast as the primitive alone)")
    params = doc.get("params", {})
    ax.set_title(title or f"ctxmem bench: transport {params.get('transport', '?')}, "
                          f"{params.get('batch_mib', '?')} MiB batches, "
                          f"{params.get('rounds', '?')} rounds", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return bars


CHAOS_SERIES = ("faults", "blocks_committed", "blocks_served")
CHAOS_ZERO = ("wrong_blocks", "durable_blocks_lost")


def plot_chaos(report: Mapping[str, Any], path: str, title: str = "") -> dict[str, Any]:
    """Draw a ``ctxmem chaos --json`` report into ``path`` (PNG); returns what was drawn:
    ``{"timeline": {series: [values]}, "t_s": [...], "kinds": {kind: n}}``."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    from ctxmem_tools.chaos.records import CORRUPTION, CRASH, DEVICE
    from ctxmem_tools.chaos.scenarios import SCENARIO

    groups = (("corruption on the device", CORRUPTION, "#8FBF9F"),
              ("device errors", DEVICE, "#F5BE96"), ("crashes", CRASH, "#E8A0A0"),
              ("scenarios", SCENARIO, "#B4A7D6"))
    kinds = dict(sorted(report["faults_by_kind"].items(), key=lambda kv: kv[1]))
    timeline: Sequence[Mapping[str, float]] = report.get("timeline") or []
    top_h = 3.0 if timeline else 1.2
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 1.2 + top_h + 0.2 * len(kinds)), dpi=110,
        gridspec_kw={"height_ratios": [top_h, max(3, 0.2 * len(kinds))]})
    drawn: dict[str, Any] = {"timeline": {}, "t_s": [], "kinds": kinds}
    if timeline:
        t = [p["t_s"] / 60 for p in timeline]
        drawn["t_s"] = [p["t_s"] for p in timeline]
        for name, style in zip(CHAOS_SERIES, ("-", "--", "-"), strict=True):
            values = [p[name] for p in timeline]
            drawn["timeline"][name] = values
            top.plot(t, values, style, label=name.replace("_", " "))
        top.set_yscale("symlog", linthresh=10)
        top.set_xlabel("minutes into the campaign")
        top.set_ylabel("count (log)")
        zero = top.twinx()
        # durable lost first, dashed: wrong blocks (the headline) is drawn over it.
        for name, colour, style in zip(CHAOS_ZERO[::-1], ("#8172B2", "#C44E52"), (":", "-"),
                                       strict=True):
            values = [p.get(name, 0) for p in timeline]
            drawn["timeline"][name] = values
            zero.plot(t, values, style, color=colour, linewidth=3 if style == "-" else 2,
                      label=f"{name.replace('_', ' ')} (must be 0)")
        zero.set_ylim(-0.5, max(5, *drawn["timeline"]["wrong_blocks"]) + 0.5)
        zero.set_ylabel("wrong / durable lost", color="#C44E52")
        lines = top.get_legend_handles_labels()
        more = zero.get_legend_handles_labels()
        top.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
        top.grid(True, alpha=0.3)
    else:
        top.axis("off")
        top.text(0.0, 0.5, "\n".join([
            "This report has no timeline (written before `ctxmem chaos` recorded one);",
            "its totals:",
            f"  faults injected {report['faults_injected']:,}, restarts "
            f"{report.get('restarts', 0):,}, {report.get('duration_s', 0):.0f} s",
            f"  blocks committed {report['blocks_committed']:,}, served "
            f"{report['blocks_served']:,}",
            f"  wrong blocks {report['wrong_blocks']}, durable blocks lost "
            f"{report.get('durable_blocks_lost', 0)}, resurrected "
            f"{report.get('resurrected_blocks', 0)}, space leaked "
            f"{report.get('space_leak_bytes', 0)} B"]), fontsize=9, va="center",
            family="monospace")
    names = list(kinds)
    fill = {k: c for _label, members, c in groups for k in members}
    bottom.barh(range(len(names)), [kinds[k] for k in names],
                color=[fill.get(k, "#CFCFCF") for k in names])
    bottom.legend(handles=[Patch(color=c, label=label) for label, _m, c in groups],
                  fontsize=7, loc="lower right")
    bottom.set_yticks(range(len(names)))
    bottom.set_yticklabels(names, fontsize=7)
    bottom.set_xlabel("faults injected, by kind")
    bottom.grid(True, axis="x", alpha=0.3)
    verdict = "PASSED" if report.get("passed") else "FAILED"
    fig.suptitle(title or f"ctxmem chaos: {report['faults_injected']:,} faults, seed "
                          f"{report.get('seed', '?')}, {report['wrong_blocks']} wrong blocks "
                          f"— {verdict}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn
