"""Loads before stores (issue 29 item 2): when write-back to flash is behind by more than
``flash.shed_backlog_bytes``, a put that would have to wait for it is shed at once (the
``SHED`` error, ``ctxmem.Shed``), counted by the service (``puts_shed``, per tenant) and
by the shim (``Client.puts_shed``); nothing half-stored, every stored block still exact,
and puts are taken again once write-back caught up. With the bound at 0 (the default) a
put waits, as before. A real service whose device writes stall (its fault layer)."""

from __future__ import annotations

import pytest

import ctxmem

from .kit import FaultyService, content, keys, served

BATCH = 64  # blocks of 16 KiB per put; the DRAM tier (8 MiB) holds 512


def _fill(ns: ctxmem.Namespace, tag: str, batches: int
          ) -> tuple[list[bytes], ctxmem.Shed | None]:
    stored: list[bytes] = []
    for i in range(batches):
        ks = keys(tag, BATCH, i * BATCH)
        try:
            ns.put(ks, [content(k) for k in ks])
        except ctxmem.Shed as exc:
            return stored, exc
        stored += ks
    return stored, None


@pytest.mark.parametrize("path", ["fast", "grpc"])
def test_puts_are_shed_while_write_back_is_stalled_and_taken_again_after(
        tmp_path: object, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the shared-memory fast path and over gRPC (``CTXMEM_FAST_OPS=0``): the SHED
    code maps to its own status on both, and the shim raises ``ctxmem.Shed``."""
    from pathlib import Path

    if path == "grpc":
        monkeypatch.setenv("CTXMEM_FAST_OPS", "0")

    svc = FaultyService(Path(str(tmp_path)) / "svc", flash={"shed_backlog_bytes": "1MiB"})
    svc.start()
    try:
        ns = svc.ns()
        svc.faults(devices={"*": {"delay_s": 2.0}})  # write-back cannot progress
        stored, shed = _fill(ns, "shed", 12)  # 768 blocks: more than DRAM holds
        assert shed is not None, "every put waited for the stalled write-back"
        assert isinstance(shed, ctxmem.ResourceExhausted)
        assert "shed" in str(shed) and "flash.shed_backlog_bytes" in str(shed)
        assert 0 < len(stored) <= 512
        assert svc.client is not None and svc.client.puts_shed == 1
        st = svc.stats()
        assert st["puts_shed"] == 1 and st["puts_shed_blocks"] == BATCH
        assert st["tenant.t.shed"] == 1
        shed_keys = keys("shed", BATCH, len(stored))
        assert ns.lookup(shed_keys).num_hits == 0, "a shed put stored nothing"
        svc.faults()  # the device is back: write-back catches up
        svc.wait_stat("dirty_blocks", 0, timeout=120)
        more, again = _fill(ns, "after", 2)
        assert again is None and len(more) == 2 * BATCH
        assert all(served(ns, stored + more).values())
    finally:
        svc.close()


def test_without_a_bound_a_put_waits_for_write_back(tmp_path: object) -> None:
    from pathlib import Path

    svc = FaultyService(Path(str(tmp_path)) / "svc")
    svc.start()
    try:
        ns = svc.ns()
        svc.faults(devices={"*": {"delay_s": 0.02}})  # slow, not stalled
        stored, shed = _fill(ns, "wait", 10)  # 640 blocks into a 512-block DRAM tier
        assert shed is None and len(stored) == 10 * BATCH
        svc.faults()
        assert svc.stats()["puts_shed"] == 0
        assert all(served(ns, stored[-BATCH:]).values())
    finally:
        svc.close()


def test_the_shed_bound_is_a_size(tmp_path: object) -> None:
    from ctxmem_common.config import config_from_dict
    from ctxmem_common.errors import ConfigError

    assert config_from_dict({"flash": {"shed_backlog_bytes": "256MiB"}}) \
        .flash.shed_backlog_bytes == 256 << 20
    with pytest.raises(ConfigError, match="shed_backlog_bytes"):
        config_from_dict({"flash": {"shed_backlog_bytes": "lots"}})
