"""``ctxmem fuzz``: a seeded adversarial fuzz of a live service's whole surface (issue 12).

Every RPC of ``ctxmem.v1`` (taken from the proto descriptor), the TCP data-plane framing
and the shared-memory socket framing (taken from ``ctxmem_common.wire``), against one real
service process with legitimate sessions holding real blocks; with ``--targets peer``,
also the pod peer port's handshake and requests (``ctxmem_common.peer_wire``) against a
pod of two nodes (:mod:`.peer`). See :mod:`.runner` for the
checks (crash, hang, wrong byte, traceback in the log, RSS growth).
"""

from ctxmem_tools.fuzz.runner import FuzzOptions, FuzzRun, summary

__all__ = ["FuzzOptions", "FuzzRun", "summary"]
