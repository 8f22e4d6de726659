"""Engine integrations: LMCache storage plugin, vLLM KV connector, SGLang HiCache backend.

Nothing is imported here. Each submodule imports its engine (and torch) only when it is
itself imported, so ``import ctxmem`` stays light:

* ``ctxmem.integrations.lmcache`` -- :class:`CtxmemBackend`, an LMCache storage plugin
  (``storage_plugins`` + ``extra_config.storage_plugin.<name>.module_path/class_name``).
* ``ctxmem.integrations.vllm`` -- :class:`CtxmemConnector`, a ``KVConnectorBase_V1``
  loaded with ``--kv-transfer-config '{"kv_connector":"CtxmemConnector",
  "kv_connector_module_path":"ctxmem.integrations.vllm","kv_role":"kv_both"}'``.
* ``ctxmem.integrations.sglang`` -- :class:`CtxmemHiCacheStorage`, loaded through SGLang's
  ``--hicache-storage-backend dynamic``.

``vllm_layout`` (paged-cache <-> block byte order) and ``vllm_core`` (the connector's
scheduler and worker logic) need only torch, so they are tested without vLLM installed.
See ``docs/engines.md``.
"""
