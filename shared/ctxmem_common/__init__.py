"""What the ctxmem service and shim agree on: protocol, KV layout, keys, config, codecs.

This package imports neither the service (``ctxmem_dpu``) nor the shim (``ctxmem``).
"""

__version__ = "0.1.0"
