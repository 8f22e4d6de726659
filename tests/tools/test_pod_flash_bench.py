"""The shared-flash rows of ``ctxmem bench pod``, end to end on a small run."""

from __future__ import annotations

from pathlib import Path

from ctxmem_tools.bench.pod_flash import measure_shared_flash


def test_shared_flash_rows(tmp_path: Path) -> None:
    rows = measure_shared_flash(tmp_path, block_kib=(64,), blocks=16, batch=8, repeat=1)
    by = {r.name: r for r in rows}
    assert set(by) == {"pod_shared_flash_get_64k", "limit_odirect_read_64k",
                       "pod_shared_flash_get_64k_1block_p50"}
    get, limit = by["pod_shared_flash_get_64k"], by["limit_odirect_read_64k"]
    assert get.unit == "GB/s" and get.value > 0 and get.limit == limit.value > 0
    assert by["pod_shared_flash_get_64k_1block_p50"].unit == "us"
