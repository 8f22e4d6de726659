"""Helpers for the reliability tests: a live service with its fault layer reachable, and
content-addressed blocks (a key's bytes are a function of the key, so any served block can
be checked byte for byte)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ctxmem.client import Client, Namespace
from ctxmem_dpu.check import Report, check_devices, read_master_key
from ctxmem_tools.chaos import fresh_client
from ctxmem_tools.launcher import ServiceProcess, local_config
from tests import kit
from tests.kit import byte_layout

BLOCK = 16 << 10
LAYOUT = byte_layout(BLOCK)
FAULT_ENV = {"CTXMEM_FAULT_JOURNAL": "1"}
# The service's flash health timings here: failed devices probed every 50 ms, an I/O over
# 1 s is slow (the chaos campaign's values).
FAST_HEALTH = {"probe_interval_s": 0.05, "slow_io_s": 1.0}


def patch_file(path: str | Path, off: int, data: bytes) -> None:
    """Overwrite ``data`` at ``off`` in a flash file and fsync it (a corruption the service
    did not write)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)


keys = kit.keys  # the suite's keys: sha256 of "tag/i"


def content(key: bytes) -> bytes:
    """The bytes a block of ``key`` holds here (see :func:`tests.kit.content`)."""
    return kit.content(key, BLOCK)


class FaultyService(ServiceProcess):
    """A real ``ctxmem serve`` child whose fault layer is driven through a control file."""

    def __init__(self, workdir: Path, **config: Any) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.ctl = workdir / "faults.json"
        self.gen = 0
        self._write({})
        config["flash"] = {**FAST_HEALTH, **config.get("flash", {})}
        cfg = local_config(workdir, dram_size=config.pop("dram_size", "8MiB"),
                           dram_slab=config.pop("dram_slab", "2MiB"),
                           flash_size=config.pop("flash_size", "48MiB"),
                           flash_slab=config.pop("flash_slab", "4MiB"),
                           transports=["shm"], logging={"level": "info"}, **config)
        cfg["metrics"]["listen"] = ""
        self.client: Client | None = None
        super().__init__(workdir, cfg, start=False)

    def start(self, timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        self._write({})  # a new process starts with no fault armed
        if self.client is not None:  # its channel may sit in reconnect backoff: start over
            self.client.close()
            self.client = None
        extra = {**FAULT_ENV, "CTXMEM_FAULT_CTL": str(self.ctl), **(env or {})}
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            super().start(timeout_s)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # -- fault control --------------------------------------------------------------------
    def _write(self, body: dict[str, Any]) -> None:
        self.gen += 1
        tmp = self.ctl.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gen": self.gen, "journal": True, **body}))
        os.replace(tmp, self.ctl)

    def faults(self, points: str = "", devices: dict[str, Any] | None = None) -> None:
        """Apply faults and wait until the service has them in force."""
        self._write({"points": points, "devices": devices or {}})

        def acked() -> bool:
            try:
                return bool(json.loads(Path(f"{self.ctl}.ack").read_text())
                            .get("gen", -1) >= self.gen)
            except (OSError, ValueError):
                return False
        kit.until(acked, 5, lambda: f"the service to apply the fault control file (generation "
                  f"{self.gen} in {self.ctl}.ack); its log:\n{self.log()[-3000:]}", 0.005)

    def injected(self) -> dict[str, int]:
        try:
            return dict(json.loads(Path(f"{self.ctl}.ack").read_text()).get("injected", {}))
        except (OSError, ValueError):
            return {}

    def wait_injected(self, name: str, at_least: int = 1, timeout: float = 5.0) -> int:
        """The count of injected fault ``name`` once it reaches ``at_least`` (the service
        rewrites its ack file within 10 ms of a count changing, so an immediate read can
        still see the old count), or the last count seen when ``timeout`` passes."""
        return kit.read_until(lambda: self.injected().get(name, 0), lambda n: n >= at_least,
                              timeout, 0.005)

    def wait_dead(self, timeout: float = 10.0) -> bool:
        """Whether the service process has ended within ``timeout`` seconds."""
        return kit.read_until(lambda: self.proc is None or self.proc.poll() is not None,
                              bool, timeout, 0.01)

    # -- client ---------------------------------------------------------------------------
    def ns(self, tenant: str = "t") -> Namespace:
        if self.client is None:
            self.client = fresh_client(self.endpoint)
        return self.client.open_namespace(LAYOUT, model_id="rel", tenant=tenant)

    def stats(self) -> dict[str, float]:
        assert self.client is not None
        return self.client.stats()

    def wait_stat(self, name: str, value: float, timeout: float = 10.0) -> dict[str, float]:
        """Stats once ``name`` equals ``value`` (what the service does in the background,
        e.g. a device's health probe, lands after the call that started it returned).
        Fails, naming the last value seen, when ``timeout`` passes first."""
        st = kit.read_until(self.stats, lambda st: st[name] == value, timeout, 0.02)
        assert st[name] == value, f"stat {name} is {st[name]} after {timeout} s, want {value}"
        return st

    def check(self, repair: bool = False) -> Report:
        from ctxmem_common.config import load_config

        cfg = load_config(self.config_path)
        return check_devices([(d.name, d.path) for d in cfg.flash.devices],
                             read_master_key(cfg), repair=repair)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self.stop()


def put(ns: Namespace, ks: list[bytes]) -> None:
    r = ns.put(ks, [content(k) for k in ks])
    assert r.stored + r.existing == len(ks)


def served(ns: Namespace, ks: list[bytes]) -> dict[bytes, bool]:
    """Get each key (not a chain); assert every served block is exact. Returns key ->
    served?"""
    out: dict[bytes, bool] = {}
    for k in ks:
        buf = bytearray(BLOCK)
        n = ns.get([k], [buf])
        if n:
            assert bytes(buf) == content(k), f"WRONG BLOCK served for {k.hex()[:16]}"
        out[k] = bool(n)
    return out


def tiers(ns: Namespace, ks: list[bytes]) -> list[str]:
    """Per-key tier ("dram", "flash" or "") without the prefix rule."""
    return ns.tiers(ks)


async def settled_audit(store: Any, timeout_s: float = 10.0) -> list[str]:
    """``store.audit()`` once background work has settled.

    The audit counts every allocated extent against the index; an extent reserved by a
    demotion still in flight (the write-back demoter runs concurrently) is in neither yet,
    so a check taken mid-demotion reports a transient "leak". Poll until the audit is
    clean or ``timeout_s`` passes, and return the last problems seen (a real leak stays).
    """
    return await kit.read_until_async(store.audit, lambda problems: not problems,
                                      timeout_s, 0.05)
