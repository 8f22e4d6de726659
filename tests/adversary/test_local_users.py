"""Issue 25, item 5: the embedded default tells local users apart.

The embedded default trusts the tenant name a client sends (``service.insecure: true``,
loopback only). Found from outside: uid ``nobody`` connected as another user's tenant,
recomputed a known prompt's keys, read its blocks, deleted them and put its own, which the
victim then got. Now the service asks the kernel which user made each loopback
connection (``ctxmem_dpu.control.localpeer``, sock_diag) and, with
``service.local_users: separate`` (the default), scopes another user's names to that user
(``NAME@uidN``).

Each test runs a real service (as root, the service's user) and a real client process that
drops to uid 65534 (``tests/adversary/as_user.py``) after its imports. Dropping to
another uid needs root: elsewhere these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ctxmem
from ctxmem_common.config import config_from_dict
from ctxmem_common.errors import ConfigError, PermissionDenied
from ctxmem_common.identity import check_identity_mode
from tests.adversary.as_user import LAYOUT, blocks, keys
from tests.conftest import ServiceHandle

NOBODY = 65534
AS_USER = Path(__file__).with_name("as_user.py")
SMALL = {"encryption": False, "transports": ["tcp"], "dram_size": "32MiB",
         "dram_slab": "4MiB", "flash_size": "64MiB", "flash_slab": "4MiB"}

needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="telling local users apart is tested with a client that drops to uid 65534, "
           "which needs root; run the suite as root (CI does)")


def _env() -> dict[str, str]:
    """This environment, with the checkout's root on the path (``tests.`` imports)."""
    root = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}


def as_nobody(endpoint: str, tenant: str, *ops: list[Any]) -> list[Any]:
    """``ops`` run by a client process of uid 65534; their results."""
    out = subprocess.run([sys.executable, str(AS_USER), str(NOBODY), endpoint, tenant,
                          json.dumps(list(ops))], capture_output=True, text=True,
                         timeout=120, env=_env(), cwd="/")
    assert out.returncode == 0, f"as_user.py failed:\n{out.stdout}\n{out.stderr}"
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def owner_blocks(ns: ctxmem.Namespace, n: int, seed: int) -> int:
    """Leading blocks of ``keys(0, n)`` that come back equal to ``blocks(n, seed)``."""
    want = blocks(n, seed)
    out = [np.zeros_like(b) for b in want]
    got = ns.get(keys(0, n), out)
    return sum(int(np.array_equal(out[i], want[i])) for i in range(got))


@needs_root
def test_another_local_user_cannot_read_delete_or_replace_a_tenants_blocks(
        service_factory: Callable[..., ServiceHandle]) -> None:
    """The attack of the issue, replayed by uid 65534 against the service user's tenant
    ``alice``: it acts as ``alice@uid65534`` instead, finds none of alice's blocks, its
    delete removes none, its put under the same keys lands in its own tenant, and alice
    still gets her own bytes; its Stats list only its own tenants."""
    svc = service_factory(**SMALL)
    assert config_from_dict({}).service.local_users == "separate"  # the default
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:
        alice = c.open_namespace(LAYOUT, model_id="m", tenant="alice")
        alice.put(keys(0, 8), blocks(8, 1))
        assert alice.acting_tenant == "alice"
        res = as_nobody(svc.endpoint, "alice", ["tenant"], ["lookup", 0, 8], ["get", 0, 8, 1],
                        ["delete", 0, 8], ["put", 0, 8, 666], ["get", 0, 8, 666], ["stats"],
                        ["revision", "r1"])
        assert res[0] == f"alice@uid{NOBODY}", res
        assert res[1] == 0, f"another user found {res[1]} of alice's 8 blocks"
        assert res[2] == [0, 0], f"another user read alice's blocks: {res[2]}"
        assert res[3] == 0, f"another user deleted {res[3]} of alice's blocks"
        assert res[4] == 8 and res[5] == [8, 8], res  # its own tenant works as usual
        assert res[6] == [f"tenant.alice@uid{NOBODY}"], res[6]
        assert res[7] == 0, res[7]  # a weights revision's digest check passes when scoped
        assert owner_blocks(alice, 8, 1) == 8, "alice no longer gets her own bytes"
        # The service's user (the operator) sees every tenant.
        names = {k.rpartition(".")[0] for k in c.stats() if k.startswith("tenant.")}
        assert {"tenant.alice", f"tenant.alice@uid{NOBODY}"} <= names, names


