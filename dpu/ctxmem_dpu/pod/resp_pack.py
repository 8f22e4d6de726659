"""Commands to the index packed in C, not in redis-py's per-argument Python loop.

redis-py's asyncio connection packs every argument of a command in Python (encode, two
``bytes.join`` per argument): for the HMGET of a 10,000-key Lookup with half the keys
remote that is 5,000 fields and ~1.7 ms of the service's CPU, about half of what the
remote part of the Lookup costs (docs/pod.md, "Lookup cost"). Here a command's arguments
after the first two (HMGET's fields, EXISTS's keys) that are all ``bytes`` of one length
— the engine's block keys — become one ``bytes.join``; anything else goes through
hiredis's ``pack_command`` (C; what redis-py's own synchronous client uses with hiredis).
The bytes on the wire are the same RESP either way.

:func:`fast_connection_class` gives the connection class to hand redis-py (plain or
TLS); :func:`use_on_cluster` fits it into a ``RedisCluster``, which takes no connection
class (its nodes are built from its ``connection_kwargs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import hiredis
from redis.asyncio.connection import Connection, SSLConnection
from redis.exceptions import DataError

if TYPE_CHECKING:
    from redis.asyncio import RedisCluster

#: Below this many uniform arguments hiredis alone is as fast.
_UNIFORM_MIN = 16


def pack_command(args: tuple[Any, ...]) -> bytes:
    """``args`` as one RESP array of bulk strings (the command name may hold several
    words, ``"CLUSTER SLOTS"``, as redis-py allows). ``DataError`` for an argument redis
    cannot take (None, a bool, a dict), as redis-py raises."""
    first = args[0]
    if isinstance(first, str):
        args = (*first.encode().split(), *args[1:])
    elif b" " in first:
        args = (*first.split(), *args[1:])
    if len(args) >= 2 + _UNIFORM_MIN:
        rest = args[2:]
        if set(map(type, rest)) == {bytes} and len(lens := set(map(len, rest))) == 1:
            n = lens.pop()
            head = _hiredis_pack(args[:2])
            # '*2\r\n' → '*N\r\n', then the uniform tail in one join.
            star = head.index(b"\r\n")
            return b"".join((b"*%d" % len(args), head[star:], b"$%d\r\n" % n,
                             (b"\r\n$%d\r\n" % n).join(rest), b"\r\n"))
    return _hiredis_pack(args)


def _hiredis_pack(args: tuple[Any, ...]) -> bytes:
    if any(isinstance(a, (bytearray, memoryview)) for a in args):
        args = tuple(bytes(a) if isinstance(a, (bytearray, memoryview)) else a for a in args)
    try:
        return hiredis.pack_command(args)
    except TypeError as exc:
        raise DataError(f"cannot send {args[0]!r} to the index: {exc}") from None


class _FastPack:
    """Mixin: a connection whose commands are packed by :func:`pack_command`."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return [pack_command(args)]


class FastConnection(_FastPack, Connection):
    """redis-py's TCP connection, commands packed in C."""


class FastSSLConnection(_FastPack, SSLConnection):
    """redis-py's TLS connection, commands packed in C."""


def fast_connection_class(cls: type[Connection]) -> type[Connection]:
    """The fast class in place of redis-py's ``cls`` (its TLS one or plain one)."""
    if issubclass(cls, _FastPack):
        return cls
    return FastSSLConnection if issubclass(cls, SSLConnection) else FastConnection


def use_on_cluster(cluster: RedisCluster) -> None:
    """Make every node connection of ``cluster`` (made before its first command, or
    found later through ``MOVED`` or a new slot map) pack in C. A RedisCluster has no
    ``connection_class`` argument: its nodes take theirs from the client's
    ``connection_kwargs``, which the nodes manager shares, and the startup nodes were
    already built from it. Checked by ``tests/pod/test_pod_units.py``."""
    kwargs = cluster.connection_kwargs
    kwargs["connection_class"] = fast_connection_class(kwargs.get("connection_class",
                                                                  Connection))
    for node in [*cluster.startup_nodes, *cluster.nodes_manager.startup_nodes.values()]:
        node.connection_class = fast_connection_class(node.connection_class)
