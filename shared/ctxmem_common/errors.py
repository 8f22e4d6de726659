"""Error codes shared by service and shim.

Three kinds of failure, kept apart on purpose:

* a caller error (bad key, wrong buffer size, unknown namespace) raises a
  :class:`CtxmemError` subclass whose message names the culprit and says what to do;
* running out of space is a normal outcome reported as ``RESOURCE_EXHAUSTED``;
* a block that fails an integrity check is never an error to the engine: it is a miss.

On the wire an error is a gRPC status plus the ``ctxmem-error`` trailing metadata
carrying :class:`ErrorCode`'s value, so the shim can re-raise the same class.
"""

from __future__ import annotations

import enum

ERROR_METADATA_KEY = "ctxmem-error"


class ErrorCode(str, enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    UNKNOWN_NAMESPACE = "UNKNOWN_NAMESPACE"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    EXPIRED = "EXPIRED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    SHED = "SHED"


class CtxmemError(Exception):
    """Base class of every ctxmem error; ``code`` says which kind."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(CtxmemError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


class UnknownNamespace(CtxmemError, KeyError):
    code = ErrorCode.UNKNOWN_NAMESPACE

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class UnknownSession(CtxmemError):
    """The service does not know this session: it restarted, or the session was closed."""

    code = ErrorCode.UNKNOWN_SESSION


class Expired(CtxmemError):
    """An allocation or lease outlived its TTL; its slots may have been reused."""

    code = ErrorCode.EXPIRED


class ResourceExhausted(CtxmemError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class Shed(ResourceExhausted):
    """A put refused at once because the service's stores are backed up (write-back to
    flash behind by more than ``flash.shed_backlog_bytes``): nothing was stored, nothing
    waited. The engine keeps running; the blocks are recomputed if needed again."""

    code = ErrorCode.SHED


class PermissionDenied(CtxmemError):
    code = ErrorCode.PERMISSION_DENIED


class Unavailable(CtxmemError, ConnectionError):
    """The service cannot be reached (or went away mid-request)."""

    code = ErrorCode.UNAVAILABLE


class ConfigError(CtxmemError, ValueError):
    """Invalid configuration; the message names the key path (``flash.devices[0].size``)."""

    code = ErrorCode.INVALID_ARGUMENT


_BY_CODE: dict[ErrorCode, type[CtxmemError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.UNKNOWN_NAMESPACE: UnknownNamespace,
    ErrorCode.UNKNOWN_SESSION: UnknownSession,
    ErrorCode.EXPIRED: Expired,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.INTERNAL: CtxmemError,
    ErrorCode.SHED: Shed,
}


def error_for_code(code: str, message: str) -> CtxmemError:
    """Rebuild the exception a service raised from its wire code and message."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        cls = CtxmemError
    return cls(message)
