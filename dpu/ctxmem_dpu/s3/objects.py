"""S3 objects as ctxmem blocks (docs/s3.md, "Layout").

A bucket is two namespaces of the access key's tenant, model id ``s3/BUCKET``: one of
manifest blocks (:data:`MANIFEST_BYTES` each, tag ``ctxmem.s3=meta``) and one of data
chunks (``s3.chunk_size`` each, tag ``ctxmem.s3=data``). An object is a manifest under
``b"o" + KEY`` (``b"h" + sha256(KEY)`` for a key of 64 bytes or more: the block key
limit) naming its parts, and each part is ``ceil(size / chunk_size)`` data chunks under
``b"d" + PART_ID + INDEX`` (a random 16-byte id per part written: blocks are immutable,
so an overwrite writes new chunks, then the new manifest, then deletes the old chunks).

Every byte goes through the store's own put and get paths (allocate, commit, acquire):
quotas, encryption at rest, authenticators, write-back and the pod apply as to any
block: in a pod a GET pulls chunks other nodes hold first (as a gRPC Acquire does), and a
DELETE reaches every node's index before it answers (as a gRPC Delete does). Like any
block, an object may be evicted under pressure (a cache, not a durable object store): a
GET then answers NoSuchKey.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import struct
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass, field

from ctxmem_common.config import Config
from ctxmem_common.keys import MAX_KEY_BYTES
from ctxmem_common.layout import KVLayout
from ctxmem_dpu.blocks import Block, Lease, Namespace, Session
from ctxmem_dpu.store import BlockStore

__all__ = ["MANIFEST_BYTES", "Manifest", "ObjectStore", "S3Error", "Upload"]

MANIFEST_BYTES = 64 << 10
_LEN = struct.Struct("<I")
_PIECE = 8  # data chunks leased (and pinned) at a time by a GET


class S3Error(Exception):
    """An S3 error answer: HTTP ``status``, S3 ``code``, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _layout(nbytes: int) -> KVLayout:
    """A layout whose block is ``nbytes`` (even) bytes: one layer, one token, uint8."""
    return KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1, head_dim=nbytes // 2,
                    tokens_per_block=1)


def manifest_key(key: str) -> bytes:
    raw = key.encode()
    return b"o" + raw if len(raw) < MAX_KEY_BYTES else b"h" + hashlib.sha256(raw).digest()


