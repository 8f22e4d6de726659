"""Byte sizes: the one implementation lives in :mod:`ctxmem_common.units` (the service's
config and the storage layer parse sizes the same way)."""

from ctxmem_common.units import format_size, parse_size

__all__ = ["format_size", "parse_size"]
