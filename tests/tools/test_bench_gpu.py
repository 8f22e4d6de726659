"""``ctxmem bench gpu`` (issue 27 item 6): import, arguments, the refusal without CUDA, and
every piece that runs without a GPU (the row and limit arithmetic, the report, the TTFT
and engine rows read from those benches' own JSON, the shim's slab mapping on a real
service). The CUDA paths are skipped here: no session that built this had a device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ctxmem_tools.bench import gpu
from ctxmem_tools.bench.gpu import GpuRow
from ctxmem_tools.cli import bench_command
from tests import kit

MiB = 1 << 20


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_cuda = pytest.mark.skipif(
    not _cuda(), reason="needs a CUDA device (none here); run `ctxmem bench gpu` on a "
                        "machine with one, docs/benchmarks.md")


def test_help_names_the_command_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_command(["gpu", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ctxmem bench gpu")
    for opt in ("--blocks", "--batch", "--lengths", "--vllm-python", "--json"):
        assert opt in out


@pytest.mark.skipif(_cuda(), reason="this machine has CUDA: the refusal cannot happen")
def test_without_cuda_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_command(["gpu"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "ctxmem bench gpu: no CUDA device is visible (torch.cuda.is_available() is False); "
        "run it on a machine with an NVIDIA GPU and a CUDA build of torch (the script in "
        "docs/benchmarks.md, \"GPU: ctxmem bench gpu\")\n")


def test_without_torch_exits_2_naming_it(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert bench_command(["gpu", "--no-ttft"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ctxmem bench gpu: no CUDA device is visible (torch is not "
                          "installed (")
    assert err.count("\n") == 1 and "docs/benchmarks.md" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--blocks", "4MiB", "--batch", "2MiB"],
     "--batch 2097152 B is smaller than the block 4194304 B"),
    (["--blocks", "lots"], "--blocks: "),
    (["--blocks", "0"], "--blocks: expected positive sizes such as 64KiB,2MiB, got '0'"),
    (["--lengths", "8192,abc"],
     "--lengths: expected token counts such as 8192,16384,32768, got '8192,abc'"),
    (["--lengths", "8192,100"],
     "--lengths: [100]: expected positive multiples of 256 tokens (bench ttft's block)"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--ttft-repeats", "0"], "--ttft-repeats must be at least 1"),
    (["--vllm-model", "/models/m"], "--vllm-model needs --vllm-python (a CUDA vLLM's python)"),
    (["--workdir", "/nonexistent/ctxmem-gpu"],
     "--workdir /nonexistent/ctxmem-gpu: not a directory"),
    (["--no-copy", "--no-ttft"], "--no-copy and --no-ttft leave nothing to measure"),
    (["--model-config", "70b"], "argument --model-config: invalid choice: '70b'"),
])
def test_bad_arguments_are_clear_errors_before_any_cuda_check(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_command(["gpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "ctxmem bench gpu: error: " + message in err
    assert "no CUDA device" not in err


def test_arguments_parse_to_sizes_and_lengths() -> None:
    args, blocks, batch, lengths = gpu.parse_args([])
    assert blocks == [64 * 1024, 2 * MiB]
    assert batch == 64 * MiB
    assert lengths == [8192, 16384, 32768]
    assert args.model_config == "1b" and args.repeats == 5
    _a, blocks, batch, lengths = gpu.parse_args(["--blocks", "2MiB,64KiB,2MiB", "--batch",
                                                 "8MiB", "--lengths", "16384,8192"])
    assert (blocks, batch, lengths) == ([64 * 1024, 2 * MiB], 8 * MiB, [8192, 16384])


def test_rate_and_limit_arithmetic() -> None:
    assert gpu.gbps(2 * 10**9, 2.0) == 1.0
    assert gpu.gbps(64 * MiB, 0.004) == pytest.approx(16.777216)
    with pytest.raises(ValueError, match="must be positive"):
        gpu.gbps(1, 0.0)
    # two copies of the same bytes, one after the other
    assert gpu.serial_rate(10.0, 10.0) == 5.0
    assert gpu.serial_rate(20.0, 5.0) == 4.0
    assert gpu.serial_rate(12.0) == 12.0
    assert gpu.serial_rate(None, 5.0) is None
    assert gpu.serial_rate(0.0, 5.0) is None
    assert gpu.serial_rate() is None
    assert gpu.blocks_per_batch(64 * MiB, 64 * 1024) == 1024
    assert gpu.blocks_per_batch(64 * MiB, 2 * MiB) == 32
    assert gpu.blocks_per_batch(5 * MiB, 2 * MiB) == 2
    assert [gpu.size_label(n) for n in (65536, 2 * MiB, 1536, 100)] == [
        "64KiB", "2MiB", "1536B", "100B"]


def test_rows_ratio_and_report() -> None:
    rate = gpu.copy_row("h2d_pinned_64KiB", 65536, 0.01, 10**8, 20.0, "one copy from pinned")
    assert rate.value == 10.0 and rate.ratio == 0.5
    ttft = GpuRow("ttft_ctxmem_dram", 200.0, "ms", 50.0, "floor", prompt_tokens=8192)
    assert ttft.ratio == 0.25  # times: the limit over the value
    missing = GpuRow("gpu_put_slab_2MiB", None, "GB/s", 8.0, "D2H then one host copy",
                     2 * MiB, note=gpu.SLAB_NOT_OFFERED)
    assert missing.ratio is None
    assert gpu.table([rate, ttft, missing]).splitlines() == [
        "| row | block | tokens | value | limit | of limit | note |",
        "|---|---:|---:|---:|---:|---:|---|",
        "| h2d_pinned_64KiB | 64KiB |  | 10.00 GB/s | 20.00 GB/s (one copy from pinned) "
        "| 50% |  |",
        "| ttft_ctxmem_dram |  | 8192 | 200.00 ms | 50.00 ms (floor) | 25% |  |",
        f"| gpu_put_slab_2MiB | 2MiB |  | — | 8.00 GB/s (D2H then one host copy) | — | "
        f"{gpu.SLAB_NOT_OFFERED} |",
    ]
    doc = gpu.results([rate, missing])
    assert json.loads(json.dumps(doc)) == doc
    assert doc[0] == {"name": "h2d_pinned_64KiB", "value": 10.0, "unit": "GB/s",
                      "limit": 20.0, "limit_name": "one copy from pinned",
                      "block_bytes": 65536, "prompt_tokens": None, "note": "",
                      "command": "", "ratio": 0.5}
    assert doc[1]["value"] is None and "issue 27 item 1" in doc[1]["note"]


def test_ttft_rows_from_bench_ttfts_own_json() -> None:
    from ctxmem_tools.bench.ttft_report import LengthResult, results

    r = LengthResult(8192, 64, 1 << 30, recompute_s=2.0, store_s=0.5,
                     load_dram_s=[0.3, 0.2], get_dram_s=[0.1], prefill_new_s=[0.05])
    rows = gpu.ttft_rows({"results": results([r])}, "bench ttft --device cuda")
    assert [(x.name, x.value, x.limit, x.prompt_tokens) for x in rows] == [
        ("ttft_recompute", 2000.0, None, 8192),
        ("ttft_ctxmem_dram", 200.0, 50.0, 8192),
    ]
    assert rows[1].note == "load from ctxmem's DRAM tier; 10.0x faster than recompute"
    assert rows[1].ratio == 0.25
    assert all(x.command == "bench ttft --device cuda" for x in rows)


def test_engine_rows_from_bench_engines_own_json() -> None:
    from dataclasses import asdict

    from ctxmem_tools.bench.engine import Row

    doc = {"results": [asdict(Row("no cache", 8192, 900.0, 880.0, True, 30.0)),
                       asdict(Row("ctxmem", 8192, 910.0, 120.5, True, 31.0))],
           "skipped": {"LMCache": "LMCache does not import in vLLM's environment"}}
    rows = gpu.engine_rows(doc, "bench engine ...")
    assert [(x.name, x.value, x.prompt_tokens) for x in rows] == [
        ("engine_no_cache", 880.0, 8192), ("engine_ctxmem", 120.5, 8192),
        ("engine_lmcache", None, None)]
    assert rows[1].note == "vLLM on CUDA, repeat prompt; cold 910.0 ms"
    assert rows[2].note == "skipped: LMCache does not import in vLLM's environment"


def test_child_commands_are_what_the_benches_accept() -> None:
    from ctxmem_tools.bench.ttft import _parser as ttft_parser

    argv = gpu.ttft_command([8192, 32768], "1b", "/tmp/t.json", 2)
    assert argv[1:3] == ["-m", "ctxmem_tools.bench.ttft"]
    ns = ttft_parser().parse_args(argv[3:])
    assert (ns.device, ns.lengths, ns.model_config, ns.dtype, ns.no_flash, ns.repeats,
            ns.json_path) == ("cuda", "8192,32768", "1b", "bfloat16", True, 2, "/tmp/t.json")
    argv = gpu.engine_command([8192], "/opt/vllm/bin/python", "/models/m", "/tmp/e.json", 2)
    assert argv[1:] == ["-m", "ctxmem_tools.bench.engine", "--python", "/opt/vllm/bin/python",
                        "--model", "/models/m", "--lengths", "8192", "--rounds", "2",
                        "--configs", "no cache,ctxmem,LMCache", "--cpus", "", "--json",
                        "/tmp/e.json"]
    argv = gpu.engine_command([8192, 32768], "/opt/vllm/bin/python", "", "/tmp/e.json", 1)
    assert "--model" not in argv and argv[argv.index("--lengths") + 1] == "8192,32768"


def test_the_shims_mapping_of_a_real_service_slab_holds_the_stored_blocks(
        tmp_path: Path) -> None:
    """The memory ``bench gpu`` registers with CUDA: a real service's DRAM slab, as the
    shim's shared-memory channel mapped it for a get; every stored block's bytes are in
    it (what an H2D from the registered slab reads)."""
    import ctxmem

    block, n = 64 * 1024, 8
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(n)]
    keys = kit.keys("k", n)
    with gpu._service(tmp_path, 4 * MiB) as endpoint, \
            ctxmem.Client(endpoint, transport="shm") as client:
        ns = client.open_namespace(kit.byte_layout(block), model_id="gpu-slab")
        assert ns.put(keys, data).stored == n
        out = [np.empty(block, dtype=np.uint8) for _ in range(n)]
        assert ns.get(keys, out) == n
        slabs = gpu._mapped_slabs(ns)
        assert slabs and all(v.nbytes == 64 * MiB for v in slabs)
        whole = b"".join(bytes(v) for v in slabs)
        for d in data:
            assert whole.find(d.tobytes()) >= 0


def test_mapped_slabs_refuses_a_tcp_client(tmp_path: Path) -> None:
    import ctxmem

    with gpu._service(tmp_path, 4 * MiB) as endpoint, \
            ctxmem.Client(endpoint, transport="tcp") as client:
        ns = client.open_namespace(kit.byte_layout(1024), model_id="gpu-tcp")
        ns.lookup([b"x" * 32])  # opens the session
        with pytest.raises(RuntimeError, match="not on the shared-memory transport"):
            gpu._mapped_slabs(ns)


@needs_cuda
def test_copy_rows_on_cuda(tmp_path: Path) -> None:
    with gpu._service(tmp_path, 4 * MiB) as endpoint:
        rows = gpu.measure_copies(endpoint, [64 * 1024, 2 * MiB], 4 * MiB, 2)
    names = {r.name for r in rows}
    for lbl in ("64KiB", "2MiB"):
        for kind in ("h2d_pinned", "d2h_pinned", "h2d_slab", "d2h_slab", "gpu_put",
                     "get_gpu", "limit_h2d", "limit_d2h"):
            assert f"{kind}_{lbl}" in names
    for r in rows:
        if "slab_" in r.name and r.name.startswith(("gpu_put", "get_gpu")):
            assert r.value is None and "issue 27 item 1" in r.note
        else:
            assert r.value is not None and r.value > 0, r


@needs_cuda
def test_run_on_cuda_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert bench_command(["gpu", "--no-ttft", "--batch", "4MiB", "--repeats", "1",
                          "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "gpu" and doc["results"]


def test_engines_tiny_model_has_room_for_bench_gpus_lengths(tmp_path: Path) -> None:
    """bench gpu's engine rows run bench engine at 8K-32K tokens: its tiny model is built
    with the positions asked (4096 unless more are needed), so vLLM's max-model-len fits."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from ctxmem_tools.bench.engine import TINY_POSITIONS, build_tiny_model

    assert TINY_POSITIONS == 4096
    path = build_tiny_model(sys.executable, tmp_path / "tiny", positions=32768 + 64)
    cfg = json.loads((path / "config.json").read_text())
    tok = json.loads((path / "tokenizer_config.json").read_text())
    assert cfg["max_position_embeddings"] == 32832
    assert tok["model_max_length"] == 32832
