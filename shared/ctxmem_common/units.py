"""Byte sizes as people write them in configs ("64MiB", "8GiB", "4096")."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, where: str = "size") -> int:
    """Parse ``value`` (int or string like ``"512MiB"``) into bytes.

    Raises ``ValueError`` naming ``where`` and the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected a size like '512MiB' or an integer, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{where}: size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = m.group(2).lower()
            if unit in _UNITS:
                return int(float(m.group(1)) * _UNITS[unit])
    raise ValueError(
        f"{where}: cannot parse size {value!r}; write an integer number of bytes or a number "
        f"with a unit (KiB, MiB, GiB, TiB, or KB, MB, GB, TB), e.g. '512MiB'"
    )


def format_size(nbytes: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)
