"""Progress bars with an ETA for long commands, on a terminal only.

``ctxmem chaos``, ``ctxmem check``, ``ctxmem bench`` and ``ctxmem bench recovery`` run for
minutes; on a terminal they show a tqdm bar (done/total, percent, elapsed and the time
left). Anywhere else — output piped or redirected, a CI job (``CI`` set), or
``CTXMEM_PROGRESS=0`` — the bar is a no-op and writes nothing, so logs stay clean.
``CTXMEM_PROGRESS=1`` forces it on (for a terminal that is not the stream's, e.g. under
``script``).

    with progress(total=n, desc="chaos", unit="fault") as bar:
        ...
        bar.update(k)                 # or bar.set(done) with an absolute count
        bar.note(wrong=0, served=123)  # shown after the bar

Here in ``ctxmem_common`` because both the service's ``ctxmem check`` and the tools use it.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any, TextIO

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} " \
             "[{elapsed} elapsed, ETA {remaining}{postfix}]"


def enabled(stream: TextIO | None = None) -> bool:
    """True when a bar should be drawn on ``stream`` (default: stderr)."""
    force = os.environ.get("CTXMEM_PROGRESS", "")
    if force in ("0", "1"):
        return force == "1"
    if os.environ.get("CI"):
        return False
    s = stream if stream is not None else sys.stderr
    try:
        return bool(s.isatty())
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


class Progress:
    """A tqdm bar, or nothing at all when :func:`enabled` says no."""

    def __init__(self, total: float, desc: str, unit: str = "",
                 stream: TextIO | None = None, show: bool | None = None) -> None:
        self.total = total
        self.n: float = 0
        self._bar: Any = None
        if show if show is not None else enabled(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit or "it",
                             file=stream if stream is not None else sys.stderr,
                             bar_format=BAR_FORMAT, dynamic_ncols=True, mininterval=0.5,
                             leave=True)

    @property
    def active(self) -> bool:
        """Whether a bar is being drawn."""
        return self._bar is not None

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def set(self, done: float) -> None:
        """Move the bar to ``done`` (an absolute count)."""
        if done > self.n:
            self.update(done - self.n)

    def note(self, **fields: object) -> None:
        """Show ``key=value`` fields after the bar."""
        if self._bar is not None:
            self._bar.set_postfix({k: str(v) for k, v in fields.items()}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def progress(total: float, desc: str, unit: str = "", stream: TextIO | None = None,
             show: bool | None = None) -> Progress:
    """A :class:`Progress` bar over ``total`` units (``show``: None decides by
    :func:`enabled`, True/False override)."""
    return Progress(total, desc, unit, stream, show)
