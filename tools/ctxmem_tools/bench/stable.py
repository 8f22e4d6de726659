"""``ctxmem bench stable``: instructions per block of the client's put and get paths.

Wall-clock figures on a shared machine drift with the neighbours and the disk (issue
17, item 8); the number of instructions a fixed, deterministic workload executes does
not, so a paired A/B between two commits can judge a change of a few percent.

The workload (the same every run: fixed data, keys, block sizes, batch and rounds;
``PYTHONHASHSEED=0``) runs in a child process under ``valgrind --tool=callgrind``
against a real service that runs natively. The child counts only what it brackets:
collection starts off, and a tiny C helper (built here with gcc from valgrind's own
``callgrind.h``) issues callgrind's client requests to switch it on around each timed
put or get and to dump the count per phase. Those requests are no-ops outside valgrind.
What is counted is the calling thread: the Python path, the shim, the copies and CRCs
it makes, and its share of gRPC; gRPC's own background threads and the service are not.

Compare counts of the same path only: callgrind counts every iteration of a ``rep``
string instruction, so a large copy through glibc's ``memcpy`` (``rep movsb``) counts
about one instruction per byte where numpy's vector loop counts one per 32 bytes. A
change of copy routine shows up many times larger than it runs; a change of Python
work per block shows up as it is.

A CPU without performance counters (most VMs: ``perf stat -e instructions`` reports
"not supported") still runs valgrind, which is why callgrind and not ``perf`` counts
here. Each phase also reports the blocks and bytes it moved, so the figures are
instructions per block and per GB.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 1 << 20
GB = 1e9
BLOCKS = (64 * 1024, 2 * MiB)
OPS = ("put", "get")
CHILD_TIMEOUT_S = 1800.0  # callgrind runs Python 20-50x slower than natively

HELPER_C = """\
#include <valgrind/callgrind.h>
void ctxmem_cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void ctxmem_cg_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


@dataclass
class Count:
    name: str  # op_size_transport, e.g. get_64KiB_shm
    op: str
    block: int
    transport: str
    instructions: int  # over every measured round
    blocks: int
    instructions_per_block: float
    instructions_per_gb: float


def size_label(block: int) -> str:
    return f"{block // MiB}MiB" if block >= MiB else f"{block // 1024}KiB"


def build_helper(workdir: Path) -> Path:
    """Compile the client-request helper (a few lines of C) into ``workdir``."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH: the callgrind helper is built "
                           "at run time; install gcc")
    src, lib = workdir / "cgmarks.c", workdir / "libcgmarks.so"
    src.write_text(HELPER_C)
    proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"building the callgrind helper failed (is valgrind's "
                           f"callgrind.h installed? apt-get install valgrind): {proc.stderr}")
    return lib


# -- the child, under valgrind ----------------------------------------------------------


def child_main(argv: list[str]) -> int:
    """The fixed workload: per block size, one warm-up put and get (not counted), then
    ``rounds`` counted puts (each of new keys, deleted uncounted afterwards) and
    ``rounds`` counted DRAM-hit gets; one dump per (op, block)."""
    import numpy as np

    from ctxmem.client import Client
    from ctxmem_common.keys import chain_hashes
    from ctxmem_common.layout import KVLayout

    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--transport", required=True)
    p.add_argument("--helper", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    a = p.parse_args(argv)
    lib = ctypes.CDLL(a.helper)
    lib.ctxmem_cg_dump.argtypes = [ctypes.c_char_p]
    toggle, dump = lib.ctxmem_cg_toggle, lib.ctxmem_cg_dump
    src = np.random.default_rng(17).integers(0, 255, a.batch, dtype=np.uint8)
    dst = np.empty(a.batch, dtype=np.uint8)
    with Client(a.endpoint, transport=a.transport) as client:
        for block in BLOCKS:
            count = a.batch // block
            layout = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1,
                              head_dim=block // 2, tokens_per_block=1)
            ns = client.open_namespace(layout, model_id=f"bench-stable-{block}")
            bufs = [src[i * block:(i + 1) * block] for i in range(count)]
            outs = [dst[i * block:(i + 1) * block] for i in range(count)]
            label = f"{size_label(block)}_{a.transport}"
            for r in range(a.rounds + 1):  # round 0: warm-up, not counted
                keys = chain_hashes(np.arange(count), 1, salt=f"stable-{block}-{r}".encode())
                if r:
                    toggle()
                res = ns.put(keys, bufs)
                if r:
                    toggle()
                if res.stored != count:
                    raise RuntimeError(f"put of {count} blocks of {block} B stored "
                                       f"{res.stored}")
                ns.delete(keys)
            dump(f"put_{label}".encode())
            keys = chain_hashes(np.arange(count), 1, salt=f"stable-get-{block}".encode())
            ns.put(keys, bufs)
            for r in range(a.rounds + 1):
                if r:
                    toggle()
                got = ns.get(keys, outs)
                if r:
                    toggle()
                if got != count:
                    raise RuntimeError(f"get of {count} blocks of {block} B served {got}")
            dump(f"get_{label}".encode())
            if not np.array_equal(src, dst):
                raise RuntimeError(f"get of {block} B blocks returned other bytes than put")
            ns.delete(keys)
    return 0


# -- the parent -------------------------------------------------------------------------


_DESC = re.compile(r"^desc: Trigger: Client Request: (\S+)$", re.M)
_TOTALS = re.compile(r"^(?:totals|summary): (\d+)", re.M)


def parse_dumps(outdir: Path) -> dict[str, int]:
    """Instructions per dump name, from callgrind's output files in ``outdir``."""
    counts: dict[str, int] = {}
    for f in sorted(outdir.glob("cg.out*")):
        text = f.read_text(errors="replace")
        desc, totals = _DESC.search(text), _TOTALS.search(text)
        if desc and totals:
            counts[desc.group(1)] = counts.get(desc.group(1), 0) + int(totals.group(1))
    return counts