def chunk_keys(part_id: bytes, size: int, chunk: int) -> list[bytes]:
    return [b"d" + part_id + i.to_bytes(4, "big") for i in range(-(-size // chunk))]


@dataclass
class Manifest:
    key: str
    size: int
    etag: str
    mtime: float
    parts: list[tuple[bytes, int]]  # (part id, size) in order
    content_type: str = "binary/octet-stream"

    def encode(self) -> bytes:
        doc = json.dumps({"k": self.key, "n": self.size, "e": self.etag, "t": self.mtime,
                          "c": self.content_type,
                          "p": [[pid.hex(), n] for pid, n in self.parts]},
                         separators=(",", ":")).encode()
        if _LEN.size + len(doc) > MANIFEST_BYTES:
            raise S3Error(400, "InvalidRequest",
                          f"the object's manifest ({len(doc)} bytes for {len(self.parts)} "
                          f"parts) exceeds {MANIFEST_BYTES - _LEN.size} bytes; use fewer, "
                          f"larger parts")
        return _LEN.pack(len(doc)) + doc

    @classmethod
    def decode(cls, raw: memoryview) -> Manifest:
        (n,) = _LEN.unpack_from(raw)
        doc = json.loads(bytes(raw[_LEN.size:_LEN.size + n]))
        return cls(doc["k"], doc["n"], doc["e"], doc["t"],
                   [(bytes.fromhex(p), int(s)) for p, s in doc["p"]], doc.get("c", ""))


@dataclass
class Upload:
    """A multipart upload in progress (kept in memory: a restart forgets it)."""

    tenant: str
    bucket: str
    key: str
    created: float
    content_type: str
    parts: dict[int, tuple[bytes, int, bytes]] = field(default_factory=dict)  # id, size, md5


# A body source: fills the view given, in order, to its end (raises when it falls short).
Filler = Callable[[memoryview], Awaitable[None]]


class ObjectStore:
    """Objects of every tenant's buckets over one :class:`BlockStore`."""

    def __init__(self, store: BlockStore, cfg: Config) -> None:
        self.store = store
        self.chunk = int(cfg.s3.chunk_size)
        self._tokens = cfg.service.tenant_tokens
        self._transport = cfg.service.transports[0]
        self._data_layout = _layout(self.chunk)
        self._meta_layout = _layout(MANIFEST_BYTES)
        self.uploads: dict[str, Upload] = {}
        self.max_uploads = cfg.s3.max_uploads
        # Set by the service in a pod (PodNode's fetch.pull and confirm_delete): chunks
        # other nodes hold come in before a read, deletes reach the cluster index.
        self.pull: Callable[[Namespace, Sequence[bytes]], Awaitable[int]] | None = None
        self.confirm_delete: Callable[[bytes, Sequence[bytes]], Awaitable[None]] | None = None
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}

    # -- sessions, namespaces, locks -----------------------------------------------------
    @contextlib.contextmanager
    def session(self, tenant: str) -> Iterator[Session]:
        """A session of ``tenant`` for one request (the store's quotas and limits apply);
        ended, with anything it still holds, when the request ends."""
        s = self.store.connect(tenant, self._tokens.get(tenant, ""), self._transport, "s3")
        try:
            yield s
        finally:
            self.store.close_session(s)

    def namespaces(self, s: Session, bucket: str) -> tuple[Namespace, Namespace]:
        """The bucket's (manifest, data) namespaces for ``s``'s tenant."""
        model = f"s3/{bucket}"
        _, meta = self.store.open_namespace(s, model, self._meta_layout, {"ctxmem.s3": "meta"})
        _, data = self.store.open_namespace(s, model, self._data_layout, {"ctxmem.s3": "data"})
        return meta, data

    @contextlib.asynccontextmanager
    async def locked(self, tenant: str, bucket: str, key: str) -> AsyncIterator[None]:
        """One writer at a time per object (manifest replace and its chunks' delete)."""
        ident = (tenant, bucket, key)
        lock = self._locks.setdefault(ident, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._locks.get(ident) is lock:
                del self._locks[ident]

    # -- blocks --------------------------------------------------------------------------
    async def _put_blocks(self, s: Session, ns: Namespace, keys: list[bytes],
                          fill: Filler, sizes: list[int]) -> None:
        """Store ``keys`` (new), block i filled with ``sizes[i]`` bytes from ``fill`` and
        zero padding; committed only once every byte has arrived."""
        if not keys:
            return
        store = self.store
        a, exists = await store.allocate(s, ns, keys)
        if any(exists):
            await store.commit(s, a.id, [], True)
            raise S3Error(500, "InternalError", "a fresh chunk key already exists; retry")
        ok = False
        try:
            with store.writing(a):
                for ref, n in zip(a.slots, sizes, strict=True):
                    view = store.dram.view(ref, ns.block_nbytes)
                    try:
                        await fill(view[:n])
                        if n < len(view):
                            view[n:] = bytes(len(view) - n)  # no other block's bytes
                    finally:
                        view.release()
            ok = True
        finally:
            if not ok:
                with contextlib.suppress(Exception):
                    await store.commit(s, a.id, [], True)
        done = await store.commit(s, a.id, [], False)
        if done != len(keys):
            raise S3Error(503, "SlowDown", f"{len(keys) - done} of {len(keys)} blocks were "
                          f"not committed (a write-through flash write failed?); retry")

    async def acquire(self, s: Session, ns: Namespace,
                      keys: list[bytes]) -> tuple[Lease, list[str]]:
        """The store's Acquire, after pulling what other pod nodes hold (in a pod)."""
        if self.pull is not None:
            await self.pull(ns, keys)
        return await self.store.acquire(s, ns, keys)

    async def delete(self, ns: Namespace, keys: list[bytes]) -> int:
        """The store's Delete; in a pod, this node's index entries are gone too before it
        returns, so no node serves a copy fetched from them."""
        n = await self.store.delete(ns, keys)
        if self.confirm_delete is not None:
            await self.confirm_delete(ns.digest, keys)
        return n

    async def read_manifest(self, s: Session, meta: Namespace, key: str) -> Manifest | None:
        return await self._manifest_at(s, meta, manifest_key(key), key)

    async def _manifest_at(self, s: Session, meta: Namespace, mkey: bytes,
                           key: str | None) -> Manifest | None:
        lease, _ = await self.acquire(s, meta, [mkey])
        try:
            if not lease.blocks:
                return None
            b = lease.blocks[0]
            assert b.dram is not None
            view = self.store.dram.view(b.dram, b.length)
            try:
                m = Manifest.decode(view)
            finally:
                view.release()
        finally:
            self.store.release(s, [lease.id])
        return m if key is None or m.key == key else None  # a hashed key's collision: miss

    async def _write_manifest(self, s: Session, meta: Namespace, m: Manifest) -> None:
        raw = m.encode()
        pos = 0

        async def fill(view: memoryview) -> None:
            nonlocal pos
            view[:] = raw[pos:pos + len(view)]
            pos += len(view)

        mkey = manifest_key(m.key)
        await self.delete(meta, [mkey])
        await self._put_blocks(s, meta, [mkey], fill, [len(raw)])

    async def _drop_parts(self, data: Namespace, parts: list[tuple[bytes, int]]) -> None:
        keys = [k for pid, n in parts for k in chunk_keys(pid, n, self.chunk)]
        for i in range(0, len(keys), 4096):
            await self.delete(data, keys[i:i + 4096])

    # -- objects -------------------------------------------------------------------------
    async def put_part(self, s: Session, data: Namespace, size: int,
                       fill: Filler) -> bytes:
        """A part (or a whole object's bytes) as new chunks; returns its part id."""
        part_id = secrets.token_bytes(16)
        keys = chunk_keys(part_id, size, self.chunk)
        sizes = [min(self.chunk, size - i * self.chunk) for i in range(len(keys))]
        await self._put_blocks(s, data, keys, fill, sizes)
        return part_id

    async def commit_object(self, s: Session, bucket: str, m: Manifest) -> None:
        """Make ``m`` the object's manifest, then drop the chunks it replaces."""
        meta, data = self.namespaces(s, bucket)
        old = await self.read_manifest(s, meta, m.key)
        await self._write_manifest(s, meta, m)
        if old is not None:
            await self._drop_parts(data, old.parts)

    async def delete_object(self, s: Session, bucket: str, key: str) -> None:
        meta, data = self.namespaces(s, bucket)
        old = await self.read_manifest(s, meta, key)
        if old is None:
            return
        await self.delete(meta, [manifest_key(key)])
        await self._drop_parts(data, old.parts)

    def spans(self, m: Manifest, start: int, end: int) -> list[tuple[bytes, int, int]]:
        """(chunk key, first byte, end byte) within each chunk of bytes
        ``[start, end)`` of the object."""
        out: list[tuple[bytes, int, int]] = []
        at = 0
        for pid, n in m.parts:
            if at + n > start and at < end:
                for i, k in enumerate(chunk_keys(pid, n, self.chunk)):
                    c0 = at + i * self.chunk
                    c1 = c0 + min(self.chunk, n - i * self.chunk)
                    if c1 > start and c0 < end:
                        out.append((k, max(start, c0) - c0, min(end, c1) - c0))
            at += n
        return out

    async def read_spans(self, s: Session, data: Namespace,
                         spans: list[tuple[bytes, int, int]]) -> AsyncGenerator[bytes, None]:
        """The bytes of ``spans`` in order, a chunk at a time, read through the store's
        get path (flash blocks promoted); S3Error NoSuchKey when a chunk is gone."""
        store = self.store
        i = 0
        while i < len(spans):
            piece = spans[i:i + _PIECE]
            lease, _ = await self.acquire(s, data, [k for k, _, _ in piece])
            blocks: list[Block] = list(lease.blocks)
            for b in blocks:  # held past the lease's TTL while a slow client reads
                store.pin(b)
            store.release(s, [lease.id])
            done = 0
            try:
                if not blocks:
                    raise S3Error(404, "NoSuchKey", "a chunk of the object was evicted; the "
                                  "object is gone (ctxmem is a cache tier)")
                for b, (_, lo, hi) in zip(blocks, piece, strict=False):
                    assert b.dram is not None
                    view = store.dram.view(b.dram, b.length)
                    try:
                        chunk = bytes(view[lo:hi])
                    finally:
                        view.release()
                    store.unpin(b)
                    done += 1
                    yield chunk
            finally:
                for b in blocks[done:]:
                    store.unpin(b)
            i += len(blocks)

    async def list_names(self, s: Session, meta: Namespace, prefix: str
                         ) -> dict[str, bytes]:
        """Every object name in the bucket under ``prefix`` → its manifest key (hashed
        names read from their manifests)."""
        per_ns = self.store.index.get(meta.digest, {})
        out: dict[str, bytes] = {}
        raw_prefix = prefix.encode()
        for mkey in list(per_ns):
            if mkey[:1] == b"o":
                if mkey[1:].startswith(raw_prefix):
                    with contextlib.suppress(UnicodeDecodeError):
                        out[mkey[1:].decode()] = mkey
            else:
                m = await self._manifest_at(s, meta, mkey, None)
                if m is not None and m.key.startswith(prefix):
                    out[m.key] = mkey
        return out

    async def manifest_of(self, s: Session, meta: Namespace, mkey: bytes
                          ) -> Manifest | None:
        return await self._manifest_at(s, meta, mkey, None)

    async def drop_upload(self, s: Session, upload_id: str) -> None:
        up = self.uploads.pop(upload_id, None)
        if up is None:
            return
        _, data = self.namespaces(s, up.bucket)
        await self._drop_parts(data, [(pid, n) for pid, n, _ in up.parts.values()])

