"""Which backend class provisions which ``backend:`` name, and the factory over it.

Apart from the contract (:mod:`.base`) so that the contract never imports its own
implementations: base <- local/kernel/spdk <- registry. Backends are imported on first
use, not at module import, so e.g. the `spdk` package is needed only when an SPDK device
is configured.
"""

from __future__ import annotations

import importlib

from ctxmem_common.device_settings import DeviceSpec

from .base import StorageBackend

__all__ = ["BACKENDS", "backend_class", "open_backend"]

# backend name -> (module under ctxmem_dpu.storage, class name)
BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("local", "LocalBackend"),
    "kernel": ("kernel", "KernelBackend"),
    "spdk": ("spdk", "SpdkBackend"),
}


def backend_class(name: str) -> type[StorageBackend]:
    """The StorageBackend subclass registered under ``name`` (imported now).

    Raises:
        ValueError: no backend of that name.
    """
    try:
        module, cls_name = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}") from None
    cls = getattr(importlib.import_module(f"{__package__}.{module}"), cls_name)
    assert issubclass(cls, StorageBackend)
    return cls


def open_backend(spec: DeviceSpec) -> StorageBackend:
    """Return the (not yet attached) backend for ``spec``; use it as a context manager
    (``with open_backend(spec) as dev``) to guarantee ``detach()``."""
    if spec.backend not in BACKENDS:
        raise ValueError(f"device {spec.name!r}: unknown backend {spec.backend!r}")
    return backend_class(spec.backend)(spec)
