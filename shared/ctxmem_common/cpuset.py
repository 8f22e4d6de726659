"""CPU sets: ``service.cpu_affinity`` and ``ctxmem bench --service-cpus/--client-cpus``.

In the fallback mode the service shares a host's cores with the inference engine; every
op a client sends wakes the service on whatever CPU the scheduler picks, often the
client's own, pre-empting the client's copy. Pinning the service to cores of its own (as
SPDK does with its core mask) keeps the two apart. A CPU set is written as a list of CPU
ids (``[1, 3]``) or a Linux cpulist string (``"1"``, ``"2-3,6"``, the format of
``/proc/PID/status``'s ``Cpus_allowed_list`` and ``taskset -c``); empty means no pinning.

Pinning a whole process: ``sched_setaffinity`` sets one thread's mask; threads created
later inherit it from their creator. :func:`pin_process` sets it on every thread that
already exists (``/proc/self/task``), so threads started by imports before it ran are
covered too, and everything started after it inherits it.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterable
from pathlib import Path

from ctxmem_common.errors import ConfigError

__all__ = ["CpuList", "allowed_cpus", "check_cpus", "format_cpulist", "online_cpus",
           "parse_cpulist", "pin_process", "process_affinity"]

# A sorted list of distinct CPU ids; the config's type for cpu_affinity.
CpuList = typing.NewType("CpuList", list[int])

_MAX_CPU = 1 << 16  # a range "0-4000000000" is a typo, not a machine


def parse_cpulist(value: object, where: str) -> CpuList:
    """CPU ids from a list of ints or a cpulist string ("1", "2-3,6"); sorted, distinct.

    Raises :class:`ConfigError` naming ``where`` and the bad part."""
    cpus: set[int] = set()
    if isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _MAX_CPU:
                raise ConfigError(f"{where}[{i}]: {v!r} is not a CPU id (an integer >= 0)")
            cpus.add(v)
    elif isinstance(value, str):
        for part in (p.strip() for p in value.split(",")):
            if not part:
                if value.strip():
                    raise ConfigError(f"{where}: {value!r} has an empty item; write a "
                                      f"cpulist like '1' or '2-3,6'")
                continue
            lo, sep, hi = part.partition("-")
            try:
                first, last = int(lo), int(hi) if sep else int(lo)
            except ValueError:
                raise ConfigError(f"{where}: {part!r} in {value!r} is not a CPU id or a "
                                  f"range like '2-3'") from None
            if not 0 <= first <= last < _MAX_CPU:
                raise ConfigError(f"{where}: {part!r} in {value!r} is not a range of CPU "
                                  f"ids (low-high, 0 <= low <= high)")
            cpus.update(range(first, last + 1))
    else:
        raise ConfigError(f"{where}: expected a list of CPU ids or a cpulist string like "
                          f"'2-3,6', got {value!r}")
    return CpuList(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """The cpulist string of ``cpus`` ("0-2,5"); "" for none."""
    out: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def online_cpus() -> set[int]:
    """The machine's online CPUs (sysfs), or 0..cpu_count-1 where sysfs says nothing."""
    try:
        text = Path("/sys/devices/system/cpu/online").read_text().strip()
        return set(parse_cpulist(text, "/sys/devices/system/cpu/online"))
    except (OSError, ConfigError):
        return set(range(os.cpu_count() or 1))


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask: cgroup cpuset, taskset)."""
    return set(os.sched_getaffinity(0))


def check_cpus(cpus: Iterable[int], where: str) -> None:
    """Refuse CPUs that do not exist or that this process may not run on, naming them
    and the allowed set, so a bad mask fails at load and not half way through start."""
    wanted = set(cpus)
    if not wanted:
        return
    allowed = allowed_cpus()
    missing = wanted - online_cpus()
    if missing:
        raise ConfigError(
            f"{where}: CPU(s) {format_cpulist(missing)} do not exist or are offline on this "
            f"machine (online: {format_cpulist(online_cpus())}; this process may use "
            f"{format_cpulist(allowed)}); list CPUs from the allowed set")
    outside = wanted - allowed
    if outside:
        raise ConfigError(
            f"{where}: CPU(s) {format_cpulist(outside)} are not in this process's allowed "
            f"set {format_cpulist(allowed)} (its cgroup cpuset or taskset mask); list CPUs "
            f"from that set or start the service with a wider mask")


def pin_process(cpus: Iterable[int]) -> list[int]:
    """Pin every thread of this process to ``cpus``; returns the thread ids pinned.

    Threads started afterwards inherit the mask. A thread that exits while this runs is
    skipped; any other failure raises OSError naming the thread and errno."""
    wanted = set(cpus)
    pinned: list[int] = []
    for entry in sorted(os.listdir("/proc/self/task"), key=int):
        tid = int(entry)
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:
            continue  # exited meanwhile
        except OSError as exc:
            raise OSError(exc.errno, f"cannot pin thread {tid} to CPUs "
                          f"{format_cpulist(wanted)}: {exc.strerror}") from None
        pinned.append(tid)
    return pinned


def process_affinity(pid: int) -> dict[int, str]:
    """``Cpus_allowed_list`` of every thread of ``pid`` (thread id -> cpulist), from
    /proc: what the kernel will schedule each thread on."""
    out: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out
