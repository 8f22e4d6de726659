"""ctxmem's vLLM general plugin: short names for its connector and its secondary tier.

Declared in ``pyproject.toml`` as the ``vllm.general_plugins`` entry point
``ctxmem = ctxmem.integrations.vllm_plugin:register``; vLLM calls :func:`register` in
every process it starts (``vllm.plugins.load_general_plugins``), once per process, and
only when ctxmem-kv is installed (entry points live in the package metadata) and
``VLLM_PLUGINS`` is unset or names ``ctxmem``. It registers, lazily (nothing of ctxmem's
integrations is imported until vLLM resolves the name):

* the secondary tier type ``ctxmem`` with vLLM's ``SecondaryTierFactory``, so the
  offloading stack takes ``"secondary_tiers":[{"type":"ctxmem","endpoint":"..."}]``;
* the connector name ``CtxmemConnector`` with vLLM's ``KVConnectorFactory``, so
  ``{"kv_connector":"CtxmemConnector"}`` needs no ``kv_connector_module_path``.

The ``module_path`` forms keep working: vLLM imports the module named there itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TIER_TYPE = "ctxmem"
TIER_MODULE, TIER_CLASS = "ctxmem.integrations.vllm_tier", "CtxmemSecondaryTier"
CONNECTOR_NAME = "CtxmemConnector"
CONNECTOR_MODULE = "ctxmem.integrations.vllm"


def _register_once(what: str, name: str, add: Callable[[str, str, str], None],
                   module: str, cls: str) -> None:
    """Register ``name`` -> ``module.cls``; a name already taken (this plugin loaded
    twice, or another package claiming it) is left as it is, with a log line."""
    try:
        add(name, module, cls)
    except ValueError as exc:  # vLLM's factories refuse a second registration
        log.info("ctxmem vLLM plugin: %s %r already registered (%s); left as it is",
                 what, name, exc)


def register() -> None:
    """Register ctxmem's tier type and connector name with vLLM's factories.

    vLLM calls this in every process without catching what it raises, so a vLLM without
    one of the factories (an older release has no ``vllm.v1.kv_offload.tiering``) must
    not stop the engine: that registration is skipped with a warning naming what is
    missing, and the other still happens."""
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as exc:
        log.warning("ctxmem vLLM plugin: this vLLM has no secondary-tier factory (%s); "
                    "the tier type %r is not registered (vLLM >= 0.32 has it)",
                    exc, TIER_TYPE)
    else:
        _register_once("secondary tier type", TIER_TYPE, SecondaryTierFactory.register_tier,
                       TIER_MODULE, TIER_CLASS)
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:
        log.warning("ctxmem vLLM plugin: this vLLM has no KV connector factory (%s); the "
                    "connector name %r is not registered (use kv_connector_module_path)",
                    exc, CONNECTOR_NAME)
    else:
        _register_once("KV connector", CONNECTOR_NAME,
                       KVConnectorFactory.register_connector, CONNECTOR_MODULE,
                       CONNECTOR_NAME)
