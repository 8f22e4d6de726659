"""Request messages drawn from the protobuf descriptor, and the pools of ids they draw from.

Nothing here names an RPC or a field of ``ctxmem.v1``: every method of the service and
every field of its request type come from ``ctxmem_pb2.DESCRIPTOR``, so a new RPC or a
new field is fuzzed without a change here. What a field holds is picked by its protobuf
type, with a few name hints (``*_id``, ``*token*``, ``keys``, ``namespace_handle``) that
steer values towards what the service will look up: the sender's own ids, another
session's ids (of this tenant or of the victim tenant), random ids, and boundary values
(empty, one byte short or long, very long, invalid enums, extreme integers).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message

from ctxmem_common.proto import ctxmem_pb2 as pb
from ctxmem_common.wire import ID_BYTES

SERVICE_NAME = "ContextMemory"

U32_EDGES = (0, 1, 2, 3, 7, 255, 256, 65535, 1 << 24, (1 << 31) - 1, 1 << 31, (1 << 32) - 1)
U64_EDGES = (*U32_EDGES, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
I32_EDGES = (0, 1, -1, (1 << 31) - 1, -(1 << 31))
I64_EDGES = (*I32_EDGES, (1 << 63) - 1, -(1 << 63))
DOUBLE_EDGES = (0.0, -0.0, 1e308, -1e308, float("inf"), float("-inf"), float("nan"), 1e-320)
STRING_EDGES = ("", "a", "float16", "bfloat16", "default", "victim", "attacker", "CHANGE-ME",
                "\x00", "../../etc/passwd", "é\u202e\U0001f600", "%s%n", "x" * 255)

_SCALAR_U32 = {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32}
_SCALAR_U64 = {FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64}
_SCALAR_I32 = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32,
               FieldDescriptor.TYPE_SFIXED32}
_SCALAR_I64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64,
               FieldDescriptor.TYPE_SFIXED64}


def service_methods() -> list[MethodDescriptor]:
    """Every RPC of the service, from the descriptor (a new RPC is fuzzed automatically)."""
    return list(pb.DESCRIPTOR.services_by_name[SERVICE_NAME].methods)


def method_path(m: MethodDescriptor) -> str:
    """The gRPC path of ``m``, e.g. ``/ctxmem.v1.ContextMemory/Lookup``."""
    return f"/{m.containing_service.full_name}/{m.name}"


@dataclass
class Identity:
    """One session the fuzzer can speak as: its id, token and open namespace handle."""

    session_id: bytes
    token: bytes
    handle: int = 1
    keys: list[bytes] = field(default_factory=list)


@dataclass
class Pools:
    """What the service handed out so far, so cases name real objects (deep paths).

    ``own``: the fuzzer's sessions (tenant "attacker"); ``victims``: the legitimate
    sessions of another tenant, whose ids (never their tokens) the fuzzer sends; the id
    deques hold allocation and lease ids the service returned (bounded)."""

    own: list[Identity]
    victims: list[Identity]
    own_allocations: deque[bytes] = field(default_factory=lambda: deque(maxlen=64))
    own_leases: deque[bytes] = field(default_factory=lambda: deque(maxlen=64))
    victim_ids: deque[bytes] = field(default_factory=lambda: deque(maxlen=64))
    regions: set[tuple[int, int]] = field(default_factory=set)  # (region, generation)
    strings: list[str] = field(default_factory=list)  # tenant names and tokens, model ids

    def remember(self, response: Message) -> None:
        """Keep the allocation/lease ids found in ``response`` for later cases."""
        for fd, value in response.ListFields():
            if fd.type == FieldDescriptor.TYPE_BYTES and fd.name == "allocation_id" and value:
                self.own_allocations.append(value)
            elif fd.type == FieldDescriptor.TYPE_BYTES and fd.name == "lease_id" and value:
                self.own_leases.append(value)
            elif fd.name == "slots" and len(self.regions) < 256:
                self.regions.update((s.region, s.generation) for s in value)


class MessageFuzzer:
    """Builds random instances of a request type for one sender ``me`` (seeded)."""

    def __init__(self, rng: random.Random, pools: Pools, max_repeated: int = 20_000) -> None:
        self.rng = rng
        self.pools = pools
        self.max_repeated = max_repeated

    # -- ids, keys, tokens ------------------------------------------------------------
    def random_bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def odd_bytes(self) -> bytes:
        """Boundary byte strings: empty, one short or long of an id, zeros, very long."""
        r = self.rng
        return r.choice((
            b"", b"\x00", b"\x00" * ID_BYTES, b"\xff" * ID_BYTES,
            self.random_bytes(ID_BYTES - 1), self.random_bytes(ID_BYTES + 1),
            self.random_bytes(r.choice((64, 4096, 65536))),
        ))

    def an_id(self, me: Identity) -> bytes:
        """A session/allocation/lease id: mostly real ones (own or others'), else odd."""
        p, r = self.pools, self.rng
        choices: list[Sequence[bytes]] = [
            [me.session_id] * 4,
            [i.session_id for i in p.own],
            [v.session_id for v in p.victims],
            list(p.own_allocations) or [me.session_id],
            list(p.own_leases) or [me.session_id],
            list(p.victim_ids) or [self.random_bytes(ID_BYTES)],
        ]
        pick = r.random()
        if pick < 0.8:
            return r.choice(r.choice(choices))
        if pick < 0.9:
            return self.random_bytes(ID_BYTES)
        return self.odd_bytes()

    def a_key(self, me: Identity) -> bytes:
        """A block key: the sender's or a victim's real key, a random 32-byte key, or odd."""
        r = self.rng
        pick = r.random()
        if pick < 0.35 and me.keys:
            return r.choice(me.keys)
        if pick < 0.55:
            victim = r.choice(self.pools.victims)
            if victim.keys:
                return r.choice(victim.keys)
        if pick < 0.9:
            return self.random_bytes(32)
        return self.odd_bytes()

    def a_token(self, me: Identity) -> bytes:
        """A token carried inside a message (RdmaInfo/RdmaAttach) or as metadata."""
        r = self.rng
        pick = r.random()
        if pick < 0.6:
            return me.token
        if pick < 0.75:
            return r.choice(self.pools.own).token
        if pick < 0.9:
            return self.random_bytes(ID_BYTES)
        return self.odd_bytes()

    # -- scalars ------------------------------------------------------------------------
    def a_string(self) -> str:
        r = self.rng
        pick = r.random()
        if pick < 0.3 and self.pools.strings:
            return r.choice(self.pools.strings)
        if pick < 0.6:
            return r.choice(STRING_EDGES)
        if pick < 0.9:
            return "".join(chr(r.randrange(32, 0x2FF)) for _ in range(r.randrange(1, 40)))
        return "k" * r.choice((1024, 65536, 1 << 20))

    def an_int(self, fd: FieldDescriptor) -> int:
        r = self.rng
        edges: tuple[int, ...]
        if fd.type in _SCALAR_U32:
            edges, lo, hi = U32_EDGES, 0, (1 << 32) - 1
        elif fd.type in _SCALAR_U64:
            edges, lo, hi = U64_EDGES, 0, (1 << 64) - 1
        elif fd.type in _SCALAR_I32:
            edges, lo, hi = I32_EDGES, -(1 << 31), (1 << 31) - 1
        else:
            edges, lo, hi = I64_EDGES, -(1 << 63), (1 << 63) - 1
        pick = r.random()
        if pick < 0.4:
            return r.choice(edges)
        if pick < 0.8:
            return max(lo, min(hi, r.randrange(0, 130)))
        return r.randint(lo, hi)

    def an_enum(self, fd: FieldDescriptor) -> int:
        values = [v.number for v in fd.enum_type.values]
        if self.rng.random() < 0.75:
            return self.rng.choice(values)
        return self.rng.choice((max(values) + 1, 99, (1 << 31) - 1, -1, -(1 << 31)))

    def scalar(self, fd: FieldDescriptor, me: Identity) -> Any:
        """A value for one (non-message) field, steered by its name."""
        t, name = fd.type, fd.name
        if t == FieldDescriptor.TYPE_BYTES:
            if "token" in name:
                return self.a_token(me)
            if name == "session_id" and self.rng.random() < 0.7:
                return me.session_id  # past the auth check more often: deeper paths
            if name.endswith("_id") or name.endswith("_ids"):
                return self.an_id(me)
            if "key" in name:
                return self.a_key(me)
            return self.random_bytes(self.rng.choice((0, 1, 16, 32, 4096)))
        if t == FieldDescriptor.TYPE_STRING:
            return self.a_string()
        if t == FieldDescriptor.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == FieldDescriptor.TYPE_ENUM:
            return self.an_enum(fd)
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            v = self.rng.choice((*DOUBLE_EDGES, self.rng.uniform(-1000000.0, 1000000.0)))
            return v if t == FieldDescriptor.TYPE_DOUBLE or abs(v) < 3e38 or v != v else 0.0
        if name == "namespace_handle" and self.rng.random() < 0.7:
            return self.rng.choice((me.handle, me.handle, 0, 2))
        return self.an_int(fd)

    # -- messages -----------------------------------------------------------------------
    def repeat_count(self) -> int:
        r = self.rng
        pick = r.random()
        if pick < 0.15:
            return 0
        if pick < 0.85:
            return r.randrange(1, 9)
        if pick < 0.98:
            return r.randrange(9, 300)
        return r.randrange(300, self.max_repeated + 1)

    def fill(self, msg: Message, me: Identity, depth: int = 0) -> Message:
        """Set a random subset of ``msg``'s fields (every field of a top-level request
        more often than not, so the service gets past its first checks)."""
        desc: Descriptor = msg.DESCRIPTOR
        for fd in desc.fields:
            if self.rng.random() < (0.15 if depth == 0 else 0.3):
                continue  # left unset: the default
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                self._fill_map(getattr(msg, fd.name), fd, me)
            elif fd.is_repeated:
                self._fill_repeated(getattr(msg, fd.name), fd, me)
            elif fd.message_type is not None:
                if depth < 3:
                    self.fill(getattr(msg, fd.name), me, depth + 1)
            else:
                setattr(msg, fd.name, self.scalar(fd, me))
        return msg

    def _fill_repeated(self, target: Any, fd: FieldDescriptor, me: Identity) -> None:
        n = self.repeat_count()
        if fd.message_type is not None:
            for _ in range(min(n, 64)):
                self.fill(target.add(), me, 1)
            return
        if n > 300 and fd.type in (FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING):
            # Huge lists: one value of at most 64 bytes repeated (cheap to build; a few
            # MiB on the wire, within the service's 64 MiB message limit).
            target.extend([self.scalar(fd, me)[:64]] * n)
            return
        target.extend(self.scalar(fd, me) for _ in range(n))

    def _fill_map(self, target: Any, fd: FieldDescriptor, me: Identity) -> None:
        key_fd = fd.message_type.fields_by_name["key"]
        value_fd = fd.message_type.fields_by_name["value"]
        for _ in range(min(self.repeat_count(), 200)):
            key = self.scalar(key_fd, me)
            if value_fd.message_type is not None:
                self.fill(target[key], me, 1)
            else:
                target[key] = self.scalar(value_fd, me)

    def request(self, m: MethodDescriptor, me: Identity) -> bytes:
        """The serialized request of one case for ``m``; 5% are raw byte mutations of a
        valid serialization (bit flips, truncation, random bytes): malformed protobuf."""
        from google.protobuf import message_factory

        cls = message_factory.GetMessageClass(m.input_type)
        data = self.fill(cls(), me).SerializeToString()
        if self.rng.random() < 0.05:
            data = mutate_bytes(self.rng, data)
        return data


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """One random mutation of ``data``: bit flips, truncation, extension or random bytes."""
    buf = bytearray(data)
    pick = rng.randrange(5)
    if pick == 0 and buf:
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif pick == 1 and buf:
        del buf[rng.randrange(len(buf)):]
    elif pick == 2:
        buf += rng.randbytes(rng.randrange(1, 64))
    elif pick == 3:
        return rng.randbytes(rng.randrange(0, 256))
    elif buf:
        i = rng.randrange(len(buf))
        buf[i:i] = rng.choice((b"\xff" * 10, b"\x80" * 11, b"\x0a\xff\xff\xff\xff\x0f"))
    return bytes(buf)
