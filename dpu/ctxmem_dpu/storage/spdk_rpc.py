"""The one channel through which ctxmem talks to SPDK: `spdk.rpc.client.JSONRPCClient`.

Thin on purpose (SPDK removed its own per-method wrappers for the same reason): this
module only adds what the client lacks for a long-running service:

- a JSON-RPC error becomes an `SpdkRpcError` (a StorageError) quoting the method, the
  params with secrets redacted, SPDK's error code and message, and the remedy. The
  client's own `call()` puts the full params (crypto keys included) into its exception
  text and writes into the caller's params dict, so requests go out with `send()` and
  the reply is read with `recv()` instead;
- every call has a timeout, and a broken connection is reopened on the next call;
- one lock, so health checks from another thread cannot interleave replies.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from .base import StorageError
from .spdk_requests import RpcRequest

__all__ = ["SpdkRpcChannel", "SpdkRpcError"]

_CONNECT_RETRY_INTERVAL_S = 0.2  # fixed inside JSONRPCClient


class SpdkRpcError(StorageError):
    """SPDK answered a request with a JSON-RPC error.

    Attributes:
        method: the JSON-RPC method.
        code: SPDK's error code (often a negative errno, e.g. -19 for ENODEV).
        spdk_message: SPDK's error message.
    """

    def __init__(self, request: RpcRequest, code: int | None, spdk_message: str,
                 remedy: str) -> None:
        super().__init__(
            f"SPDK RPC {request.method} with params {request.redacted_params()} failed: "
            f"SPDK error {code}: {spdk_message}",
            remedy,
            errno=-code if isinstance(code, int) and -4096 < code < 0 else None,
        )
        self.method = request.method
        self.code = code
        self.spdk_message = spdk_message


class SpdkRpcChannel:
    """A JSON-RPC connection to one SPDK application (spdk_tgt, or SNAP on BlueField).

    Args:
        socket_path: SPDK's RPC listen socket (its `-r` option).
        device_name: the ctxmem device this channel serves, for error messages.
    """

    def __init__(self, socket_path: str, device_name: str) -> None:
        self.socket_path = socket_path
        self.device_name = device_name
        self._client: Any = None
        self._lock = threading.Lock()

    def call(self, request: RpcRequest, timeout_s: float) -> Any:
        """Send `request`, wait at most `timeout_s` for the reply, return its result.

        Raises:
            SpdkRpcError: SPDK returned an error.
            StorageError: no connection, no reply in time, or a malformed reply.
        """
        _, rpc_exception = self._client_classes()
        if not self._lock.acquire(timeout=timeout_s):
            raise StorageError(
                f"device {self.device_name!r}: SPDK RPC {request.method} not sent: another "
                f"call on {self.socket_path} did not finish within {timeout_s:.1f}s",
                "check that SPDK is responsive; its log shows which call hangs",
            )
        try:
            client = self._connected(timeout_s)
            client.timeout = timeout_s
            request_id = client.send(request.method, dict(request.params))
            response = client.recv()
        except (rpc_exception, OSError) as ex:
            self._drop()
            # Only the first line: the rest may echo a partial reply.
            detail = str(getattr(ex, "message", ex)).strip().splitlines()[:1]
            raise StorageError(
                f"device {self.device_name!r}: SPDK RPC {request.method} with params "
                f"{request.redacted_params()} got no reply from {self.socket_path} "
                f"within {timeout_s:.1f}s: {' '.join(detail) or type(ex).__name__}",
                "check that SPDK is running and responsive (its log shows why a call "
                "hangs); raise attach's timeout_s for slow fabric connects",
            ) from ex
        finally:
            self._lock.release()
        if not isinstance(response, dict) or response.get("id") != request_id:
            self.close()
            raise StorageError(
                f"device {self.device_name!r}: SPDK RPC {request.method}: malformed or "
                f"out-of-order reply on {self.socket_path}",
                "make sure no other client shares this connection; restart the service",
            )
        if "error" in response:
            error = response["error"] if isinstance(response["error"], dict) else {}
            raise SpdkRpcError(
                request, error.get("code"), str(error.get("message", response["error"])),
                request.remedy or "see SPDK's log for details",
            )
        return response.get("result")

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _connected(self, timeout_s: float) -> Any:
        if self._client is not None:
            return self._client
        rpc_client, rpc_exception = self._client_classes()
        retries = max(0, int(timeout_s / _CONNECT_RETRY_INTERVAL_S) - 1)
        try:
            client = rpc_client(self.socket_path, timeout=timeout_s, conn_retries=retries)
        except rpc_exception as ex:
            detail = " ".join(str(getattr(ex, "message", ex)).split())
            raise StorageError(
                f"device {self.device_name!r}: cannot connect to SPDK's RPC socket "
                f"{self.socket_path} within {timeout_s:.1f}s: {detail}",
                "start SPDK (spdk_tgt -r SOCKET; on BlueField the SNAP container) and set "
                "spdk.rpc_socket to its RPC socket; a socket inside a container must be "
                "mounted into ctxmem's container",
            ) from ex
        # JSONRPCClient adds a log handler per instance to a per-address logger; keep one
        # so reconnects do not duplicate every log line.
        logger = client.get_logger()
        del logger.handlers[1:]
        self._client = client
        return client

    def _client_classes(self) -> tuple[type[Any], type[Exception]]:
        """SPDK's client and exception classes, imported on first use (optional extra)."""
        try:
            from spdk.rpc.client import JSONRPCClient, JSONRPCException
        except ImportError as ex:
            raise StorageError(
                f"device {self.device_name!r}: the spdk Python package is not installed",
                "pip install 'ctxmem-kv[spdk]' (spdk==26.9)",
            ) from ex
        return JSONRPCClient, JSONRPCException

    def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(OSError):  # already closed by the peer
                client.close()
