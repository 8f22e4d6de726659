"""Every JSON-RPC request the spdk backend can send, validated against SPDK's schema.

How: each scenario in storage_spdk_scenarios drives the real backend, through the real
`spdk.rpc.client.JSONRPCClient`, against the fake SPDK server (NOT SPDK), which records
the requests exactly as they crossed the socket. Each recorded request is checked
against SPDK's own schema.yaml (read at test time from ../shared/vendor/spdk/ relative
to the repository root): the method exists, every param name is known, every required
param is present, types and enum values match, and no deprecated param is used.
A coverage test proves the scenarios send every method spdk_requests can build.

This proves the requests are well-formed for SPDK 26.09-pre's schema. It does not
prove SPDK accepts them at run time: that needs a real target (test_storage_spdk_real).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from pathlib import Path

import pytest
from storage_fake_spdk import FakeSpdk, Recorded, serve_fake_spdk
from storage_spdk_scenarios import SCENARIOS, write_secrets
from storage_spdk_schema import SCHEMA_PATH, SpdkSchema

from ctxmem_dpu.storage import spdk, spdk_requests, spdk_rpc
from ctxmem_dpu.storage.spdk_requests import SENDABLE_METHODS


@pytest.fixture(scope="module")
def schema() -> SpdkSchema:
    if not SCHEMA_PATH.is_file():
        pytest.skip(f"SPDK schema not found at {SCHEMA_PATH} (it lives outside the repo, in "
                    "../shared/vendor/spdk/schema.yaml; it is not copied into the repo)")
    return SpdkSchema(SCHEMA_PATH)


def run_scenario(scenario: Callable[[FakeSpdk, Path], None], tmp_path: Path) -> list[Recorded]:
    with serve_fake_spdk(tmp_path / "dev") as fake:
        scenario(fake, write_secrets(tmp_path / "secrets"))
        return list(fake.requests)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_requests_match_spdk_schema(name: str, schema: SpdkSchema,
                                             tmp_path: Path) -> None:
    requests = run_scenario(SCENARIOS[name], tmp_path)
    assert requests, "scenario sent nothing"
    problems = [p for r in requests for p in schema.problems(r.method, r.params)]
    assert not problems, "\n".join(problems)


def test_scenarios_cover_every_sendable_method(tmp_path: Path) -> None:
    seen: set[str] = set()
    for i, scenario in enumerate(SCENARIOS.values()):
        seen |= {r.method for r in run_scenario(scenario, tmp_path / str(i))}
    assert seen == SENDABLE_METHODS, (
        f"never sent: {sorted(SENDABLE_METHODS - seen)}; "
        f"sent but not declared: {sorted(seen - SENDABLE_METHODS)}")


def test_every_sendable_method_exists_in_schema(schema: SpdkSchema) -> None:
    assert sorted(m for m in SENDABLE_METHODS if m not in schema.methods) == []


def _literal_method_calls(module: object) -> set[str]:
    """String literals passed first to RpcRequest(...) or to any `.call(...)`/`.send(...)`
    in `module`'s source: the ways a method name could be spelt outside one place."""
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        is_request = isinstance(func, ast.Name) and func.id == "RpcRequest"
        is_call = isinstance(func, ast.Attribute) and func.attr in ("call", "send")
        first = node.args[0]
        if (is_request or is_call) and isinstance(first, ast.Constant):
            names.add(str(first.value))
    return names


def test_requests_are_built_only_in_spdk_requests() -> None:
    assert _literal_method_calls(spdk_requests) == SENDABLE_METHODS
    for module in (spdk, spdk_rpc):
        assert _literal_method_calls(module) == set(), f"{module.__name__} spells a method"


# -- the validator itself catches what it claims to ------------------------------------

@pytest.mark.parametrize(("method", "params", "problem"), [
    ("bdev_nvme_attach_controllers", {}, "no such method"),
    ("bdev_nvme_attach_controller", {"name": "N", "trtype": "tcp", "traddr": "a", "tls": True},
     "tls: unknown parameter"),
    ("bdev_nvme_attach_controller", {"name": "N", "trtype": "tcp"}, "traddr: required"),
    ("bdev_nvme_attach_controller", {"name": "N", "trtype": "tcp", "traddr": "a",
                                     "trsvcid": 4420}, "trsvcid: expected string"),
    ("bdev_nvme_attach_controller", {"name": "N", "trtype": "tcp", "traddr": "a",
                                     "ctrlr_loss_timeout_sec": True}, "expected int32"),
    ("ublk_start_disk", {"bdev_name": "b", "ublk_id": -1}, "expected uint32"),
    ("accel_crypto_key_create", {"cipher": "AES_GCM", "key": "k", "name": "n"},
     "not in enum accel_crypto_cipher"),
    ("nvmf_subsystem_add_listener", {"nqn": "q", "listen_address": {"trtype": "tcp"}},
     "listen_address.traddr: required"),
    ("nvmf_subsystem_add_ns", {"nqn": "q", "namespace": {"bdev_name": "b", "bdev": "x"}},
     "namespace.bdev: unknown parameter"),
    ("nvmf_create_transport", {"trtype": "tcp", "io_unit_size": 8192}, "deprecated"),
])
def test_validator_catches(schema: SpdkSchema, method: str, params: dict[str, object],
                           problem: str) -> None:
    assert any(problem in p for p in schema.problems(method, params)), schema.problems(
        method, params)
