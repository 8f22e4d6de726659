"""Block authenticators OFF, for ``ctxmem bench --auth-ab`` only (never for serving).

Python imports ``sitecustomize`` at start-up from the first directory of ``sys.path``
that holds one; the A/B benches put this directory first on the ``PYTHONPATH`` of the
services they start (both arms, so both load the same code). Only where
``CTXMEM_BENCH_AUTH_OFF`` is ``1`` as well (the "off" arm) does it replace
:meth:`BlockAuthenticator.tag <ctxmem_common.codecs.blockauth.BlockAuthenticator.tag>`
with a constant tag and
:meth:`~ctxmem_common.codecs.blockauth.BlockAuthenticator.verify` with ``True``, and say
so on stderr (the service's log) in a line the bench requires from every "off" service
and refuses from every "on" one (:data:`WARNING`): a run that silently measured on
against on fails instead. At exit it logs how many tags and checks it skipped
(:data:`EXIT_LINE`). Without the variable this module does nothing but hand over to any
other ``sitecustomize`` further down ``sys.path``; imported under its package name (the
benches read its constants) it does nothing at all.
"""

from __future__ import annotations

import atexit
import importlib.machinery
import importlib.util
import itertools
import os
import sys
from typing import Any

ENV = "CTXMEM_BENCH_AUTH_OFF"
#: The line an "off" service logs at start (the benches look for it verbatim).
WARNING = "authenticators OFF: benchmark harness, never for serving"
#: Its line at exit: ``EXIT_LINE.format(tags=..., verifies=...)``.
EXIT_LINE = "authenticators OFF: {tags} tags and {verifies} checks not computed"
#: The methods of BlockAuthenticator this harness replaces: every one that makes or
#: checks a tag (tests/tools/test_bench_auth_ab.py fails if the class grows another).
PATCHED = ("tag", "verify")


def _install() -> None:
    from ctxmem_common.codecs import blockauth

    cls: Any = blockauth.BlockAuthenticator
    constant = bytes(blockauth.TAG_BYTES)
    tags, verifies = itertools.count(), itertools.count()

    def tag(self: object, key: bytes, data: object, context: bytes = b"") -> bytes:
        next(tags)
        return constant

    def verify(self: object, key: bytes, data: object, tag: bytes,
               context: bytes = b"") -> bool:
        next(verifies)
        return True

    cls.tag = tag
    cls.verify = verify
    sys.stderr.write(f"WARNING ctxmem_tools.bench.authoff: {WARNING} ({ENV}=1, pid "
                     f"{os.getpid()})\n")
    sys.stderr.flush()

    def report() -> None:
        # next() on a count returns how many times it was called before.
        n_tags, n_verifies = next(tags), next(verifies)
        sys.stderr.write(f"WARNING ctxmem_tools.bench.authoff: "
                         f"{EXIT_LINE.format(tags=n_tags, verifies=n_verifies)}\n")
        sys.stderr.flush()

    atexit.register(report)


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (a distribution's own), as if this
    one were not there."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


# Only as Python's own start-up import (``sitecustomize``), never when the bench imports
# this file as ctxmem_tools.bench.authoff.sitecustomize for its constants.
if __name__ == "sitecustomize":
    if os.environ.get(ENV) == "1":
        _install()
    _chain()
