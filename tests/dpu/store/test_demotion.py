"""``store/demotion.py`` under ``store/room.py``: a put that needs DRAM demotes the
blocks not yet on flash in victim order, ``flash.demote_batch`` of them at least, makes
them durable, drops their DRAM copies and takes their slots; a block whose DRAM bytes
changed since its commit is dropped, not written. One 8 MiB flash file (1 MiB slabs)
behind eight 1 MiB DRAM slabs of four blocks each (``parts.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .parts import keys_of, parts, where


async def test_a_put_demotes_its_victims_in_lru_order_a_batch_at_least(tmp_path: Path
                                                                      ) -> None:
    with parts(flash_file=tmp_path / "f.img", flash={"demote_batch": 4}) as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 32, dirty=True)  # the whole tier, none on flash yet
        blocks[0].pins = 1  # leased: neither demoted nor dropped
        blocks[1].hits = 2
        p.index.dram_lru.touch(blocks[1], 2)  # protected: a victim after the others
        refs = await p.room.reserve_dram(ns, 3)
        assert len(refs) == 3
        # max(3, demote_batch) = 4 victims, the LRU ones in probation: written, synced,
        # indexed on flash, and their DRAM slots reused.
        assert where(blocks[:7]) == ["dram", "dram", "flash", "flash", "flash", "flash",
                                        "dram"]
        assert keys_of(list(p.index.dirty)) == keys_of([blocks[0], blocks[1], *blocks[6:]])
        assert keys_of(p.index.flash_lru.order()) == keys_of(blocks[2:6])
        assert (p.ctx.counters["demoted_blocks"], p.ctx.counters["evictions_dram"],
                p.ctx.counters["dirty_dropped"]) == (4, 4, 0)
        # Read back from the flash file: each record is the block it names, exact.
        dev = p.ctx.flash.devices[0]
        for b in blocks[2:6]:
            assert b.flash is not None
            hdr = dev.read_header(b.flash.slot)
            assert hdr is not None and (hdr.key, hdr.crc, hdr.seq) == (b.key, b.crc, b.seq)


async def test_a_block_changed_in_dram_since_its_commit_is_dropped_not_written(
        tmp_path: Path) -> None:
    with parts(flash_file=tmp_path / "f.img") as p:
        p.session("a")
        ns = p.namespace("a")
        blocks = p.put(ns, "a", 3, dirty=True)
        assert blocks[1].dram is not None
        p.ctx.dram.view(blocks[1].dram, 4)[:] = b"\xff\xfe\xfd\xfc"  # a client writing late
        failed = await p.demotion().demote(blocks)
        assert list(failed) == [blocks[1]]
        assert type(failed[blocks[1]]).__name__ == "DramChanged"
        assert where(blocks) == ["dram+flash", "gone", "dram+flash"]
        assert blocks[1].key not in p.index.namespace(ns.digest)
        assert p.ctx.counters["dram_crc_mismatch"] == 1
        assert p.ctx.counters["demoted_blocks"] == 2


async def test_a_demotions_payloads_go_in_parts_of_io_piece_bytes(tmp_path: Path) -> None:
    """Issue 29 item 2: a demotion's payloads are I/O jobs of at most
    ``service.io_piece_bytes`` (one block at least), so a get waits for one part, not for
    the batch; every block is durable after, as in one part (0: one part per thread)."""
    for piece, sizes in (("512KiB", [2, 2, 2, 1]), ("100KiB", [1] * 7), (0, [7])):
        with parts(flash_file=tmp_path / f"f{piece}.img",
                   service={"io_piece_bytes": piece}) as p:
            p.session("a")
            ns = p.namespace("a")
            blocks = p.put(ns, "a", 7, dirty=True)
            io = p.ctx.io
            seen: list[int] = []
            submit = io.submit

            def spy(fn: Any, *args: Any, submit: Any = submit, seen: list[int] = seen
                    ) -> Any:
                if fn.__name__ == "payloads":
                    seen.append(len(args[0]))
                return submit(fn, *args)

            io.submit = spy  # type: ignore[method-assign]
            assert await p.demotion().demote(blocks) == {}
            assert seen == sizes, (piece, seen)
            assert where(blocks) == ["dram+flash"] * 7
