"""gRPC's own log lines, made to say what happened in one line where nothing failed.

gRPC's asyncio server logs ``ExecuteBatchError raised in core by servicer method [...]``
at ERROR with a traceback when a call's answer cannot be sent because the call already
ended in gRPC's core: the caller's deadline passed or it went away (cancelled, its
connection closed) just as the handler answered, before gRPC's own "client closed" flag
was set (``_handle_exceptions`` in grpc's ``aio/server.pyx.pxi``, which logs the same case
silently once that flag is set). Nothing failed on the service's side: the request ran
to its end and only the answer had nobody to go to. Alerts on tracebacks would fire for
it (issue 26), so :class:`QuietEndedCalls` turns that record into one INFO line without
the traceback. Every other gRPC record passes unchanged.
"""

from __future__ import annotations

import logging

__all__ = ["GRPC_AIO_LOGGER", "QuietEndedCalls", "install"]

GRPC_AIO_LOGGER = "grpc._cython.cygrpc"
"""The logger gRPC's asyncio server writes through."""

_ENDED_CALL = "ExecuteBatchError raised in core by servicer method"


class QuietEndedCalls(logging.Filter):
    """Rewrites gRPC's "answer to an ended call" record as one INFO line (see the module
    doc); dropped where INFO is not logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        exc_type = record.exc_info[0] if record.exc_info else None
        if _ENDED_CALL not in message and not (
                exc_type is not None and exc_type.__name__ == "ExecuteBatchError"
                and "servicer method" in message):
            return True
        method = message.rpartition("[")[2].rstrip("]") or "?"
        record.msg = ("gRPC call %s ended before its answer could be sent (the caller's "
                      "deadline passed or it went away)")
        record.args = (method,)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


def install() -> None:
    """Add :class:`QuietEndedCalls` to gRPC's asyncio server logger (once)."""
    logger = logging.getLogger(GRPC_AIO_LOGGER)
    if not any(isinstance(f, QuietEndedCalls) for f in logger.filters):
        logger.addFilter(QuietEndedCalls())
