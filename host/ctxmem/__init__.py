"""ctxmem shim: offload KV-cache blocks to a ctxmem service and load them back.

    import ctxmem
    layout = ctxmem.KVLayout(dtype="bfloat16", num_layers=32, num_kv_heads=8,
                             head_dim=128, tokens_per_block=16)
    with ctxmem.Client("127.0.0.1:50051") as client:
        ns = client.open_namespace(layout, model_id="llama-3-8b")
        keys = ctxmem.chain_hashes(token_ids, layout.tokens_per_block)
        ns.put(keys, blocks)          # one buffer of layout.block_nbytes per key
        n = ns.get(keys, out_blocks)  # leading blocks loaded

Importing this package loads neither torch, nor the service, nor pyverbs.
"""

import os as _os

# Blocking gRPC survives fork() only with fork support on (and the poll engine); it must
# be chosen before grpc is first imported. An engine that set these itself keeps its own.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "true")
_os.environ.setdefault("GRPC_POLL_STRATEGY", "poll")

from ctxmem.aio import AsyncClient, AsyncNamespace, AsyncNamespaceGroup
from ctxmem.client import Client
from ctxmem.group import NamespaceGroup
from ctxmem.namespace import LocateResult, LookupResult, Namespace, PutResult
from ctxmem.tls import TlsConfig
from ctxmem_common import __version__
from ctxmem_common.errors import (
    ConfigError,
    CtxmemError,
    Expired,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Shed,
    Unavailable,
    UnknownNamespace,
    UnknownSession,
)
from ctxmem_common.keys import chain_hashes
from ctxmem_common.layout import KVLayout

__all__ = [
    "AsyncClient",
    "AsyncNamespace",
    "AsyncNamespaceGroup",
    "Client",
    "ConfigError",
    "CtxmemError",
    "Expired",
    "InvalidArgument",
    "KVLayout",
    "LocateResult",
    "LookupResult",
    "Namespace",
    "NamespaceGroup",
    "PermissionDenied",
    "PutResult",
    "ResourceExhausted",
    "Shed",
    "TlsConfig",
    "Unavailable",
    "UnknownNamespace",
    "UnknownSession",
    "__version__",
    "chain_hashes",
]
