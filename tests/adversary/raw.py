"""The raw protocol client the adversary tests drive; it lives in
:mod:`ctxmem_tools.rawclient` (the chaos campaign's stalled-client fault uses it too)."""

from ctxmem_tools.rawclient import OWN, RawAllocation, RawLease, RawSession, neighbours

__all__ = ["OWN", "RawAllocation", "RawLease", "RawSession", "neighbours"]
