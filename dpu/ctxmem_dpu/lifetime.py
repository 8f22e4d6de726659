"""Explicit lifetimes for the service's long-lived objects (data servers, the metrics
endpoint): ``start()`` takes the resources, ``close()`` gives every one of them back,
and ``async with`` pairs the two, as the shim's objects already do.

Modelled on rdma-core's resource classes: a resource is usable between its start and its
close, close is idempotent and safe on an object that never started (or started half
way), so an error path can always call it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import TypeVar

__all__ = ["AsyncResource"]

_R = TypeVar("_R", bound="AsyncResource")


class AsyncResource(ABC):
    """Something the service starts and must close: ``async with obj: ...``.

    ``__aenter__`` starts it and, if starting fails part way, closes what did start
    before re-raising; ``__aexit__`` closes it.
    """

    @abstractmethod
    async def start(self) -> None:
        """Take the resources (bind, listen, open the device). Idempotent."""

    @abstractmethod
    async def close(self) -> None:
        """Release everything ``start`` took. Idempotent; safe without ``start``."""

    async def __aenter__(self: _R) -> _R:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()
