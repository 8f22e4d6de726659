"""Client data channels: how the shim moves bytes into and out of the service's slots."""

from ctxmem.transport.base import DataChannel, Grant, TransportError

__all__ = ["DataChannel", "Grant", "TransportError"]
