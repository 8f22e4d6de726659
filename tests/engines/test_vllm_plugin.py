"""ctxmem's vLLM plugin where vLLM lacks its factories (the project venv has no vLLM).

vLLM runs ``vllm.general_plugins`` entry points without catching what they raise, so a
plugin that fails to import a factory would stop every engine start next to an older
vLLM. Here ``vllm`` is absent: :func:`register` must return, warning what it skipped.
The registration itself runs against the real vLLM in ``vllm_plugin_check.py``.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from ctxmem.integrations import vllm_plugin


def test_register_without_vllm_factories_does_not_raise(
        caplog: pytest.LogCaptureFixture) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; the registration runs in vllm_plugin_check.py")
    with caplog.at_level(logging.WARNING, logger=vllm_plugin.__name__):
        vllm_plugin.register()
    text = caplog.text
    assert "tier type 'ctxmem' is not registered" in text, text
    assert "connector name 'CtxmemConnector' is not registered" in text, text


def test_entry_point_declared_in_pyproject() -> None:
    # tomllib is 3.11+ (the project's CI Python); the project supports 3.10.
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml")
                            .read_text())["project"]
    eps = project["entry-points"]["vllm.general_plugins"]
    assert eps == {"ctxmem": "ctxmem.integrations.vllm_plugin:register"}, eps
