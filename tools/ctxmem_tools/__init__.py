"""ctxmem's tools: the demo, the benchmarks and the fault campaign (``ctxmem demo``,
``ctxmem bench [ttft|recovery]``, ``ctxmem chaos``), and the launcher that runs a service
as a child process for them and for the tests.

A package of its own, apart from the shim engines import (``ctxmem``): the tools use only
the shim's public API and ``ctxmem_common``, and start the service only as a program
(``python -m ctxmem_dpu serve``), never by importing it. Install with ``ctxmem-kv[tools]``.
"""
