"""The environment variables ctxmem reads, and why each is not a config key.

The service is configured through one schema (:mod:`ctxmem_common.config`), tuning knobs
included. An environment variable remains only where this table says why: a secret the
schema names (``encryption.key_env``, ``pod.pod_token_env``, ``pod.index_password_env``:
the key holds the variable's name), a setting of the client library (an engine's process
has no ctxmem config file), a value every process on a device must share (the service,
``ctxmem check`` and the storage tools alike), a codec chosen at import before any config
is read, or a test and benchmark hook. ``docs/config.md`` renders this table
(:func:`ctxmem_common.config.reference_markdown`), and ``tests/shared/test_config_env.py``
fails when the code of ``dpu/``, ``host/`` or ``shared/`` (or the benchmark harness that
runs inside a service, ``tools/ctxmem_tools/bench/authoff/``) names a ``CTXMEM_*``
variable, or reads any other by name, that is not listed here.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ENVIRONMENT", "EnvVar", "env_rows"]


class EnvVar(NamedTuple):
    """One environment variable: who reads it, and why it is not a config key."""

    name: str
    read_by: str
    why: str


_SECRET = "a secret, kept out of the config file; the schema key names the variable"
_CLIENT = "a client-library setting: an engine's process has no ctxmem config file"
_HOOK = "a test or benchmark hook, never set in production"

ENVIRONMENT: tuple[EnvVar, ...] = (
    EnvVar("CTXMEM_MASTER_KEY", "service, `ctxmem check`",
           f"`encryption.key_env`'s default: the master key, 64 hex characters; {_SECRET}"),
    EnvVar("CTXMEM_POD_TOKEN", "service (pod)", f"`pod.pod_token_env`'s default; {_SECRET}"),
    EnvVar("CTXMEM_POD_INDEX_PASSWORD", "service (pod)",
           f"`pod.index_password_env`'s default; {_SECRET}"),
    EnvVar("CTXMEM_FLASH_OWNER_LEASE_S", "service, `ctxmem check`, storage tools",
           "how long a device's owner record is honoured without a refresh (default 30 s; "
           "docs/reliability.md): every process that opens a device must agree on it, and "
           "`ctxmem check` and the storage tools run without the service's config"),
    EnvVar("CTXMEM_CRC32C_IMPL", "client and service",
           "forces the CRC32C implementation (`hardware`, `table`, ...), chosen at import "
           "before any config is read"),
    EnvVar("CTXMEM_XTS_IMPL", "client and service",
           "forces the AES-XTS implementation (`openssl`, `cryptography`), chosen at import "
           "before any config is read"),
    EnvVar("CTXMEM_PROGRESS", "the `ctxmem` command line",
           "progress bars: `0` off, `1` on (default: on a terminal)"),
    EnvVar("CTXMEM_ENDPOINT", "client (engine integrations)",
           f"the service endpoint when the engine's config names none; {_CLIENT}"),
    EnvVar("CTXMEM_TLS_CA_FILE", "client (engine integrations)",
           f"TLS CA bundle when the engine's config names none; {_CLIENT}"),
    EnvVar("CTXMEM_TLS_CERT_FILE", "client (engine integrations)",
           f"client certificate (mutual TLS); {_CLIENT}"),
    EnvVar("CTXMEM_TLS_KEY_FILE", "client (engine integrations)",
           f"its private key; {_CLIENT}"),
    EnvVar("CTXMEM_TLS_SERVER_NAME", "client (engine integrations)",
           f"the name the service's certificate is checked against; {_CLIENT}"),
    EnvVar("CTXMEM_FAST_OPS", "client",
           f"`0` keeps every control call on gRPC (A/B runs, an escape hatch); {_CLIENT}"),
    EnvVar("CTXMEM_SHM_OPS", "client", "`CTXMEM_FAST_OPS`'s older name"),
    EnvVar("CTXMEM_RDMA_DEVICE", "client (RDMA)",
           f"the verbs device of this host (default: by route); {_CLIENT}"),
    EnvVar("CTXMEM_RDMA_GID_INDEX", "client (RDMA)",
           f"the GID index on it (default: the RoCE v2 one); {_CLIENT}"),
    EnvVar("CTXMEM_RDMA_REG_MIN_KB", "client (RDMA)",
           f"smallest buffer registered in place rather than copied (default 256); {_CLIENT}"),
    EnvVar("CTXMEM_RDMA_REG_CACHE_MB", "client (RDMA)",
           f"registrations kept cached (default 1024); {_CLIENT}"),
    EnvVar("CTXMEM_RDMA_BOUNCE_MB", "client (RDMA)", f"bounce buffer size (default 8); {_CLIENT}"),
    EnvVar("CTXMEM_RDMA_SIGNAL_EVERY", "client (RDMA)",
           f"work requests per signalled completion (default 16); {_CLIENT}"),
    EnvVar("CTXMEM_FAULTS", "service", f"fault points armed at start (docs/reliability.md); "
                                       f"{_HOOK}"),
    EnvVar("CTXMEM_FAULT_CTL", "service", f"the fault-injection control file; {_HOOK}"),
    EnvVar("CTXMEM_FAULT_JOURNAL", "service", f"journal fault acknowledgements; {_HOOK}"),
    EnvVar("CTXMEM_TEST_CLOCK_SHIFT_S", "service",
           f"shifts the wall clock written into owner records; {_HOOK}"),
    EnvVar("CTXMEM_BENCH_NO_SESSION_AUTH", "service",
           f"`1`: the security benchmark's baseline without session checks (insecure mode "
           f"only); {_HOOK}"),
    EnvVar("CTXMEM_BENCH_AUTH_OFF", "a service started by `ctxmem bench --auth-ab` or "
           "`ctxmem bench pod --auth-ab` (the harness's `sitecustomize.py` in "
           "`tools/ctxmem_tools/bench/authoff/`, which those benches alone put on the "
           "service's `PYTHONPATH`; the service's own code never reads it)",
           f"`1`: block authenticators off (a constant tag, every check passes) and a "
           f"WARNING in the service's log, to measure what they cost; a service started "
           f"any other way ignores it; {_HOOK}"),
    # Not ctxmem's own: the platform's, read where they mean what they always mean.
    EnvVar("XDG_RUNTIME_DIR", "service, `ctxmem serve --print-default-config`",
           "where the embedded default config puts the shm socket for a user other than "
           "root (see the top of this page)"),
    EnvVar("XDG_STATE_HOME", "service, `ctxmem serve --print-default-config`",
           "where the embedded default config puts the flash file and master key for a "
           "user other than root"),
    EnvVar("HOME", "service", "`~/.local/state` when `XDG_STATE_HOME` is unset"),
    EnvVar("NOTIFY_SOCKET", "service", "systemd's readiness socket (`READY=1`, "
                                       "`STOPPING=1`), set by systemd for a `Type=notify` unit"),
    EnvVar("CI", "the `ctxmem` command line", "set: no progress bars"),
    EnvVar("GRPC_ENABLE_FORK_SUPPORT", "client",
           "set to `true` by `import ctxmem` unless the process set it: blocking gRPC "
           "survives `fork()` only so, chosen before gRPC is imported"),
    EnvVar("GRPC_POLL_STRATEGY", "client",
           "set to `poll` by `import ctxmem` unless the process set it (with fork support)"),
)


def env_rows() -> list[str]:
    """Markdown table rows (variable, read by, why not a config key) of :data:`ENVIRONMENT`."""
    return [f"| `{v.name}` | {v.read_by} | {v.why} |" for v in ENVIRONMENT]
