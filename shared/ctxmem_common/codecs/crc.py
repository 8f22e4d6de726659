"""CRC32C (Castagnoli), hardware-accelerated, over any buffer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer

import crc32c as _crc32c

# Release the GIL for buffers above the package's threshold so a CRC of a 2 MiB block
# does not stall the service's event loop thread.
_GIL_RELEASE = 1


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (0 to start)."""
    return int(_crc32c.crc32c(data, value, _GIL_RELEASE))