def count_instructions(endpoint: str, transport: str, batch: int, rounds: int,
                       workdir: Path) -> list[Count]:
    """Run the workload under callgrind against the service at ``endpoint``."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("valgrind is not installed (apt-get install valgrind): "
                           "instruction counts need callgrind")
    helper = build_helper(workdir)
    outdir = workdir / f"callgrind-{transport}"
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    env = dict(os.environ, PYTHONHASHSEED="0")
    cmd = [valgrind, "--tool=callgrind", "--collect-atstart=no",
           f"--callgrind-out-file={outdir}/cg.out", sys.executable, "-m",
           "ctxmem_tools.bench.stable", "--child", "--endpoint", endpoint,
           "--transport", transport, "--helper", str(helper), "--batch", str(batch),
           "--rounds", str(rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"the workload under callgrind failed (exit {proc.returncode}): "
                           f"{proc.stderr[-3000:]}")
    dumps = parse_dumps(outdir)
    out = []
    for block in BLOCKS:
        for op in OPS:
            name = f"{op}_{size_label(block)}_{transport}"
            if name not in dumps:
                raise RuntimeError(f"callgrind wrote no dump for {name} in {outdir} "
                                   f"(found {sorted(dumps)})")
            n = rounds * (batch // block)
            ins = dumps[name]
            out.append(Count(name, op, block, transport, ins, n, ins / n,
                             ins / (rounds * batch / GB)))
    return out


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(prog="ctxmem bench stable", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the counts as JSON here")
    p.add_argument("--transports", default="shm,tcp", help="comma-separated (shm, tcp)")
    p.add_argument("--batch-mib", type=int, default=8, help="bytes per batch, MiB")
    p.add_argument("--rounds", type=int, default=4, help="counted rounds per op")
    p.add_argument("--workdir", default=None)
    p.add_argument("--quick", action="store_true", help="smoke test: shm, 4 MiB, 1 round")
    return p


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    from ctxmem.client import Client  # noqa: F401  (fail early if the shim is missing)
    from ctxmem_tools.launcher import ServiceProcess, local_config

    p = _parser()
    args = p.parse_args(argv)
    transports = ["shm"] if args.quick else [t for t in args.transports.split(",") if t]
    batch_mib = 4 if args.quick else args.batch_mib
    rounds = 1 if args.quick else args.rounds
    if batch_mib * MiB < max(BLOCKS):
        p.error(f"--batch-mib must hold at least one {size_label(max(BLOCKS))} block")
    base = Path(args.workdir or tempfile.mkdtemp(prefix="ctxmem-bench-stable-",
                                                 dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"ctxmem bench stable: callgrind instruction counts of the client's put and get, "
          f"{batch_mib} MiB per batch, {rounds} rounds, transports {transports}")
    cfg = local_config(base / "svc", dram_size=f"{4 * batch_mib + 64}MiB", dram_slab="16MiB",
                       flash_size=None, transports=transports)
    counts: list[Count] = []
    try:
        with ServiceProcess(base / "svc", cfg) as svc:
            for t in transports:
                counts += count_instructions(svc.endpoint, t, batch_mib * MiB, rounds, base)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"ctxmem bench stable: {exc}", file=sys.stderr)
        return 2
    print(f"\n{'name':20} {'instructions':>14} {'blocks':>7} {'per block':>12} {'per GB':>14}")
    for c in counts:
        print(f"{c.name:20} {c.instructions:14d} {c.blocks:7d} "
              f"{c.instructions_per_block:12.0f} {c.instructions_per_gb:14.4g}")
    if args.json:
        doc = {"results": [asdict(c) for c in counts],
               "params": {"batch_mib": batch_mib, "rounds": rounds, "transports": transports,
                          "tool": "valgrind --tool=callgrind", "python": sys.version}}
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run())
