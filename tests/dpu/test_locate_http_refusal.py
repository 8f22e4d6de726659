"""When the metrics port refuses session tokens (``POST /v1/locate``): only when the gRPC
port has TLS and the metrics port, plaintext HTTP, is bound beyond loopback (a token
must not cross the network in clear where gRPC would have encrypted it). A pure rule; the
served refusal (403 with this message) is ``HttpEndpoint.locate_refusal``."""

from __future__ import annotations

import pytest

from ctxmem_dpu.app import _locate_refusal


@pytest.mark.parametrize("listen", ["127.0.0.1:9464", "[::1]:9464", "localhost:9464",
                                    "127.0.0.2:1"])
def test_loopback_metrics_serve_locate_with_or_without_tls(listen: str) -> None:
    assert _locate_refusal(listen, tls=True) == ""
    assert _locate_refusal(listen, tls=False) == ""


@pytest.mark.parametrize("listen", ["0.0.0.0:9464", "[::]:9464", "10.0.0.5:9464",
                                    "metrics.example:9464"])
def test_beyond_loopback_locate_is_refused_only_when_grpc_has_tls(listen: str) -> None:
    why = _locate_refusal(listen, tls=True)
    assert "beyond loopback" in why and listen in why and "gRPC Locate" in why
    assert _locate_refusal(listen, tls=False) == ""  # gRPC is as plain as this port
