"""Every copy-paste ``bash``/``sh``/``shell``/``console``/``python`` block of docs/*.md and
README.md is checked here, or by the test named in its entry of ``BLOCKS`` (issue 30
item 6); a block that is in no entry fails ``test_every_block_is_classified`` until
someone says how it is checked.

A block's id is its page and its first line (``#2`` for a repeated first line), never its
line number. What each kind gets:

* every shell block (whatever else runs it): ``bash -n``; every ``ctxmem`` command in it
  through that subcommand's own argument parser (``_parser()`` of the module the
  ``ctxmem.commands`` entry point of pyproject.toml names; ``ctxmem bench X`` as
  ``ctxmem_tools.cli.bench_command`` dispatches it), a ``ctxmem config check FILE`` of a
  file the block installs from the repo run for real on that file; every repo path it
  names exists (bare ``*.yaml``/``*.service`` names: somewhere under deploy/); every
  ``ctxmem``/``ctxmem_kv`` version it names is pyproject.toml's; every ``pip install`` is
  ctxmem's wheel (or a checkout) with extras pyproject.toml defines; every ``lmcache
  server`` through LMCache 0.5.6's own server parser and storage-manager config;
* ``run``: executed for real here: the openssl recipes of docs/security.md in a temp dir
  (then a service starts with those files and the shim's TLS example connects with the
  tenant certificate they made); the Python examples against real services
  (``SUBSTITUTIONS``: only endpoints, credentials and file locations replaced, each
  replacement required to match; ``GIVEN``: the names a block uses without defining,
  e.g. ``token_ids``; ``THEN``: what must hold afterwards);
* ``elsewhere``: run by another test, named, whose own selection of doc blocks must pick
  this one up (checked here);
* ``static``: cannot run in CI; the reason is in the entry. Python ones compile and what
  they name is checked against the code that runs them in CI.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
LANGS = ("bash", "sh", "shell", "console", "python")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
PY = sys.executable


@dataclass(frozen=True)
class Block:
    id: str
    lang: str
    text: str
    where: str  # page:line, for messages only


def doc_blocks() -> list[Block]:
    pages = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
    out: list[Block] = []
    seen: dict[str, int] = {}
    for page in pages:
        text = page.read_text()
        rel = page.relative_to(REPO).as_posix()
        for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.S | re.M):
            if m.group(1) not in LANGS:
                continue
            first = m.group(2).strip().splitlines()[0].strip() if m.group(2).strip() else ""
            bid = f"{rel}: {first}"
            seen[bid] = seen.get(bid, 0) + 1
            if seen[bid] > 1:
                bid += f" #{seen[bid]}"
            out.append(Block(bid, m.group(1), m.group(2),
                             f"{rel}:{text[:m.start()].count(chr(10)) + 1}"))
    return out


def by_id(bid: str) -> Block:
    found = [b for b in doc_blocks() if b.id == bid]
    assert len(found) == 1, f"no doc block {bid!r} (the docs changed: update BLOCKS)"
    return found[0]


# -- how each block is checked ------------------------------------------------------------
# (kind, detail): run = executed by a test of this module (detail: which);
# elsewhere = run by the test named in detail; static = not run in CI, detail says why.
NO_CARD = "needs a BlueField (or a host) as root: "
BLOCKS: dict[str, tuple[str, str]] = {
    # docs/benchmarks.md
    "docs/benchmarks.md: # the code before (main) and after, alternated, same machine state:":
        ("static", "a benchmark run (minutes, a quiet machine; tests never run benchmarks); "
                   "its `ctxmem bench pod` flags go through the command's parser"),
    "docs/benchmarks.md: # before (b0daf77) and after, alternated, 7 pairs, each tree's "
    "services and bench:":
        ("static", "a benchmark run (minutes, a quiet machine; tests never run benchmarks); "
                   "its `ctxmem bench pod` flags go through the command's parser"),
    "docs/benchmarks.md: ctxmem bench engine --lengths 512,2048 --rounds 7 --json "
    "docs/bench-engine.json":
        ("static", "four real vLLM servers per prompt length (~10 minutes); "
                   "tests/engines/test_vllm_server.py runs `ctxmem bench engine --quick`; "
                   "the documented flags go through the command's parser"),
    "docs/benchmarks.md: # block authenticators on and off, alternated, on real services "
    "(issue 25 item 1):":
        ("static", "two benchmark runs (about 5 minutes each, a quiet machine); "
                   "tests/tools/test_bench_auth_ab.py runs both with --auth-ab on tiny "
                   "sizes; the documented flags go through the commands' parsers"),
    "docs/benchmarks.md: set -x  # from the repository root":
        ("static", "needs a CUDA GPU (torch.cuda.get_device_name); the `ctxmem bench` "
                   "flags go through the commands' parsers"),
    # docs/deploy.md
    "docs/deploy.md: deploy/image/deps.sh                                  # once: build "
    "tools from Debian":
        ("static", "root and Debian's archive (mmdebstrap); "
                   "tests/deploy/test_image_arm64.py builds the image where it can"),
    "docs/deploy.md: skopeo inspect oci-archive:out/image/ctxmem-0.1.0-arm64.oci.tar":
        ("static", "skopeo, a registry the DPUs reach and containerd on the card"),
    "docs/deploy.md: MLXDEVM=/opt/mellanox/iproute2/sbin/mlxdevm":
        ("static", NO_CARD + "mlxdevm, a scalable function, OVS on the card"),
    "docs/deploy.md: # on the card":
        ("static", NO_CARD + "containerd, kubelet's static pods, /etc; the files it "
                   "installs exist (deploy/configs, deploy/kubelet)"),
    "docs/deploy.md: # 1. the image, to a registry the DPUs can pull from":
        ("static", "a registry, a chart repository and a DPF (Kubernetes) cluster; "
                   "tests/deploy/test_deploy_helm.py renders the chart"),
    "docs/deploy.md: python3 -m venv /opt/ctxmem/venv":
        ("static", NO_CARD + "useradd, /etc, systemd, the SPDK extra"),
    "docs/deploy.md: python3 -m venv /opt/ctxmem/venv #2":
        ("static", "root: useradd, /etc, systemd; its `ctxmem config check` runs for real "
                   "on deploy/configs/fallback.yaml (the file it installs)"),
    "docs/deploy.md: pip install ./ctxmem_kv-0.1.0-cp311-abi3-linux_x86_64.whl"
    "            # or: pip "
    "install /path/to/ctxmem-checkout":
        ("static", "an install from a wheel CI does not build here; the extras named are "
                   "pyproject.toml's (tests/deploy/test_packaging.py builds and installs it)"),
    "docs/deploy.md: PYTHONHASHSEED=0 python -m vllm.entrypoints.openai.api_server --model "
    "MODEL \\":
        ("elsewhere", "vllm"),
    "docs/deploy.md: PYTHONHASHSEED=0 python -m vllm.entrypoints.openai.api_server --model "
    "MODEL \\ #2":
        ("elsewhere", "vllm"),
    "docs/deploy.md: python -m sglang.launch_server --model-path MODEL --page-size 64 \\":
        ("elsewhere", "sglang"),
    "docs/deploy.md: LMCACHE_CONFIG_FILE=lmcache.yaml python -m "
    "vllm.entrypoints.openai.api_server --model MODEL \\":
        ("elsewhere", "vllm"),
    "docs/deploy.md: lmcache server --l1-size-gb 8 --eviction-policy LRU --disable-metrics \\":
        ("elsewhere", "lmcache server"),
    # docs/engines-proof.md
    "docs/engines-proof.md: from ctxmem import kvtransfer as kt":
        ("elsewhere", "engines-proof"),
    # docs/engines.md
    "docs/engines.md: PYTHONHASHSEED=0 python -m vllm.entrypoints.openai.api_server --model "
    "MODEL \\":
        ("elsewhere", "vllm"),
    "docs/engines.md: python -m dynamo.frontend --http-port 8000": ("elsewhere", "dynamo"),
    "docs/engines.md: python -m dynamo.vllm --model MODEL --prefix-caching-hash-algo "
    "sha256_cbor \\": ("elsewhere", "dynamo"),
    "docs/engines.md: python -m dynamo.vllm --model MODEL --prefix-caching-hash-algo "
    "sha256_cbor \\ #2": ("elsewhere", "dynamo"),
    "docs/engines.md: VLLM_NIXL_SIDE_CHANNEL_PORT=20097 \\": ("elsewhere", "dynamo"),
    "docs/engines.md: python -m sglang.launch_server --model-path MODEL --page-size 64 \\":
        ("elsewhere", "sglang"),
    "docs/engines.md: kv = client.open_namespace(kv_layout, model_id=\"m\", "
    "tags={\"pool\": \"kv\"})":
        ("run", "test_python_examples_run"),
    "docs/benchmarks.md: ctxmem bench --rounds 12 --json docs/bench-shm.json --png "
    "docs/benchmarks.png":
        ("static", "the benchmark runs behind docs/benchmarks.md's tables (minutes each, a "
                   "quiet machine); every command's flags go through its parser"),
    "docs/benchmarks.md: ctxmem bench --rounds 12 --json docs/bench-shm.json      # "
    "shared-memory transport":
        ("static", "a benchmark run (minutes); the flags go through the parser"),
    "docs/benchmarks.md: ctxmem bench security --repeat 8 --lookups 100 --json "
    "docs/bench-security.json":
        ("static", "a benchmark run (minutes); the flags go through the parser"),
    "docs/benchmarks.md: ctxmem bench pod --json out/pod.json      # defaults: 64 MiB per "
    "get, 5 repeats, 50 Lookups":
        ("static", "a benchmark run (three nodes, minutes); the flags go through the parser"),
    "docs/benchmarks.md: ctxmem bench ttft --model-config small --json "
    "out/ttft-cpu-small.json --png docs/ttft-cpu-small.png":
        ("static", "a benchmark run (a small model's prefill, minutes); the flags go "
                   "through the parser"),
    "docs/engines-proof.md: ctxmem bench ttft --model-config small --threads 1 --repeats 3 "
    "--json ttft-cpu-small.json --png ttft-cpu-small.png":
        ("static", "a benchmark run (minutes); the flags go through the parser"),
    "docs/engines-proof.md: ctxmem bench ttft --device cuda --model-config 1b --dtype "
    "bfloat16 --json ttft-gpu-1b.json --png ttft-gpu-1b.png":
        ("static", "needs a CUDA GPU; the flags go through the parser"),
    "docs/operations.md: $ curl -s http://127.0.0.1:9464/v1/locate \\":
        ("static", "needs a live session's id and token (Connect) and block hashes; "
                   "tests/adversary/test_locate_http.py drives /v1/locate with real ones"),
    "docs/operations.md: $ ctxmem config check bad.yaml":
        ("run", "test_console_transcript_runs"),
    "docs/reliability.md: ctxmem chaos pod --faults 10000 --flash shared --seed 26 --json "
    "podchaos.json":
        ("static", "a 10,000-fault campaign (minutes); tests/pod/test_pod_chaos.py runs a "
                   "short one; the flags go through the parser"),
    "docs/reliability.md: $ ctxmem bench recovery --blocks 10000,100000,1000000 "
    "--through-service 10000":
        ("static", "a benchmark run (a million blocks); the flags go through the parser"),
    # docs/nvmeof.md, docs/rdma.md
    "docs/nvmeof.md: cat /sys/class/nvme/nvme0/{state,ctrl_loss_tmo,reconnect_delay,"
    "fast_io_fail_tmo}":
        ("static", "a kernel NVMe-oF controller (nvme0): the QEMU guest's "
                   "(tests/vm/test_nvmeof_service.py checks these attributes there)"),
    "docs/nvmeof.md: bash tests/vm/run.sh .venv/bin/pytest -m vm "
    "tests/vm/test_nvmeof_service.py":
        ("static", "the QEMU guest (KVM, a kernel with nvme-tcp); the `vm` marker's CI job"),
    "docs/rdma.md: bash deploy/ci/vm-deps.sh && bash deploy/ci/pyverbs-wheel.sh     # once":
        ("static", "root (apt) and the QEMU guest with soft-RoCE; the `vm` marker's CI job"),
    "docs/rdma.md: modprobe -d /run/kmod loop; modprobe -d /run/kmod ext4":
        ("static", "inside the QEMU guest only (modprobe, losetup, mount as root); its "
                   "`ctxmem bench` flags go through the command's parser"),
    # docs/s3.md
    "docs/s3.md: import os": ("run", "test_openssl_recipes_then_tls_examples"),
    "docs/s3.md: agent.create_backend(\"OBJ\", {\"bucket\": \"kvcache\", \"endpoint_override\": "
    "\"http://DPU:9000\",":
        ("static", "NIXL lives in its side environment (deploy/ci/nixl-site.txt); "
                   "tests/engines/test_s3_clients.py runs nixl_obj_check.py, whose "
                   "create_backend parameters must be these (checked here)"),
    "docs/s3.md: NIXL_TELEMETRY_ENABLE=1 PYTHONHASHSEED=0 python -m "
    "vllm.entrypoints.openai.api_server \\":
        ("static", "vLLM lives in its side environment; tests/engines/test_s3_clients.py "
                   "runs vllm_obj_check.py with the obj tier, whose store_config keys "
                   "must be these (checked here)"),
    "docs/s3.md: lmcache server --l1-size-gb 8 --eviction-policy LRU --disable-metrics \\":
        ("static", "parsed here by LMCache's server parser (its s3 adapter config built); "
                   "tests/engines/test_s3_clients.py runs the adapter against the door"),
    # docs/security.md
    "docs/security.md: umask 077": ("run", "test_openssl_recipes_then_tls_examples"),
    "docs/security.md: NODE=bf3-node0": ("run", "test_openssl_recipes_then_tls_examples"),
    "docs/security.md: TENANT=team-a": ("run", "test_openssl_recipes_then_tls_examples"),
    "docs/security.md: kubectl -n dpf-operator-system create secret generic ctxmem-tls "
    "--type=kubernetes.io/tls \\":
        ("static", "a Kubernetes cluster; the files it names are the recipes' (run here)"),
    "docs/security.md: install -d -m 0700 /etc/ctxmem/tls":
        ("run", "test_openssl_recipes_then_tls_examples"),
    "docs/security.md: import ctxmem": ("run", "test_openssl_recipes_then_tls_examples"),
    # docs/storage.md, README.md
    "docs/storage.md: from ctxmem_common.config import load_config":
        ("run", "test_python_examples_run"),
    "README.md: import ctxmem": ("run", "test_python_examples_run"),
}

# Substitutions for the blocks run here: (text in the block, what replaces it; {name}
# fields filled by the test). Each must match the block (a doc edit that drops the
# placeholder fails, rather than running something else).
SUBSTITUTIONS: dict[str, list[tuple[str, str]]] = {
    "README.md: import ctxmem": [("127.0.0.1:50051", "{endpoint}")],
    "docs/engines.md: kv = client.open_namespace(kv_layout, model_id=\"m\", "
    "tags={\"pool\": \"kv\"})": [],
    "docs/storage.md: from ctxmem_common.config import load_config": [],
    # The card's SANs, plus the loopback address the test's service listens on.
    "docs/security.md: NODE=bf3-node0": [('SANS="IP:192.168.100.2,', 'SANS="IP:127.0.0.1,'
                                          'IP:192.168.100.2,')],
    "docs/security.md: install -d -m 0700 /etc/ctxmem/tls": [("/etc/ctxmem/", "{etc}/")],
    "docs/security.md: import ctxmem": [("192.168.100.2:50051", "{endpoint}"),
                                        ("/etc/ctxmem-client/", "{client}/")],
    "docs/s3.md: import os": [("https://dpu0:9000", "https://127.0.0.1:{s3_port}"),
                                 ("/etc/ctxmem/ca.crt", "{etc}/tls/ca.crt")],
}
# Names a block uses without defining (what a user has in hand at that point).
GIVEN: dict[str, str] = {
    "README.md: import ctxmem": (
        "import numpy as np\n"
        "token_ids = list(range(64))\n"
        "blocks = [np.full(2 << 20, i + 1, np.uint8) for i in range(4)]\n"
        "out = [np.zeros(2 << 20, np.uint8) for _ in range(4)]\n"),
    "docs/engines.md: kv = client.open_namespace(kv_layout, model_id=\"m\", "
    "tags={\"pool\": \"kv\"})": (
        "import numpy as np, ctxmem\n"
        "client = ctxmem.Client({endpoint!r})\n"
        "kv_layout = ctxmem.KVLayout(dtype='bfloat16', num_layers=2, num_kv_heads=2, "
        "head_dim=64, tokens_per_block=16)\n"
        "state_layout = ctxmem.KVLayout(dtype='uint8', num_layers=1, num_kv_heads=1, "
        "head_dim=4096, tokens_per_block=1)\n"
        "keys = ctxmem.chain_hashes(list(range(48)), 16)\n"
        "kv_blocks = [np.full(kv_layout.block_nbytes, i + 1, np.uint8) for i in range(3)]\n"
        "state_blocks = [np.full(state_layout.block_nbytes, i + 7, np.uint8) "
        "for i in range(3)]\n"
        "kv_out = [np.zeros_like(b) for b in kv_blocks]\n"
        "state_out = [np.zeros_like(b) for b in state_blocks]\n"),
    "docs/storage.md: from ctxmem_common.config import load_config": "path = {config!r}\n",
    "docs/s3.md: import os": (
        "data = bytes(range(256)) * 64\n"
        "with open('big.bin', 'wb') as f:\n"
        "    f.write(bytes(range(256)) * (9 * 4096 + 7))\n"),
}
# What must hold once the block has run (the example did what its comments say).
THEN: dict[str, str] = {
    "README.md: import ctxmem": (
        "assert hit.num_hits == 4 and n == 4, (hit.num_hits, n)\n"
        "assert all((o == b).all() for o, b in zip(out, blocks))\n"),
    "docs/engines.md: kv = client.open_namespace(kv_layout, model_id=\"m\", "
    "tags={\"pool\": \"kv\"})": (
        "assert n == 3, n\n"
        "assert all((o == b).all() for o, b in zip(kv_out + state_out, "
        "kv_blocks + state_blocks))\n"
        "client.close()\n"),
    "docs/storage.md: from ctxmem_common.config import load_config": (
        # attach made the file (create: true); leaving the block detached, keeping it.
        "import os\n"
        "assert path.endswith('flash0.img') and os.path.getsize(path) == 64 << 20, path\n"),
    "docs/security.md: import ctxmem": (
        "layout = ctxmem.KVLayout(dtype='uint8', num_layers=1, num_kv_heads=1, "
        "head_dim=4096, tokens_per_block=1)\n"
        "ns = client.open_namespace(layout, model_id='m', tenant='team-a')\n"
        "ns.put([b'k' * 32], [bytes(layout.block_nbytes)])\n"
        "assert ns.lookup([b'k' * 32]).num_hits == 1\n"
        "client.close()\n"),
    "docs/s3.md: import os": (
        "assert part == data[:4096]\n"
        "assert s3.get_object(Bucket='kvcache', Key='big.bin')['Body'].read() == "
        "open('big.bin', 'rb').read()\n"),
}


# -- shell words --------------------------------------------------------------------------
def strip_comments(text: str) -> str:
    """The block without its ``#`` comments (outside quotes, at a word start), as the
    shell reads it; continuation lines joined."""
    out: list[str] = []
    quote = ""
    i = 0
    text = text.replace("\\\n", " ")
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"' and i + 1 < len(text):
                out.append(c)
                i += 1
                c = text[i]
        elif c in "'\"":
            quote = c
        elif c == "\\" and i + 1 < len(text):
            out.append(c)
            i += 1
            c = text[i]
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n("):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


PUNCT = set("();<>|&\n")
SEPARATORS = set("();|&\n")
WRAPPERS = {"nice": 2, "timeout": 1, "sudo": 0, "env": 0, "exec": 0}


def simple_commands(text: str) -> list[list[str]]:
    """The block's simple commands, each as its words (assignments, redirections and
    wrappers such as ``nice -n 5`` and ``timeout 200`` removed)."""
    lex = shlex.shlex(strip_comments(text), posix=True, punctuation_chars="".join(sorted(PUNCT)))
    lex.whitespace = " \t\r"
    lex.whitespace_split = True
    lex.commenters = ""
    words = list(lex)
    cmds: list[list[str]] = [[]]
    skip_next = False
    for w in words:
        if skip_next:
            skip_next = False
            continue
        if set(w) <= PUNCT:  # operators come grouped: ")\n", ");", "<("
            if set(w) & SEPARATORS:
                cmds.append([])
            else:  # a redirection: its target is no argument
                skip_next = True
        elif w.endswith("$"):  # "$(" splits as "...$" "("
            if w[:-1]:
                cmds[-1].append(w[:-1])
        else:
            cmds[-1].append(w)
    out = []
    for cmd in cmds:
        while cmd and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[0]):
            cmd = cmd[1:]
        while cmd and cmd[0] in WRAPPERS:
            n = WRAPPERS[cmd[0]]
            cmd = cmd[1 + (n if cmd[0] != "nice" or cmd[1:2] == ["-n"] else 0):]
        if cmd:
            out.append(cmd)
    return out


def console_commands(text: str) -> str:
    """The commands of a ``console`` transcript: each ``$ `` line with the lines that
    continue it (a trailing backslash, an open quote); everything else is output."""
    cmds: list[str] = []
    cur: str | None = None
    for line in text.splitlines():
        if cur is None:
            if not line.startswith("$ "):
                continue
            cur = line[2:]
        else:
            cur += "\n" + line
        try:
            shlex.split(strip_comments(cur))
            complete = not cur.endswith("\\")
        except ValueError:  # no closing quotation yet
            complete = False
        if complete:
            cmds.append(cur)
            cur = None
    if cur is not None:
        cmds.append(cur)  # unterminated: bash -n says so
    return "\n".join(cmds) + "\n"


def shell_text(block: Block) -> str:
    """What a shell would run of the block (a transcript's commands, not its output)."""
    return console_commands(block.text) if block.lang == "console" else block.text


def ctxmem_commands(text: str) -> list[list[str]]:
    """The arguments of every ``ctxmem`` command in the block (``.venv/bin/ctxmem`` too)."""
    return [cmd[1:] for cmd in simple_commands(text) if Path(cmd[0]).name == "ctxmem"]


# -- ctxmem's own parsers -----------------------------------------------------------------
def bench_modules() -> dict[str, str]:
    """``ctxmem bench NAME`` -> module, read from the dispatcher itself."""
    src = (REPO / "tools" / "ctxmem_tools" / "cli.py").read_text()
    found = dict(re.findall(r'argv\[0\] == "(\w+)":\n\s+from (ctxmem_tools\.bench\.\w+) import',
                            src))
    assert {"engine", "pod", "ttft"} <= set(found), found
    return found


def ctxmem_parser(args: list[str], where: str) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser ``ctxmem ARGS`` parses its options with, and the options."""
    commands = PYPROJECT["project"]["entry-points"]["ctxmem.commands"]
    assert args and args[0] in commands, (
        f"{where}: `ctxmem {' '.join(args[:1])}` is not a ctxmem command "
        f"(pyproject.toml's ctxmem.commands: {sorted(commands)})")
    module = commands[args[0]].split(":")[0]
    rest = args[1:]
    if args[0] == "chaos" and rest[:1] == ["pod"]:  # chaos_command hands it to .pod
        module, rest = "ctxmem_tools.chaos.pod", rest[1:]
    if args[0] == "bench":
        subs = bench_modules()
        if rest and rest[0] in subs:
            module, rest = subs[rest[0]], rest[1:]
        else:
            module = "ctxmem_tools.bench.datapath"
    mod = importlib.import_module(module)
    assert hasattr(mod, "_parser"), (
        f"{where}: {module} has no _parser(): give the command a parser builder (as "
        "ctxmem_tools.bench.pod has) so its documented flags can be checked")
    return mod._parser(), rest


def check_ctxmem_command(args: list[str], where: str) -> None:
    parser, rest = ctxmem_parser(args, where)
    err = io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            parser.parse_args(rest)
    except SystemExit:
        raise AssertionError(f"{where}: `ctxmem {' '.join(args)}` refused by "
                             f"{parser.prog}'s parser: {err.getvalue().strip()}") from None


# -- the other static checks --------------------------------------------------------------
REPO_PATH = re.compile(r"^(?:\./)?((?:deploy|docs|tests|tools|shared|dpu|host)/[\w./-]*)")


def check_paths(block: Block) -> None:
    deploy_names = {p.name for p in (REPO / "deploy").rglob("*") if p.is_file()}
    for cmd in simple_commands(shell_text(block)):
        for word in cmd:
            for token in re.split(r"[=:,]", word):
                m = REPO_PATH.match(token)
                if m:
                    assert (REPO / m.group(1).rstrip(".")).exists(), (
                        f"{block.where} ({block.id}): {m.group(1)} is not in the repo")
                elif cmd[0] in ("install", "cp") and word != cmd[-1] \
                        and re.fullmatch(r"[\w.-]+\.(yaml|service)", token):
                    # a file the block copies onto the target: one the repo ships
                    assert token in deploy_names, (
                        f"{block.where}: {token} is no file under deploy/")
    for name, version in re.findall(r"\b(ctxmem(?:[-_]kv)?)-(\d+\.\d+\.\d+)", block.text):
        assert version == VERSION, (f"{block.where}: {name}-{version}, but pyproject.toml's "
                                    f"version is {VERSION}")


def check_pip(block: Block) -> None:
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    for cmd in simple_commands(shell_text(block)):
        if not (Path(cmd[0]).name in ("pip", "pip3") and cmd[1:2] == ["install"]):
            continue
        for arg in cmd[2:]:
            if arg.startswith("-"):
                continue
            m = re.fullmatch(r"(?:\./)?(ctxmem[_-]kv)(-[\w.-]+\.whl)?(?:\[([\w,]+)\])?", arg)
            assert m or arg == "/path/to/ctxmem-checkout", (
                f"{block.where}: `pip install {arg}`: not ctxmem's wheel; a doc that installs "
                "another package must be classified here (and its pin be the one the "
                "repo's scripts use)")
            # The name `python -m build` gives the wheel (tests/deploy/test_packaging.py):
            # one cp311-abi3 wheel per architecture.
            assert not m or not m.group(2) or re.fullmatch(
                rf"-{re.escape(VERSION)}-cp311-abi3-linux_(x86_64|aarch64)\.whl", m.group(2)), (
                f"{block.where}: `{arg}` is not a wheel the build makes (ctxmem_kv-{VERSION}-"
                "cp311-abi3-linux_<arch>.whl, tests/deploy/test_packaging.py)")
            for extra in (m.group(3) or "").split(",") if m else []:
                assert not extra or extra in extras, (
                    f"{block.where}: extra [{extra}] is not in pyproject.toml ({sorted(extras)})")


def check_lmcache_server(block: Block) -> None:
    """``lmcache server ...`` through LMCache 0.5.6's own parser (its ``server``
    subcommand's arguments) and storage-manager config (the L2 adapters built)."""
    for cmd in simple_commands(shell_text(block)):
        if cmd[:2] != ["lmcache", "server"]:
            continue
        pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by deploy/setup.sh")
        from lmcache.cli.commands.server import ServerCommand
        from lmcache.v1.distributed.config import parse_args_to_config

        parser = argparse.ArgumentParser(prog="lmcache server", exit_on_error=False)
        ServerCommand().add_arguments(parser)
        err = io.StringIO()
        try:
            with redirect_stderr(err):
                ns = parser.parse_args(cmd[2:])
        except (SystemExit, argparse.ArgumentError) as exc:
            raise AssertionError(f"{block.where}: lmcache server refused it: {exc} "
                                 f"{err.getvalue()}") from None
        cfg = parse_args_to_config(ns)
        assert cfg.l2_adapter_config.adapters, f"{block.where}: no L2 adapter built"


def config_checks_for_real(block: Block) -> int:
    """``ctxmem config check FILE`` where the block installs FILE from the repo: run it
    for real on the repo's file."""
    installed: dict[str, str] = {}
    for cmd in simple_commands(shell_text(block)):
        if cmd[0] == "install" and len(cmd) >= 3 and REPO_PATH.match(cmd[-2]):
            installed[cmd[-1]] = cmd[-2]
    ran = 0
    for args in ctxmem_commands(shell_text(block)):
        if args[:2] == ["config", "check"] and args[2] in installed:
            out = subprocess.run([PY, "-m", "ctxmem_common.cli", "config", "check",
                                  str(REPO / installed[args[2]]), *args[3:]],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, (f"{block.where}: ctxmem config check "
                                         f"{installed[args[2]]}: {out.stderr[-2000:]}")
            ran += 1
    return ran


# -- the tests ----------------------------------------------------------------------------
def test_every_block_is_classified() -> None:
    """Every copy-paste block has an entry, every entry a block, and every block that is
    not run says why."""
    blocks = doc_blocks()
    ids = [b.id for b in blocks]
    unknown = [f"{b.where}: {b.id!r}" for b in blocks if b.id not in BLOCKS]
    assert not unknown, ("doc blocks nobody checks: add each to BLOCKS in "
                         f"tests/deploy/test_doc_shell_blocks.py (and check it): {unknown}")
    stale = sorted(set(BLOCKS) - set(ids))
    assert not stale, f"BLOCKS entries with no doc block (renamed or gone?): {stale}"
    for bid, (kind, detail) in BLOCKS.items():
        assert kind in ("run", "elsewhere", "static") and detail, bid
        if kind == "run":
            assert detail in globals(), f"{bid}: no test {detail}"
    for table in (SUBSTITUTIONS, GIVEN, THEN):
        assert set(table) <= {b for b, (k, _) in BLOCKS.items() if k == "run"}, table.keys()
    assert len(blocks) >= 40, len(blocks)


def test_shell_blocks_static() -> None:
    """Every shell block: ``bash -n``, its ``ctxmem`` commands through their parsers, repo
    paths and versions, pip installs, ``lmcache server`` through LMCache's parser;
    ``ctxmem config check`` on an installed repo file run for real."""
    shell = [b for b in doc_blocks() if b.lang != "python"]
    assert len(shell) >= 30, len(shell)
    commands = ran = 0
    for block in shell:
        text = shell_text(block)
        out = subprocess.run(["bash", "-n"], input=text, capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, f"{block.where} ({block.id}): bash -n: {out.stderr}"
        for args in ctxmem_commands(text):
            check_ctxmem_command(args, f"{block.where} ({block.id})")
            commands += 1
        check_paths(block)
        check_pip(block)
        ran += config_checks_for_real(block)
    assert commands >= 9 and ran >= 1, (commands, ran)


def test_lmcache_server_blocks_parse() -> None:
    """Every ``lmcache server`` command (docs/deploy.md's ctxmem adapter, docs/s3.md's
    ``s3`` adapter) through LMCache's own server parser and storage-manager config."""
    blocks = [b for b in doc_blocks() if b.lang != "python"
              and any(c[:2] == ["lmcache", "server"] for c in simple_commands(shell_text(b)))]
    assert len(blocks) >= 2, [b.id for b in blocks]
    for block in blocks:
        check_lmcache_server(block)


def test_python_blocks_compile() -> None:
    for block in doc_blocks():
        if block.lang == "python":
            try:
                compile(block.text, block.where, "exec")
            except SyntaxError as exc:
                raise AssertionError(f"{block.where} ({block.id}): {exc}") from None


def test_elsewhere_blocks_are_picked_up() -> None:
    """The other tests' selections of doc blocks include each block said to be theirs."""
    from tests.engines import dynamo_check, vllm_flags_check

    vllm = {" ".join(w) for _, w in vllm_flags_check.vllm_commands()}
    dynamo = {" ".join(w) for _, w in dynamo_check.dynamo_commands()}

    def words(b: Block) -> str:
        return " ".join(shlex.split(b.text.replace("\\\n", " "), comments=True))

    for bid, (kind, detail) in BLOCKS.items():
        if kind != "elsewhere":
            continue
        b = by_id(bid)
        page = b.where.split(":")[0]
        if detail == "vllm":  # tests/engines/test_vllm_real.py runs vllm_flags_check.py
            assert words(b) in vllm, f"{b.where}: vllm_flags_check.py does not see it"
        elif detail == "dynamo":  # tests/engines/test_doc_blocks.py::test_doc_dynamo_blocks
            assert words(b) in dynamo, f"{b.where}: dynamo_check.py does not see it"
        elif detail == "sglang":  # test_sglang_backend.py::test_documented_sglang_commands
            assert page in ("docs/deploy.md", "docs/engines.md") and "sglang" in b.text
        elif detail == "lmcache server":  # test_lmcache_mp_server.py runs the command
            assert page == "docs/deploy.md" and b.text.lstrip().startswith("lmcache server")
        elif detail == "engines-proof":  # test_doc_blocks.py::test_engines_proof_api_...
            assert page == "docs/engines-proof.md"
        else:
            raise AssertionError(f"{bid}: unknown checker {detail!r}")


def test_s3_engine_blocks_match_the_checked_clients() -> None:
    """docs/s3.md's NIXL and vLLM blocks name the parameters test_s3_clients.py's
    scripts pass (NIXL's create_backend, vLLM's obj tier store_config)."""
    nixl = by_id("docs/s3.md: agent.create_backend(\"OBJ\", {\"bucket\": \"kvcache\", "
                 "\"endpoint_override\": \"http://DPU:9000\",")
    params = re.search(r"\{.*\}", nixl.text, re.S)
    assert params
    named = set(re.findall(r'"(\w+)":', params.group(0)))
    src = (REPO / "tests" / "engines" / "nixl_obj_check.py").read_text()
    missing = sorted(k for k in named if f'"{k}"' not in src)
    assert not missing, f"{nixl.where}: nixl_obj_check.py passes no {missing}"
    vllm = by_id("docs/s3.md: NIXL_TELEMETRY_ENABLE=1 PYTHONHASHSEED=0 python -m "
                 "vllm.entrypoints.openai.api_server \\")
    words = shlex.split(vllm.text.replace("\\\n", " "))
    ktc = json.loads(words[words.index("--kv-transfer-config") + 1])
    tier = ktc["kv_connector_extra_config"]["secondary_tiers"][0]
    src = (REPO / "tests" / "engines" / "vllm_obj_check.py").read_text()
    missing = sorted(k for k in [*tier, *tier["store_config"]] if f'"{k}"' not in src)
    assert not missing, f"{vllm.where}: vllm_obj_check.py sets no {missing}"
    # The bucket names docs/s3.md's clients use are ones the endpoint accepts.
    from ctxmem_dpu.s3.ops import check_names

    text = (REPO / "docs" / "s3.md").read_text()
    buckets = set(re.findall(r"""(?:Bucket=|"bucket": ?|s3://)["']?([\w.-]+)""", text))
    buckets |= set(re.findall(r'"s3_endpoint":"([\w-]+)\.s3\.', text))
    buckets |= set(re.findall(r'upload_file\("[^"]+", "([^"]+)"', text))
    assert len(buckets) >= 1, buckets
    for bucket in sorted(buckets):
        check_names(bucket, "key")


def prepared(bid: str, **fields: Any) -> str:
    """The block as run: substitutions applied (each must match), GIVEN before, THEN
    after."""
    text = by_id(bid).text
    for old, new in SUBSTITUTIONS.get(bid, []):
        assert old in text, f"{bid}: the placeholder {old!r} is gone (update SUBSTITUTIONS)"
        text = text.replace(old, new.format(**fields))
    return GIVEN.get(bid, "").format(**fields) + text + THEN.get(bid, "")


def run_python(bid: str, cwd: Path, env: dict[str, str] | None = None, **fields: Any) -> None:
    script = cwd / f"block-{hashlib.sha1(bid.encode()).hexdigest()[:8]}.py"
    script.write_text(prepared(bid, **fields))
    out = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=cwd, env={**os.environ, **(env or {})})
    assert out.returncode == 0, f"{bid} failed as run:\n{script.read_text()}\n{out.stderr[-4000:]}"


def run_shell(bid: str, cwd: Path, **fields: Any) -> None:
    out = subprocess.run(["bash", "-e", "-c", prepared(bid, **fields)], capture_output=True,
                         text=True, timeout=60, cwd=cwd)
    assert out.returncode == 0, f"{bid} failed as run: {out.stdout[-2000:]}{out.stderr[-2000:]}"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Any]:
    from ctxmem_tools.launcher import ServiceProcess, local_config

    with ServiceProcess(tmp_path / "svc", local_config(tmp_path / "svc")) as svc:
        yield svc


def test_python_examples_run(service: Any, tmp_path: Path) -> None:
    """README's quick start and docs/engines.md's group example against a real service;
    docs/storage.md's backend example on a config with a local flash file."""
    import yaml

    from ctxmem_tools.launcher import local_config

    run_python("README.md: import ctxmem", tmp_path, endpoint=service.endpoint)
    run_python("docs/engines.md: kv = client.open_namespace(kv_layout, model_id=\"m\", "
               "tags={\"pool\": \"kv\"})", tmp_path, endpoint=service.endpoint)
    cfg = local_config(tmp_path / "st", flash_size="64MiB")
    config = tmp_path / "st" / "ctxmem.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_python("docs/storage.md: from ctxmem_common.config import load_config", tmp_path,
               config=str(config))


