"""CPU seconds per GB moved, for the service and for the bench's own process.

Wall-clock GB/s drifts with the neighbours on a shared machine; the CPU a phase costs
drifts much less, and the service's CPU per GB is what sizes a DPU's Arm cores (issue
17). The service reports its own CPU seconds in Stats (``process_cpu_seconds``, from
``getrusage``: every thread); the client's come from this process's ``getrusage``.

A phase is bracketed by two Stats calls outside its timed section. Those calls cost the
service a little CPU of their own, so :meth:`CpuMeter.calibrate` measures an empty
phase and that baseline is taken off every phase.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

GB = 1e9


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@dataclass
class PhaseCpu:
    """CPU spent and bytes moved by one named phase, summed over its rounds."""

    service_s: float = 0.0
    client_s: float = 0.0
    nbytes: int = 0

    def service_per_gb(self) -> float:
        return self.service_s / (self.nbytes / GB) if self.nbytes else 0.0

    def client_per_gb(self) -> float:
        return self.client_s / (self.nbytes / GB) if self.nbytes else 0.0


@dataclass
class CpuMeter:
    """Accumulates service and client CPU seconds per phase name.

    ``service_cpu`` returns the service's ``process_cpu_seconds`` (a Stats call);
    ``client_cpu`` the CPU of the processes doing the client side (default: this one)."""

    service_cpu: Callable[[], float]
    client_cpu: Callable[[], float] = own_cpu_seconds
    phases: dict[str, PhaseCpu] = field(default_factory=dict)
    baseline_s: float = 0.0
    client_baseline_s: float = 0.0

    def calibrate(self, samples: int = 5) -> float:
        """The CPU of an empty phase (the two Stats calls themselves), service and client:
        the least of ``samples`` each, taken off every phase afterwards."""
        service, client = [], []
        for _ in range(samples):
            s0, c0 = self.service_cpu(), self.client_cpu()
            c1, s1 = self.client_cpu(), self.service_cpu()
            service.append(s1 - s0)
            client.append(c1 - c0)
        self.baseline_s = max(0.0, min(service))
        self.client_baseline_s = max(0.0, min(client))
        return self.baseline_s

    @contextmanager
    def phase(self, name: str, nbytes: int) -> Iterator[None]:
        """Count the CPU of the ``with`` body against ``name`` (``nbytes`` moved)."""
        s0, c0 = self.service_cpu(), self.client_cpu()
        yield
        c1, s1 = self.client_cpu(), self.service_cpu()
        self.add(name, max(0.0, s1 - s0 - self.baseline_s),
                 max(0.0, c1 - c0 - self.client_baseline_s), nbytes)

    def add(self, name: str, service_s: float, client_s: float, nbytes: int) -> None:
        p = self.phases.setdefault(name, PhaseCpu())
        p.service_s += service_s
        p.client_s += client_s
        p.nbytes += nbytes

    def per_gb(self, name: str) -> tuple[float | None, float | None]:
        """(service, client) CPU seconds per GB of ``name``; None if it never ran."""
        p = self.phases.get(name)
        if p is None or not p.nbytes:
            return None, None
        return p.service_per_gb(), p.client_per_gb()
