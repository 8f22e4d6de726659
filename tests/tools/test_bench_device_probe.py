"""The device probe ``ctxmem bench`` runs beside each flash round, and the paired
fraction it reports (``*_paired`` rows)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ctxmem_tools.bench.device_probe import DeviceProbe, paired_fraction

MiB = 1 << 20


def test_probe_writes_reads_back_and_removes_its_file(tmp_path: Path) -> None:
    """The probe's batch really lands on the file (O_DIRECT, synced) and is read back
    intact, from one thread and from several; the scratch file is gone after close."""
    scratch = tmp_path / "probe.bin"
    with DeviceProbe(scratch, 0, MiB, 4) as probe:
        for threads in (1, 2, 3):
            assert probe.write(threads) > 0
            with open(scratch, "rb") as f:  # what the file holds is the probe's batch
                assert [f.read(MiB) for _ in range(4)] == [bytes(b) for b in probe._bufs]
            for b in probe._bufs:  # spoil the buffers: read() must restore every one
                b[:64] = b"\0" * 64
            assert probe.read(threads) > 0
            with open(scratch, "rb") as f:
                assert [f.read(MiB) for _ in range(4)] == [bytes(b) for b in probe._bufs]
        assert os.path.getsize(scratch) == 4 * MiB
    assert not scratch.exists()
    probe.close()  # twice: nothing more to do


def test_probe_at_an_offset_keeps_the_bytes_before_it(tmp_path: Path) -> None:
    scratch = tmp_path / "probe.bin"
    scratch.write_bytes(b"k" * MiB)
    probe = DeviceProbe(scratch, MiB, MiB, 2)
    try:
        probe.write()
        with open(scratch, "rb") as f:
            assert f.read(MiB) == b"k" * MiB
            assert f.read(MiB) == bytes(probe._bufs[0])
    finally:
        probe.close()


def test_paired_fraction_holds_each_round_against_its_own_probe() -> None:
    # Round by round: device 0.5 s / op 1 s, 1/2, 3/3 -> 0.5, 0.5, 1.0: median 0.5.
    assert paired_fraction([1.0, 2.0, 3.0], [0.5, 1.0, 3.0]) == 0.5
    # The disk fast in round 2 only: rounds 1 and 3 are at 0.9 of the disk as it was then
    # (median 0.9), where the ratio of the medians (1.0 s / 2.0 s) would say 0.5.
    assert paired_fraction([1.0, 4.0, 2.0], [0.9, 1.0, 1.8]) == pytest.approx(0.9)
    # The cipher slower than the disk: its time is the floor under the device's.
    assert paired_fraction([2.0, 2.0], [0.5, 1.0], device_cap_s=1.5) == pytest.approx(0.75)


def test_paired_fraction_refuses_unpaired_rounds() -> None:
    with pytest.raises(ValueError, match="pair one probe with each round"):
        paired_fraction([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="pair one probe"):
        paired_fraction([], [])