def test_console_transcript_runs(tmp_path: Path) -> None:
    """docs/operations.md's ``ctxmem config check bad.yaml`` transcript, run: a config
    whose first device has an unknown ``kernel:`` key; the command exits 2 and prints the
    transcript's line."""
    block = by_id("docs/operations.md: $ ctxmem config check bad.yaml")
    (tmp_path / "bad.yaml").write_text(
        "flash:\n  devices:\n  - {name: f0, backend: local, path: f0.img, size: 64MiB, "
        "kernel: {bogus: 1}}\n")
    [args] = ctxmem_commands(shell_text(block))
    out = subprocess.run([PY, "-m", "ctxmem_common.cli", *args], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    shown = [ln for ln in block.text.splitlines() if not ln.startswith("$ ")]
    assert out.returncode == 2 and out.stdout.splitlines() + out.stderr.splitlines() == shown, (
        f"{block.where}: the transcript shows {shown}, the command printed "
        f"{out.stdout!r} {out.stderr!r} (exit {out.returncode})")


def test_openssl_recipes_then_tls_examples(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/security.md's openssl recipes run as written (the card's SANs plus 127.0.0.1),
    its install step into a temp /etc; a service with mutual TLS starts on those files and
    the shim's TLS example (the tenant certificate the recipe made) stores and finds a
    block as tenant team-a; a service with server TLS and the S3 endpoint serves
    docs/s3.md's boto3 example (https, the recipe's CA) byte-exact, multipart included."""
    from ctxmem_tools.launcher import ServiceProcess, free_port, local_config

    pki = tmp_path / "pki"
    pki.mkdir()
    etc = tmp_path / "etc" / "ctxmem"
    for bid in ("docs/security.md: umask 077", "docs/security.md: NODE=bf3-node0",
                "docs/security.md: TENANT=team-a",
                "docs/security.md: install -d -m 0700 /etc/ctxmem/tls"):
        run_shell(bid, pki, etc=str(etc))
    tls = etc / "tls"
    assert sorted(p.name for p in tls.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert (tls.stat().st_mode & 0o777) == 0o700
    mutual = {"cert_file": str(tls / "tls.crt"), "key_file": str(tls / "tls.key"),
              "client_ca_file": str(tls / "ca.crt")}
    client = tmp_path / "client"
    client.mkdir(mode=0o700)
    for name in ("ca.crt", "team-a.crt", "team-a.key"):
        (client / name).write_bytes((pki / name).read_bytes())
        (client / name).chmod(0o600)
    work = tmp_path / "mtls"
    with ServiceProcess(work, local_config(work, flash_size=None, transports=["tcp"],
                                           tls=mutual)) as svc:
        run_python("docs/security.md: import ctxmem", tmp_path, endpoint=svc.endpoint,
                   client=str(client))
    pytest.importorskip("boto3")
    port = free_port()
    work = tmp_path / "s3"
    secret = "a-secret-for-the-doc-block-test-0123"
    s3 = {"listen": f"127.0.0.1:{port}", "chunk_size": "1MiB",
          "access_keys": {"AKIAEXAMPLEKEY01": {"tenant": "alice",
                                               "secret_env": "CTXMEM_S3_ALICE"}}}
    monkeypatch.setenv("CTXMEM_S3_ALICE", secret)  # the service's and the example's
    with ServiceProcess(work, local_config(work, flash_size=None, transports=["tcp"], s3=s3,
                                           tls={k: v for k, v in mutual.items()
                                                if k != "client_ca_file"})):
        run_python("docs/s3.md: import os", tmp_path, s3_port=port, etc=str(etc))


COMMAND_WORDS = re.compile(r"^(\$ |"
                           r"ctxmem (serve|demo|bench|check|chaos|fuzz|config|status)\b(?!:| \w+:)|"
                           r"python3? |pip3? |curl |bash |sudo |kubectl |openssl |"
                           r"helm |install |\.venv/|[A-Z_]+=\S* )")


def test_no_untagged_command_blocks() -> None:
    """A fenced block with commands in it names its language (``sh`` for commands,
    ``console`` for a ``$``-prompted transcript, ``text`` for a synopsis), so the tests
    above see it; an untagged block is a diagram or output."""
    bad = []
    for page in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        text = page.read_text()
        opened: int | None = None
        body: list[str] = []
        for n, line in enumerate(text.splitlines(), 1):
            if opened is None and line.startswith("```"):
                opened, body = (n if line == "```" else 0), []
            elif opened is not None and line == "```":
                hits = [ln for ln in body if COMMAND_WORDS.match(ln)]
                if opened and hits:
                    bad.append(f"{page.relative_to(REPO)}:{opened}: {hits[0][:60]!r}")
                opened = None
            elif opened is not None:
                body.append(line)
    assert not bad, ("untagged fenced blocks with commands (tag them ```sh, ```console or, "
                     f"for a synopsis, ```text): {bad}")
