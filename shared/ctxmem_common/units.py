"""Byte-size strings ("512MiB", "8GiB", "100GB") to integers and back.

Binary (IEC) and decimal (SI) units are both accepted, but only when spelled out:
"8G" is rejected because it is ambiguous (GiB in QEMU and util-linux, GB on a disk
label), and the two differ by 7 %, which matters when a size must fit on a device.
"""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}
_AMBIGUOUS = {"k", "m", "g", "t", "p"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: object, where: str = "size") -> int:
    """Parse a byte size: an int (bytes) or a string such as "512MiB", "8GiB", "1.5TB".

    Args:
        value: the raw config value.
        where: the config path, used in error messages.

    Returns:
        The size in bytes (an exact integer; fractional results are rejected).

    Raises:
        ValueError: for anything else, saying which units are accepted.
    """
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected a size such as \"8GiB\", got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{where}: size must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: expected a size such as \"8GiB\" or an integer number of bytes, "
            f"got {type(value).__name__}"
        )
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"{where}: cannot parse size {value!r}; write a number and a unit, "
            f"e.g. \"512MiB\", \"8GiB\" (binary) or \"100GB\" (decimal)"
        )
    number, unit = match.group(1), match.group(2).lower()
    if unit in _AMBIGUOUS:
        raise ValueError(
            f"{where}: unit {match.group(2)!r} in {value!r} is ambiguous; write "
            f"\"{number}{unit.upper()}iB\" (binary) or \"{number}{unit.upper()}B\" (decimal)"
        )
    if unit not in _UNITS:
        raise ValueError(
            f"{where}: unknown unit {match.group(2)!r} in {value!r}; accepted units: "
            "B, KiB, MiB, GiB, TiB, PiB, kB, MB, GB, TB, PB"
        )
    multiplier = _UNITS[unit]
    if "." in number:
        whole, frac = number.split(".")
        numerator = int(whole + frac) * multiplier
        denominator = 10 ** len(frac)
        if numerator % denominator:
            raise ValueError(f"{where}: {value!r} is not a whole number of bytes")
        return numerator // denominator
    return int(number) * multiplier


def format_size(num_bytes: int) -> str:
    """Render a byte count with the largest binary unit that divides it exactly."""
    for unit, multiplier in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30),
                             ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes and num_bytes % multiplier == 0:
            return f"{num_bytes // multiplier}{unit}"
    return f"{num_bytes}B"
