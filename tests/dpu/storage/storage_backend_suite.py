"""The conformance suite every storage backend runs (as zarr ships ``StoreTests``).

A backend's test module subclasses :class:`BackendTests` as ``Test<Name>Backend`` and
provides the ``make`` fixture: a factory of fresh, not yet attached backend objects for
one and the same device (a second object stands for the service after a restart). The
suite checks the contract of :class:`ctxmem_dpu.storage.StorageBackend`: registry,
attach/detach idempotency, the path and size it reports, health, and the context
manager. It runs against real files (`local`) and against the fakes of this directory
(`kernel`: a fake nvme-cli and sysfs; `spdk`: a fake SPDK JSON-RPC server).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from ctxmem_dpu.storage import (
    ALIGNMENT_BYTES,
    StorageBackend,
    StorageError,
    backend_class,
    open_backend,
)

MakeBackend = Callable[[], StorageBackend]


class BackendTests:
    """Shared tests; subclasses define the ``make`` fixture."""

    @pytest.fixture
    def make(self) -> MakeBackend:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def test_registered_under_its_backend_name(self, make: MakeBackend) -> None:
        dev = make()
        assert backend_class(dev.spec.backend) is type(dev)
        with open_backend(dev.spec) as other:
            assert type(other) is type(dev) and other.spec == dev.spec
        dev.close()

    def test_nothing_known_before_attach(self, make: MakeBackend) -> None:
        dev = make()
        assert dev.path is None and dev.spec.name in repr(dev)
        with pytest.raises(StorageError, match=r"size is unknown because it is not attached"):
            _ = dev.size_bytes
        dev.close()

    def test_attach_returns_a_usable_path(self, make: MakeBackend) -> None:
        with make() as dev:
            path = dev.attach(timeout_s=10)
            assert os.path.exists(path) and dev.path == path and dev.locate() == path
            assert dev.size_bytes >= ALIGNMENT_BYTES and dev.size_bytes % ALIGNMENT_BYTES == 0
            assert dev.is_healthy()
            assert path in repr(dev)

    def test_attach_is_idempotent_within_and_across_restarts(self, make: MakeBackend) -> None:
        first = make()
        path = first.attach(timeout_s=10)
        size = first.size_bytes
        assert first.attach(timeout_s=10) == path and first.size_bytes == size
        first.close()  # the service stops without detaching: the device stays attached
        with make() as second:
            assert second.attach(timeout_s=10) == path and second.size_bytes == size

    def test_detach_is_idempotent(self, make: MakeBackend) -> None:
        never = make()
        never.detach()  # detaching a device that was never attached does nothing
        never.close()
        dev = make()
        dev.attach(timeout_s=10)
        dev.detach()
        assert dev.path is None
        dev.detach()
        dev.close()
        dev.close()  # close is idempotent too

    def test_context_manager_detaches_on_exit(self, make: MakeBackend) -> None:
        with make() as dev:
            dev.attach(timeout_s=10)
            assert dev.path is not None
        assert dev.path is None
        with pytest.raises(RuntimeError), make() as dev:
            dev.attach(timeout_s=10)
            raise RuntimeError("the with body failed")
        assert dev.path is None
