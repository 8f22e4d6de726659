"""``--auth-ab`` of ``ctxmem bench`` and ``ctxmem bench pod``: what block authenticators
cost on each path, measured on real service processes with them on and off.

Each arm is its own service (``ctxmem bench``) or pod (``ctxmem bench pod``), both
running for the whole measurement, started alike except for one variable. Both get
:data:`HARNESS_DIR` first on their ``PYTHONPATH``, so both load the harness's
``sitecustomize.py``; only the "off" arm gets ``CTXMEM_BENCH_AUTH_OFF=1`` (the "on" one
``0``), under which the harness replaces ``BlockAuthenticator.tag`` with a constant and
``verify`` with ``True`` and logs :data:`WARNING` (:mod:`ctxmem_tools.bench.authoff`). A normal
service never has that directory on its path: "off" is a measurement, not a setting.

The rounds alternate the arms on/off, off/on, on/off, ... (:func:`arm_order`), so a
drift of the machine's speed during the run falls on both alike. :func:`check_arm` reads
each service's log at start and at the end and fails the run unless every "off" service
logged the harness's line and no "on" service did: a run that silently measured on
against on does not print a ratio.

Rows: every figure of the selected rows twice, the "on" one under its usual name (the
bench's own statistic, limit and CPU per GB) and the "off" one under the same name with a
suffix; :func:`pair_rows` pairs them into :class:`AbRow` (both figures, on/off, the
service's CPU per GB of each and their difference, the row's limit), which
:func:`print_rows` prints and the benches write to ``--json`` under ``"auth_ab"``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ctxmem_tools.bench.authoff.sitecustomize import ENV, EXIT_LINE, WARNING

__all__ = ["ENV", "EXIT_LINE", "HARNESS_DIR", "WARNING", "AbRow", "arm_env", "arm_order",
           "check_arm", "check_output", "exit_counts", "pair_rows", "print_rows"]

#: The directory put first on both arms' PYTHONPATH (it holds the harness's
#: ``sitecustomize.py``).
HARNESS_DIR = Path(__file__).resolve().parent / "authoff"
ARMS = {True: "on", False: "off"}


def arm_env(on: bool) -> dict[str, str]:
    """The variables a service of one arm is started with, over this process's
    environment: the harness first on ``PYTHONPATH`` for both, the switch ``1`` for
    "off" and ``0`` for "on" (whatever this shell exports)."""
    path = [str(HARNESS_DIR), *(p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p)]
    return {"PYTHONPATH": os.pathsep.join(path), ENV: "0" if on else "1"}


def arm_order(round_no: int) -> tuple[bool, bool]:
    """The arms of round ``round_no`` in the order they run (True: authenticators on):
    on/off in even rounds, off/on in odd ones."""
    return (True, False) if round_no % 2 == 0 else (False, True)


def check_arm(log_path: Path, on: bool, what: str) -> None:
    """Raise RuntimeError unless the service whose log is ``log_path`` ran as its arm
    says: the harness's :data:`WARNING` logged by an "off" service, never by an "on" one."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError as exc:
        raise RuntimeError(f"auth A/B: cannot read the log of {what} ({log_path}): {exc}; "
                           "its arm cannot be checked, so no figure is printed") from exc
    check_output(text, on, what, f"its log ({log_path})")


def check_output(text: str, on: bool, what: str, where: str) -> None:
    """:func:`check_arm` on a process's output ``text`` (``where``: what it is, for the
    error)."""
    logged = WARNING in text
    if on and logged:
        raise RuntimeError(
            f"auth A/B: {what} should run with authenticators ON but {where} says "
            f"{WARNING!r}: the harness ({HARNESS_DIR}/sitecustomize.py) patched a service "
            f"started with {ENV}=0; its figures would be off against off")
    if not on and not logged:
        raise RuntimeError(
            f"auth A/B: {what} should run with authenticators OFF but {where} lacks "
            f"{WARNING!r}: the harness ({HARNESS_DIR}/sitecustomize.py) did not load "
            "(a python started with -S, -I or -E? another sitecustomize first on the "
            "path?), so both arms would measure authenticators on")


def exit_counts(log_path: Path) -> tuple[int, int] | None:
    """(tags, checks) an "off" service's harness logged at exit (:data:`EXIT_LINE`), the
    last such line of ``log_path``; None if there is none (the service did not exit
    normally)."""
    pattern = re.escape(EXIT_LINE).replace(r"\{tags\}", r"(\d+)").replace(
        r"\{verifies\}", r"(\d+)")
    try:
        found = re.findall(pattern, log_path.read_text(errors="replace"))
    except OSError:
        return None
    return (int(found[-1][0]), int(found[-1][1])) if found else None


class _Row(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> float: ...
    @property
    def unit(self) -> str: ...
    @property
    def limit(self) -> float: ...
    @property
    def service_cpu_s_per_gb(self) -> float | None: ...


@dataclass
class AbRow:
    """One row measured with authenticators on and off."""

    name: str
    unit: str
    on: float
    off: float
    #: ``on / off``: below 1 where the authenticators make a throughput slower.
    ratio: float
    #: The row's machine limit, as the bench prints it beside the row (NaN: none).
    limit: float
    service_cpu_s_per_gb_on: float | None
    service_cpu_s_per_gb_off: float | None
    #: What the authenticators cost the service per GB moved (on - off).
    service_cpu_s_per_gb_delta: float | None


def pair_rows(rows: Iterable[_Row], off_suffix: str,
              units: Sequence[str] = ("GB/s",)) -> list[AbRow]:
    """Every "on" row in ``units`` that has an "off" twin (its name + ``off_suffix``),
    in the order of the "on" rows."""
    rows = list(rows)
    by_name = {r.name: r for r in rows}
    out = []
    for r in rows:
        off = by_name.get(r.name + off_suffix)
        if r.name.endswith(off_suffix) or off is None or r.unit not in units:
            continue
        s_on, s_off = r.service_cpu_s_per_gb, off.service_cpu_s_per_gb
        delta = None if s_on is None or s_off is None else s_on - s_off
        out.append(AbRow(r.name, r.unit, r.value, off.value,
                         r.value / off.value if off.value else float("nan"), r.limit,
                         s_on, s_off, delta))
    return out


def _cell(v: float | None, width: int, prec: int = 3) -> str:
    return f"{'-':>{width}}" if v is None or v != v else f"{v:{width}.{prec}f}"


def print_rows(rows: Sequence[AbRow], rounds: int) -> None:
    """The A/B table: per row both figures, on/off, the service CPU per GB of each and
    the difference, and the row's limit."""
    print(f"\nblock authenticators on vs off ({rounds} rounds per arm, alternated "
          f"on/off, off/on; off = the bench harness {HARNESS_DIR.name}/sitecustomize.py, "
          "checked in each service's log)")
    width = max([len(r.name) for r in rows] + [4])
    print(f"{'row':{width}} {'on':>9} {'off':>9} {'unit':5} {'on/off':>7} "
          f"{'svc s/GB on':>11} {'off':>7} {'on-off':>7} {'limit':>9}")
    for r in rows:
        print(f"{r.name:{width}} {r.on:9.3f} {r.off:9.3f} {r.unit:5} {_cell(r.ratio, 7)} "
              f"{_cell(r.service_cpu_s_per_gb_on, 11)} "
              f"{_cell(r.service_cpu_s_per_gb_off, 7)} "
              f"{_cell(r.service_cpu_s_per_gb_delta, 7)} {_cell(r.limit, 9)}")
