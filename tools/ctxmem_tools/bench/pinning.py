"""``ctxmem bench --service-cpus LIST --client-cpus LIST``: the service and the bench's
client on CPUs of their own.

In the fallback mode the service shares a host's cores with the engine; on a small machine
every op the client sends wakes the service on the client's own CPU and pre-empts the
client's copy. These options measure the other arrangement, the one a BlueField has by
construction and ``service.cpu_affinity`` gives a host: the service gets
``cpu_affinity`` in its config, the bench process pins every one of its threads. The
limits are then measured under the client's pinning (the memcpy limit is the best copy the
client's own CPUs make), so the fractions compare the client with what it could do where
it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ctxmem_common.cpuset import check_cpus, format_cpulist, parse_cpulist, pin_process
from ctxmem_common.errors import ConfigError


def add_pinning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--service-cpus", default="", metavar="LIST",
                   help="run the service on these CPUs (service.cpu_affinity; a cpulist "
                        "like '1' or '2-3,6'); default: not pinned")
    p.add_argument("--client-cpus", default="", metavar="LIST",
                   help="pin the bench process (the client, and the limits it measures) to "
                        "these CPUs; default: not pinned")


@dataclass(frozen=True)
class Pinning:
    service_cpus: list[int]
    client_cpus: list[int]
    # The mask the bench started with: what a service inherits when only the client is
    # pinned, and what the service's own cpu_affinity is checked against.
    started_with: list[int]

    @classmethod
    def from_args(cls, p: argparse.ArgumentParser, args: argparse.Namespace) -> Pinning:
        """Parse and check both lists (exits 2 with the reason, like any bad option)."""
        try:
            service = parse_cpulist(args.service_cpus, "--service-cpus")
            client = parse_cpulist(args.client_cpus, "--client-cpus")
            check_cpus(service, "--service-cpus")
            check_cpus(client, "--client-cpus")
        except ConfigError as exc:
            p.error(exc.message)
        return cls(list(service), list(client), sorted(os.sched_getaffinity(0)))

    def pin_client(self) -> None:
        """Pin every thread of this process (threads made later inherit it)."""
        if self.client_cpus:
            pin_process(self.client_cpus)

    def service_section(self) -> dict[str, list[int]]:
        """The ``service:`` keys a bench service's config gets."""
        return {"cpu_affinity": self.service_cpus} if self.service_cpus else {}

    @contextlib.contextmanager
    def spawning_service(self) -> Iterator[None]:
        """Around starting a service process: the calling thread (the one that forks)
        back on the bench's starting mask, so the service inherits that mask and not the
        client's, and applies its own cpu_affinity from there."""
        if not self.client_cpus:
            yield
            return
        os.sched_setaffinity(0, self.started_with)
        try:
            yield
        finally:
            os.sched_setaffinity(0, self.client_cpus)

    def describe(self) -> str:
        """The header line: where each side runs and what the limits were measured on."""
        def side(cpus: list[int]) -> str:
            return f"CPUs {format_cpulist(cpus)}" if cpus else "not pinned"
        limit_cpus = format_cpulist(os.sched_getaffinity(0))
        return (f"pinning: service {side(self.service_cpus)}, client (this process) "
                f"{side(self.client_cpus)}; limits measured on the client's CPUs "
                f"{limit_cpus} (memcpy = the best copy those CPUs make)")

    def as_json(self) -> dict[str, object]:
        return {"service_cpus": self.service_cpus, "client_cpus": self.client_cpus,
                "limit_cpus": sorted(os.sched_getaffinity(0))}
