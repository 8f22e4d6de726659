"""The client's constructor arguments: ``verify_puts`` is deprecated (it does nothing:
every Commit carries the client's CRC32C of each block), so passing it warns once, at the
caller's line, and leaving it out warns nothing. The client connects lazily, so no
service is needed here."""

from __future__ import annotations

import warnings

import pytest

import ctxmem


@pytest.mark.parametrize("value", [True, False])
def test_verify_puts_warns_that_it_does_nothing(value: bool) -> None:
    with pytest.warns(DeprecationWarning, match=r"verify_puts=.* does nothing") as got:
        c = ctxmem.Client("127.0.0.1:1", verify_puts=value)
    c.close()
    assert len(got) == 1
    assert got[0].filename == __file__, "the warning should point at the caller's line"
    assert not hasattr(c, "verify_puts")


def test_a_client_without_verify_puts_warns_nothing() -> None:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = ctxmem.Client("127.0.0.1:1", verify_gets=False, copy_threads=1)
    c.close()
    assert [f"{w.category.__name__}: {w.message}" for w in got] == []
