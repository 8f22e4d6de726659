"""gRPC cases: every method of ``ctxmem.v1.ContextMemory``, any request, any token.

Calls go through generic byte-level stubs (``channel.unary_unary(path)`` with no
serializer), so a case can also send bytes that are not a valid protobuf message, and a
server-streaming method (``RdmaAttach``, ``Hold``: one message, then open for the life of
their connection or session) is read for its first message then cancelled. The session
token metadata is the sender's own, another fuzzer session's, a random or empty one, a
one-byte-off one, or missing. ``Disconnect`` and ``Hold`` get only tokens no session has:
with a valid one they end the session (Hold's end orphans it), and the fuzzer's sessions
must live through the run (their authenticated use is tested in
``tests/adversary/test_sessions.py``).
"""

from __future__ import annotations

import random
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor

from ctxmem_common.identity import SESSION_TOKEN_METADATA_KEY
from ctxmem_tools.fuzz.messages import MessageFuzzer, Pools, method_path, service_methods

# Methods that end the session they name (see the module doc).
SESSION_ENDING = frozenset({"Disconnect", "Hold"})


class RpcTarget:
    """Cases against the gRPC control plane of one service."""

    def __init__(self, channel: grpc.Channel, rng: random.Random, pools: Pools,
                 fuzzer: MessageFuzzer, *, timeout_s: float = 10.0) -> None:
        self.rng = rng
        self.pools = pools
        self.fuzzer = fuzzer
        self.timeout_s = timeout_s
        self.methods = service_methods()
        self._calls: dict[str, Any] = {}
        for m in self.methods:
            make = channel.unary_stream if m.server_streaming else channel.unary_unary
            self._calls[m.name] = make(method_path(m))  # bytes in, bytes out

    def metadata(self, own: bytes, valid: bool = True
                 ) -> tuple[tuple[str, bytes], ...] | None:
        """The session token metadata of one call (None: no metadata at all); with
        ``valid`` false, never a token a session has."""
        r = self.rng
        pick = r.random() if valid else 0.7 + 0.3 * r.random()
        if pick < 0.6:
            token = own
        elif pick < 0.7:
            token = r.choice(self.pools.own).token
        elif pick < 0.8:
            token = r.randbytes(16)
        elif pick < 0.85:
            token = r.choice((b"", own[:-1], own + b"\0", r.randbytes(4096)))
        else:
            return None
        return ((SESSION_TOKEN_METADATA_KEY, token),)

    def case(self) -> tuple[str, str]:
        """Run one case: (method name, outcome: "OK" or the gRPC status code's name)."""
        m = self.rng.choice(self.methods)
        me = self.rng.choice(self.pools.own)
        data = self.fuzzer.request(m, me)
        return m.name, self.call(m, data, self.metadata(
            me.token, valid=m.name not in SESSION_ENDING))

    def call(self, m: MethodDescriptor, data: bytes,
             metadata: tuple[tuple[str, bytes], ...] | None) -> str:
        """Send ``data`` as ``m``'s request; remember the ids a success hands out."""
        fn = self._calls[m.name]
        try:
            if m.server_streaming:
                stream = fn(data, timeout=self.timeout_s, metadata=metadata)
                try:
                    for _ in stream:
                        break  # the first message; the call would stay open
                finally:
                    stream.cancel()
                return "OK"
            raw = fn(data, timeout=self.timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            return code.name if code is not None else "RPC_ERROR"
        response = message_factory.GetMessageClass(m.output_type)()
        response.ParseFromString(raw)
        self.pools.remember(response)
        return "OK"
