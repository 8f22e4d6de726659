"""``ctxmem bench recovery``: warm-restart time against the number of stored blocks.

For each size (default 10k, 100k, 1M blocks of 4 KiB) it builds a flash image and starts
the real service on it (``python -m ctxmem_dpu serve``, a child process), then reports the
service's own rebuild time (the ``recovery_seconds`` counter: scan of every slab's header
table + index build), the time from process start to serving, and the resident memory,
and checks the result: every block is found by Lookup, and a sample is read back and
compared byte for byte.

How the images are made. Putting 1M blocks through the service takes minutes on this
machine, so the large images are **generated directly with the on-flash format code**
(``ctxmem_common.flash_format``): real superblocks, slab headers and record headers
(namespace, key, length, CRC32C, sequence number, and the authenticator made with the
service's master key for each record's key, place and sequence number), payloads left
sparse (all zeros, which is what their CRC says, so they read back correctly). A rebuild
reads header tables only, so it does the same work on a generated image as on one the
service wrote. To show
that, ``--through-service N`` (default 10,000) also puts N random blocks through the shim,
makes them durable, kills the service with SIGKILL and measures the restart: the figure
should match the generated image of the same size.

Limits printed beside the figures: the device's sequential O_DIRECT read rate (measured
on the image's header tables, the bytes a rebuild must read: 4 KiB per block), hence the
I/O floor of a rebuild, plus the cores and the load average while measuring (the project's
machines are shared).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxmem.client import Client
from ctxmem_common.codecs import crc32c
from ctxmem_common.codecs.blockauth import TAG_BYTES, BlockAuthenticator
from ctxmem_common.flash_format import (
    DATA_START,
    SB_OFFSET,
    SECTOR,
    SlabHeader,
    Superblock,
    pack_header_table,
    payload_offset,
    record_context,
    slab_base,
    slots_per_slab,
)
from ctxmem_common.keys import namespace_digest
from ctxmem_common.layout import KVLayout
from ctxmem_common.progress import progress
from ctxmem_common.units import parse_size
from ctxmem_tools.launcher import ServiceProcess, local_config

MODEL = "bench-recovery"
TENANT = "default"


def layout_for(block: int) -> KVLayout:
    if block % 2 or block < 4096:
        raise ValueError("--block-size must be an even number of bytes, at least 4096")
    return KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=block // 2,
                    tokens_per_block=1)


def key_of(seq: int) -> bytes:
    return b"R" + seq.to_bytes(8, "little") + bytes(23)


def _keys(seqs: np.ndarray) -> np.ndarray:
    keys = np.zeros((len(seqs), 32), dtype=np.uint8)
    keys[:, 0] = ord("R")
    keys[:, 1:9] = seqs.astype("<u8").view(np.uint8).reshape(-1, 8)
    return keys


def generate_image(path: Path, blocks: int, block: int, slab_size: int,
                   master_key: bytes) -> dict[str, int]:
    """A device image holding ``blocks`` records (sparse zero payloads), authenticated
    under ``master_key`` (the service's); returns its geometry: bytes, slabs,
    header-table bytes."""
    layout = layout_for(block)
    ns = namespace_digest(TENANT, MODEL, layout, {})
    slot = (block + SECTOR - 1) // SECTOR * SECTOR
    per = slots_per_slab(slab_size, slot)
    slabs = max(1, -(-blocks // per))
    size = slab_base(slabs + 1, slab_size)  # one spare slab for new writes
    crc = crc32c(bytes(block))
    auth = BlockAuthenticator.for_namespace(master_key, ns)
    zeros = memoryview(bytes(block))
    sb = Superblock(slab_size, slabs + 1, os.urandom(16))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, sb.pack_pair(), SB_OFFSET)
        done = 0
        for s in range(slabs):
            n = min(per, blocks - done)
            seqs = np.arange(done + 1, done + n + 1, dtype=np.uint64)
            keys = _keys(seqs)
            # One authenticator per record (its key, place and sequence number differ).
            tags = np.frombuffer(b"".join(
                auth.tag(k, zeros, record_context(sb.device_uuid,
                                                  payload_offset(s, i, slab_size, slot), q))
                for i, (k, q) in enumerate(zip(map(bytes, keys), seqs.tolist(), strict=True))
            ), dtype=np.uint8).reshape(n, TAG_BYTES)
            table = pack_header_table(per, ns, keys, block, crc, seqs, tags=tags)
            base = slab_base(s, slab_size)
            os.pwrite(fd, SlabHeader(slot, per).pack(), base)
            os.pwrite(fd, table, base + SECTOR)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": size, "slabs": slabs, "table_bytes": slabs * per * SECTOR}


def read_rate(path: Path, nbytes: int, chunk: int = 4 << 20) -> float:
    """Sequential O_DIRECT read rate (bytes/s) over the first ``nbytes`` of the data area."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk)
    try:
        nbytes = max(chunk, min(nbytes, 2 << 30))
        t = time.perf_counter()
        off = DATA_START
        while off < DATA_START + nbytes:
            if os.preadv(fd, [buf], off) <= 0:
                break
            off += chunk
        return (off - DATA_START) / (time.perf_counter() - t)
    finally:
        buf.close()
        os.close(fd)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Row:
    blocks: int
    source: str  # "generated" or "service"
    table_bytes: int
    recovered_blocks: int
    recovery_s: float
    per_million_s: float
    ready_s: float
    io_floor_s: float
    service_cpu_s: float
    rss_mb: float
    load_avg: float
    verified: int


def _service(workdir: Path, image: Path, block: int, slab: str) -> ServiceProcess:
    cfg = local_config(workdir, encryption=False, dram_size="64MiB", dram_slab="8MiB",
                       flash_slab=slab, flash_path=str(image), flash_size=None,
                       logging={"level": "warning"})
    cfg["flash"]["devices"] = [{"name": "flash0", "backend": "local", "path": str(image)}]
    cfg["metrics"]["listen"] = ""
    return ServiceProcess(workdir, cfg, start=False)


def _measure(svc: ServiceProcess, blocks: int, block: int, source: str, table_bytes: int,
             rate: float, sample: list[bytes], expect: dict[bytes, bytes] | None) -> Row:
    t = time.perf_counter()
    svc.start(timeout_s=600)
    ready = time.perf_counter() - t
    assert svc.proc is not None
    rss = _rss_bytes(svc.proc.pid)
    cpu = _cpu_s(svc.proc.pid)
    load = os.getloadavg()[0]
    with Client(svc.endpoint, transport="shm") as c:
        st = c.stats()
        ns = c.open_namespace(layout_for(block), model_id=MODEL, tenant=TENANT)
        found = ns.exists(sample)
        bufs = [bytearray(block) for _ in sample[:200]]
        got = 0
        for i in range(0, len(bufs), 50):  # keys are not a chain: one get per key
            for k, b in zip(sample[i:i + 50], bufs[i:i + 50], strict=True):
                got += ns.get([k], [b])
        ok = sum(found)
        good = sum(1 for k, b in zip(sample[:200], bufs, strict=True)
                   if bytes(b) == (expect[k] if expect is not None else bytes(block)))
    rec_s = st["recovery_seconds_x1e6"] / 1e6
    if ok != len(sample) or good != min(200, len(sample)) or got != min(200, len(sample)):
        raise RuntimeError(f"recovery of {blocks} blocks: {ok}/{len(sample)} sampled keys "
                           f"found, {good} read back intact")
    return Row(blocks, source, table_bytes, int(st["recovered_blocks"]), rec_s,
               rec_s * 1e6 / max(1, blocks), ready, table_bytes / rate, cpu, rss / 2**20, load,
               ok)


def _through_service(workdir: Path, n: int, block: int, slab: str, rate: float) -> Row:
    image = workdir / "service.img"
    slab_size = parse_size(slab)
    slot = (block + SECTOR - 1) // SECTOR * SECTOR
    per = slots_per_slab(slab_size, slot)
    size = slab_base(-(-n // per) + 1, slab_size)
    cfg = local_config(workdir, encryption=False, dram_size="64MiB", dram_slab="8MiB",
                       flash_slab=slab, flash_path=str(image), flash_size=str(size),
                       logging={"level": "warning"})
    cfg["metrics"]["listen"] = ""
    svc = ServiceProcess(workdir, cfg)
    rng = np.random.default_rng(7)
    expect: dict[bytes, bytes] = {}
    try:
        with Client(svc.endpoint, transport="shm") as c:
            ns = c.open_namespace(layout_for(block), model_id=MODEL, tenant=TENANT)
            batch = 256
            for start in range(0, n, batch):
                keys = [key_of(i + 1) for i in range(start, min(n, start + batch))]
                data = [rng.integers(0, 256, block, dtype=np.uint8).tobytes() for _ in keys]
                ns.put(keys, data)
                if ns.evict(keys) != len(keys):  # durable on flash before the kill
                    raise RuntimeError("evict did not make every block durable")
                expect.update(zip(keys, data, strict=True))
        svc.kill()  # SIGKILL: the restart below is a crash recovery
        sample = [key_of(i) for i in np.linspace(1, n, min(n, 1000)).astype(int).tolist()]
        return _measure(svc, n, block, "service", -(-n // per) * per * SECTOR, rate, sample,
                        expect)
    finally:
        svc.stop()


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(prog="ctxmem bench recovery",
                                description="Warm-restart time vs number of stored blocks.")
    p.add_argument("--blocks", default="10000,100000,1000000",
                   help="comma-separated block counts (default %(default)s)")
    p.add_argument("--block-size", type=int, default=4096, help="bytes per block (4096)")
    p.add_argument("--slab-size", default="256MiB", help="flash slab size (256MiB, the "
                                                         "default config's)")
    p.add_argument("--through-service", type=int, default=10_000, metavar="N",
                   help="also put N blocks through the service and time the restart after "
                        "kill -9 (0: skip)")
    p.add_argument("--dir", help="where to put the images (a real disk, not tmpfs; default: "
                                 "a temporary directory under /var/tmp)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the images")
    return p


def run(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.blocks.split(",") if x]
    slab_size = parse_size(args.slab_size)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ctxmem-recovery-",
                                                                dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    machine: dict[str, Any] = {"cpus": os.cpu_count(), "machine": platform.machine(),
                               "python": platform.python_version()}
    # On a terminal: a bar over the blocks of every size (and the through-service run).
    bar = progress(sum(sizes) + max(0, args.through_service), "ctxmem bench recovery",
                   "blocks")
    try:
        rate = 0.0
        for n in sizes:
            work = base / f"n{n}"
            work.mkdir(exist_ok=True)
            image = work / "flash0.img"
            t = time.perf_counter()
            svc = _service(work, image, args.block_size, args.slab_size)
            # The records are authenticated with the master key the service will load.
            key = bytes.fromhex((work / "master.key").read_text().strip())
            geo = generate_image(image, n, args.block_size, slab_size, key)
            gen_s = time.perf_counter() - t
            r = read_rate(image, geo["table_bytes"])
            rate = max(rate, r)
            sample = [key_of(i) for i in np.linspace(1, n, min(n, 1000)).astype(int).tolist()]
            try:
                row = _measure(svc, n, args.block_size, "generated", geo["table_bytes"], r,
                               sample, None)
            finally:
                svc.stop()
            rows.append(row)
            print(f"{n:>9,} blocks (generated in {gen_s:.1f} s): rebuild {row.recovery_s:.2f} s "
                  f"({row.per_million_s:.2f} s per 1M), serving after {row.ready_s:.2f} s, "
                  f"I/O floor {row.io_floor_s:.2f} s at {r / 1e9:.2f} GB/s, service CPU "
                  f"{row.service_cpu_s:.2f} s (start-up included), RSS {row.rss_mb:.0f} MiB, "
                  f"load {row.load_avg:.1f}", flush=True)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            bar.update(n)
        if args.through_service:
            work = base / "through-service"
            row = _through_service(work, args.through_service, args.block_size,
                                   args.slab_size, rate or 1e9)
            rows.append(row)
            print(f"{row.blocks:>9,} blocks (put through the service, then kill -9): rebuild "
                  f"{row.recovery_s:.2f} s ({row.per_million_s:.2f} s per 1M), serving after "
                  f"{row.ready_s:.2f} s", flush=True)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            bar.update(args.through_service)
        bar.close()
        machine.update(read_gb_s=round(rate / 1e9, 3), loadavg=os.getloadavg())
        print(f"machine: {machine['cpus']} cores, sequential O_DIRECT read "
              f"{machine['read_gb_s']} GB/s, load average {machine['loadavg'][0]:.1f} "
              f"(target: <= 5 s per 1M blocks)")
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"machine": machine, "results": [asdict(r) for r in rows]}, indent=2))
    finally:
        bar.close()
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0
