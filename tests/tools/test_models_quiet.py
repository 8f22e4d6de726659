"""The demo's model calls use the installed transformers' current names: no deprecation
warning or log line (``ctxmem demo`` printed four, issue 31)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_prefill_decode_and_geometry_print_no_deprecation(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    from ctxmem.kvtransfer import geometry_from_config
    from ctxmem_tools.demo import build_model
    from ctxmem_tools.models import greedy_decode, prefill

    model = build_model(layers=2, hidden=64, heads=4, kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator()
                        .manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        geometry = geometry_from_config(model.config, tokens_per_block=8)
        logits, cache = prefill(model, ids, chunk_size=8)
        tokens, _ = greedy_decode(model, logits, cache, steps=2)
    assert geometry.tokens_per_block == 8 and len(tokens) == 2
    err = capfd.readouterr().err  # transformers logs to stderr, or through the root logger
    assert "deprecated" not in err, err
    assert "deprecated" not in caplog.text, caplog.text
