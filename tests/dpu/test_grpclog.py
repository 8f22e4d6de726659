"""gRPC's "answer to a call that already ended" record becomes one INFO line (issue 26
item 5; ``ctxmem_dpu.grpclog``). The record is made as gRPC's asyncio server makes it
(its logger, message and a real ``ExecuteBatchError`` with its traceback): the race that
produces it (a call's deadline passing while its answer goes out) cannot be forced from
outside; ``tests/reliability/test_cancelled_requests.py`` drives cancelled Deletes
against the real service and checks its log."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from grpc._cython import cygrpc

from ctxmem_dpu import grpclog


@pytest.fixture
def grpc_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger(grpclog.GRPC_AIO_LOGGER)
    saved = list(logger.filters)
    grpclog.install()
    grpclog.install()  # once, however often the service starts in one process
    assert sum(isinstance(f, grpclog.QuietEndedCalls) for f in logger.filters) == 1
    yield logger
    logger.filters[:] = saved


def _ended_call(logger: logging.Logger) -> None:
    """What grpc's ``_handle_exceptions`` logs when the answer's batch failed."""
    try:
        raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendMessageOperation, '
                                       'SendStatusFromServerOperation)')
    except cygrpc.ExecuteBatchError:
        method = "/ctxmem.v1.ContextMemory/Delete"
        logger.exception(f"ExecuteBatchError raised in core by servicer method [{method}]")


def test_an_answer_to_an_ended_call_is_one_info_line(
        grpc_logger: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    _ended_call(grpc_logger)
    grpc_logger.error("Exception in callback: something else [%s]", "x")
    ours = [r for r in caplog.records if r.name == grpclog.GRPC_AIO_LOGGER]
    assert len(ours) == 2
    ended, other = ours
    assert ended.levelno == logging.INFO and ended.exc_info is None
    assert ended.getMessage() == (
        "gRPC call /ctxmem.v1.ContextMemory/Delete ended before its answer could be sent "
        "(the caller's deadline passed or it went away)")
    assert "Traceback" not in caplog.text and "ExecuteBatchError" not in caplog.text
    assert other.levelno == logging.ERROR, "another gRPC error was changed"


def test_not_logged_where_info_is_off(grpc_logger: logging.Logger,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    _ended_call(grpc_logger)
    assert not [r for r in caplog.records if r.name == grpclog.GRPC_AIO_LOGGER]