@needs_root
def test_a_scoped_name_cannot_be_claimed(service_factory: Callable[..., ServiceHandle]
                                         ) -> None:
    """``NAME@uidN`` is reserved: neither the service's user nor another may claim a
    name of user N's by sending it."""
    svc = service_factory(**SMALL)
    res = as_nobody(svc.endpoint, f"bob@uid{NOBODY}", ["lookup", 0, 1])
    assert res[0]["error"] == "PermissionDenied" and "reserved" in res[0]["message"], res
    with ctxmem.Client(svc.endpoint, transport="tcp") as c, \
            pytest.raises(PermissionDenied, match="reserved"):
        c.open_namespace(LAYOUT, model_id="m", tenant=f"bob@uid{NOBODY}").lookup(keys(0, 1))


@needs_root
def test_owner_policy_refuses_other_users(service_factory: Callable[..., ServiceHandle]
                                          ) -> None:
    svc = service_factory(**SMALL, service={"local_users": "owner"})
    res = as_nobody(svc.endpoint, "alice", ["lookup", 0, 1])
    assert res[0]["error"] == "PermissionDenied", res
    assert f"uid {NOBODY} refused" in res[0]["message"], res
    assert "local_users: owner" in res[0]["message"], res
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:  # the service's user is served
        assert c.open_namespace(LAYOUT, model_id="m", tenant="alice").lookup(
            keys(0, 1)).num_hits == 0


@needs_root
def test_shared_policy_is_one_trust_domain(service_factory: Callable[..., ServiceHandle]
                                           ) -> None:
    """``local_users: shared`` keeps the old rule, for a single-user machine: any local
    user acts as any tenant (what the docs warn about)."""
    svc = service_factory(**SMALL, service={"local_users": "shared"})
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:
        c.open_namespace(LAYOUT, model_id="m", tenant="alice").put(keys(0, 4), blocks(4, 1))
        assert as_nobody(svc.endpoint, "alice", ["tenant"], ["get", 0, 4, 1]) == [
            "alice", [4, 4]]


@needs_root
def test_tenant_name_cap_counts_per_local_user(service_factory: Callable[..., ServiceHandle]
                                               ) -> None:
    """Another user filling ``service.insecure_max_tenants`` with names of its own does
    not keep the service's user from opening a new name (the cap is per user)."""
    svc = service_factory(**SMALL, service={"insecure_max_tenants": 2})
    with ctxmem.Client(svc.endpoint, transport="tcp") as c:
        ns = c.open_namespace(LAYOUT, model_id="m", tenant="a0")
        ns.lookup(keys(0, 1))
        # A process of uid 65534 holding sessions under two names, then a third refused.
        other = subprocess.Popen(
            [sys.executable, str(AS_USER), str(NOBODY), svc.endpoint, "n0",
             json.dumps([["touch", "n0"], ["touch", "n1"], ["touch", "n2"], ["pause"]])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(), cwd="/")
        try:
            assert other.stdout is not None
            res = json.loads(other.stdout.readline())
            assert res[:2] == ["ok", "ok"], res
            assert res[2]["error"] == "ResourceExhausted", res
            assert f"local user uid{NOBODY}" in res[2]["message"], res
            # Its two names hold sessions now; the service's user opens a second name.
            c.open_namespace(LAYOUT, model_id="m", tenant="a1").lookup(keys(0, 1))
        finally:
            other.communicate("", timeout=60)


def test_abstract_unix_listen_is_refused_unless_users_are_shared(tmp_path: Path) -> None:
    """An abstract Unix socket has no file mode, so the service could not tell who calls."""
    cfg = config_from_dict({"service": {"insecure": True, "listen": "unix-abstract:ctxm",
                                        "transports": ["shm"]}})
    with pytest.raises(ConfigError, match=r"abstract Unix socket.*local_users: shared"):
        check_identity_mode(cfg)
    cfg = config_from_dict({"service": {"insecure": True, "listen": "unix-abstract:ctxm",
                                        "transports": ["shm"], "local_users": "shared"}})
    assert check_identity_mode(cfg) == "insecure"


def test_bad_local_users_value_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match="local_users"):
        config_from_dict({"service": {"insecure": True, "local_users": "everyone"}})


@needs_root
def test_unix_socket_listen_admits_only_the_service_user(
        service_factory: Callable[..., ServiceHandle], tmp_path: Path) -> None:
    """A ``unix:`` gRPC listen's file is mode 0600 from its bind: another user cannot
    connect at all; the service's user is served under its plain names."""
    sock = tmp_path / "grpc.sock"
    svc = service_factory(**SMALL, service={"listen": f"unix:{sock}"})
    assert (sock.stat().st_mode & 0o777) == 0o600
    with ctxmem.Client(f"unix:{sock}", transport="tcp") as c:
        ns = c.open_namespace(LAYOUT, model_id="m", tenant="alice")
        ns.put(keys(0, 2), blocks(2, 3))
        assert ns.acting_tenant == "alice"
    del svc
