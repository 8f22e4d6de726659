"""The on-flash structures: superblock, slab header, record header, their offsets, and
the record-header table parsed and built column-wise with numpy.

Pure format code (no I/O); :mod:`ctxmem_common.flash_format.reader` reads them from a
device. The layout and the reasons for it are in the package docstring.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple

import crc32c as _crc32c
import numpy as np

from ctxmem_common.codecs import crc32c, crc32c_many
from ctxmem_common.codecs.blockauth import TAG_BYTES

if TYPE_CHECKING:
    from typing_extensions import Buffer

SECTOR = 4096
DATA_START = 1 << 20
FORMAT_VERSION = 1
# The record header's own version (the superblock and slab header stay at FORMAT_VERSION):
# 2 carries the block authenticator (TAG_BYTES after the write time, under the header
# CRC). A record of version 1 (CRC32C only, before authenticators) is never served:
# ``parse_header_columns`` and ``RecordHeader.unpack`` skip it, ``legacy_slots`` finds it.
REC_VERSION = 2
REC_VERSION_CRC_ONLY = 1
SB_OFFSET = 0
SB_BACKUP_OFFSET = SECTOR
PROBE_OFFSET = 2 * SECTOR
OWNER_OFFSET = 3 * SECTOR
# The pod nodes' heartbeat slots on a shared device: one sector per node, from here to
# DATA_START (a node's slot: the first, probing from crc32c(node id), that names it or is
# empty). A live node advances its counter; a taker watches it (ctxmem_dpu.pod).
BEAT_OFFSET = 4 * SECTOR
BEAT_SLOTS = (DATA_START - BEAT_OFFSET) // SECTOR

SB_MAGIC = b"CTXMEMSB"
SLAB_MAGIC = b"CTXSLAB1"
REC_MAGIC = b"CTXREC01"
SLAB_EXT_MAGIC = b"CTXSLABX"
OWNER_MAGIC = b"CTXOWNR1"
OWNER_BEAT_MAGIC = b"CTXOWNRB"
BEAT_MAGIC = b"CTXBEAT1"

_SB = struct.Struct("<8sIQI16s")  # magic, version, slab_size, num_slabs, uuid
_SLAB = struct.Struct("<8sIQI")  # magic, version, slot_size, slots
# The slab header's extension (after the header's CRC; a reader of the first format
# ignores it): magic, device UUID, slab size, slab count — what ``ctxmem check --repair``
# rebuilds a lost superblock pair from.
_SLAB_EXT = struct.Struct("<8s16sQQ")
_SLAB_EXT_AT = _SLAB.size + 4
# The shared-flash extension (after the first extension's CRC; absent on a device only one
# service writes): magic, the owning pod node's id (UTF-8, zero-padded), its fencing epoch
# for this slab (ctxmem_dpu.pod.slab_leases). Readers of older headers ignore it.
_SLAB_POD = struct.Struct("<8s64sQ")
_SLAB_POD_AT = _SLAB_EXT_AT + _SLAB_EXT.size + 4
SLAB_POD_MAGIC = b"CTXSLABP"
# The owner record: magic, service instance, pid, process start (clock ticks since boot),
# lease expiry (wall clock, ns), boot id, host name.
_OWNER = struct.Struct("<8s16sIQQ16s64s")
# The owner record's heartbeat extension (after its CRC; a reader of the first format
# ignores it): magic, a counter the live owner advances at every refresh.
_OWNER_BEAT = struct.Struct("<8sQ")
_OWNER_BEAT_AT = _OWNER.size + 4
# A pod node's heartbeat: magic, node id, counter, pid, process start, boot id, host.
_BEAT = struct.Struct("<8s64sQIQ16s64s")
_REC_V1 = struct.Struct("<8sHHI16sB64sQIQQ")  # version 1 (no authenticator)
_REC = struct.Struct(f"<8sHHI16sB64sQIQQ{TAG_BYTES}s")
_CRC = struct.Struct("<I")
FLAG_ENCRYPTED = 1
# The payload is encrypted at rest BELOW ctxmem, by the device's storage layer (an SPDK
# crypto bdev: software AES-XTS in SPDK's accel framework, or the BlueField's hardware):
# ctxmem wrote plaintext through it. With FLAG_ENCRYPTED the two bits say which layer
# encrypted; readers that predate this bit ignore it (the payload they read is plaintext).
FLAG_DEVICE_ENCRYPTED = 2
REC_BODY = _REC.size  # bytes covered by the header CRC
REC_SIZE = _REC.size + _CRC.size
# Byte offsets of record-header fields (for tools that patch headers on purpose).
REC_OFF_NAMESPACE = 16
REC_OFF_KEYLEN = 32
REC_OFF_KEY = 33
REC_OFF_LENGTH = 97
REC_OFF_CRC = 105
REC_OFF_SEQ = 109
REC_OFF_TAG = _REC_V1.size  # 125: the authenticator (nonce, tag), then the header CRC
_REC_MAGIC_U64 = int.from_bytes(REC_MAGIC, "little")


@dataclass(frozen=True, slots=True)
class Superblock:
    slab_size: int
    num_slabs: int
    device_uuid: bytes

    def pack(self) -> bytes:
        body = _SB.pack(SB_MAGIC, FORMAT_VERSION, self.slab_size, self.num_slabs, self.device_uuid)
        return (body + _CRC.pack(crc32c(body))).ljust(SECTOR, b"\0")

    def pack_pair(self) -> bytes:
        """Both copies, primary then backup: the 8 KiB written at ``SB_OFFSET``. They are
        always written together, so a sound pair never differs."""
        return self.pack() * 2

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Superblock | None:
        body = bytes(raw[: _SB.size])
        magic, version, slab_size, num_slabs, dev_uuid = _SB.unpack(body)
        (crc,) = _CRC.unpack_from(raw, _SB.size)
        if magic != SB_MAGIC or crc != crc32c(body) or version != FORMAT_VERSION:
            return None
        if slab_size < SECTOR or slab_size % SECTOR:
            return None
        return cls(slab_size, num_slabs, dev_uuid)

    @classmethod
    def new(cls, slab_size: int, device_bytes: int) -> Superblock:
        num = max(0, (device_bytes - DATA_START) // slab_size)
        return cls(slab_size, num, uuid.uuid4().bytes)

    @property
    def tweak_id(self) -> int:
        """The device part of the XTS tweak: moving ciphertext between devices breaks it."""
        return int.from_bytes(self.device_uuid[:8], "little")


@dataclass(frozen=True, slots=True)
class SlabHeader:
    """A slab's header. ``device_uuid``/``slab_size``/``num_slabs`` are the device's
    geometry as its superblock said when the slab was assigned (the extension; empty and
    0 in a header written before it existed): they let ``ctxmem check --repair`` rebuild
    a superblock pair that is lost, UUID included (the XTS tweak depends on it)."""

    slot_size: int
    slots: int
    device_uuid: bytes = b""
    slab_size: int = 0
    num_slabs: int = 0
    # Shared flash (several services of a pod write one device): the node that holds the
    # slab's lease and its fencing epoch; "" and 0 on a device one service owns.
    owner: str = ""
    epoch: int = 0

    def pack(self) -> bytes:
        body = _SLAB.pack(SLAB_MAGIC, FORMAT_VERSION, self.slot_size, self.slots)
        out = body + _CRC.pack(crc32c(body))
        if self.device_uuid:
            ext = _SLAB_EXT.pack(SLAB_EXT_MAGIC, self.device_uuid, self.slab_size,
                                 self.num_slabs)
            out += ext + _CRC.pack(crc32c(ext))
            if self.owner:
                pod = _SLAB_POD.pack(SLAB_POD_MAGIC, self.owner.encode()[:64], self.epoch)
                out += pod + _CRC.pack(crc32c(pod))
        return out.ljust(SECTOR, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> SlabHeader | None:
        body = bytes(raw[: _SLAB.size])
        magic, version, slot_size, slots = _SLAB.unpack(body)
        (crc,) = _CRC.unpack_from(raw, _SLAB.size)
        if magic != SLAB_MAGIC or crc != crc32c(body) or version != FORMAT_VERSION:
            return None
        ext = bytes(raw[_SLAB_EXT_AT : _SLAB_EXT_AT + _SLAB_EXT.size])
        (ext_crc,) = _CRC.unpack_from(raw, _SLAB_EXT_AT + _SLAB_EXT.size)
        emagic, dev_uuid, slab_size, num_slabs = _SLAB_EXT.unpack(ext)
        if emagic != SLAB_EXT_MAGIC or ext_crc != crc32c(ext):
            return cls(slot_size, slots)  # written before the extension existed
        pod = bytes(raw[_SLAB_POD_AT : _SLAB_POD_AT + _SLAB_POD.size])
        (pod_crc,) = _CRC.unpack_from(raw, _SLAB_POD_AT + _SLAB_POD.size)
        pmagic, owner, epoch = _SLAB_POD.unpack(pod)
        if pmagic != SLAB_POD_MAGIC or pod_crc != crc32c(pod):
            return cls(slot_size, slots, dev_uuid, slab_size, num_slabs)
        return cls(slot_size, slots, dev_uuid, slab_size, num_slabs,
                   owner.rstrip(b"\0").decode(errors="replace"), epoch)

    def for_device(self, sb: Superblock) -> SlabHeader:
        """This header carrying ``sb``'s geometry (what the service writes)."""
        return SlabHeader(self.slot_size, self.slots, sb.device_uuid, sb.slab_size,
                          sb.num_slabs, self.owner, self.epoch)

    def owned_by(self, owner: str, epoch: int) -> SlabHeader:
        """This header naming ``owner`` (a pod node) at fencing ``epoch`` (shared flash)."""
        return SlabHeader(self.slot_size, self.slots, self.device_uuid, self.slab_size,
                          self.num_slabs, owner, epoch)

    def superblock(self) -> Superblock | None:
        """The superblock this header's extension describes, or ``None`` without one."""
        if not self.device_uuid or self.slab_size < SECTOR or self.slab_size % SECTOR:
            return None
        return Superblock(self.slab_size, self.num_slabs, self.device_uuid)


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    """Who has a device open: the service instance, its process (pid and start time on
    host ``host`` in boot ``boot_id``) and the wall-clock time its lease ends. Kept in the
    owner sector (``OWNER_OFFSET``), so every path to the same bytes (a file and a loop
    device over it, two device nodes) sees it; zero when no service has the device."""

    instance: bytes
    pid: int
    start_ticks: int
    expires_ns: int
    boot_id: bytes
    host: str
    # The heartbeat: advanced by every refresh of a live owner (0: a record without it).
    beat: int = 0

    def pack(self) -> bytes:
        body = _OWNER.pack(OWNER_MAGIC, self.instance, self.pid, self.start_ticks,
                           self.expires_ns, self.boot_id, self.host.encode()[:64])
        ext = _OWNER_BEAT.pack(OWNER_BEAT_MAGIC, self.beat)
        return (body + _CRC.pack(crc32c(body)) + ext + _CRC.pack(crc32c(ext))
                ).ljust(SECTOR, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> OwnerRecord | None:
        """The record in ``raw``, or ``None`` (no owner: zero, torn or foreign)."""
        body = bytes(raw[: _OWNER.size])
        (crc,) = _CRC.unpack_from(raw, _OWNER.size)
        magic, inst, pid, ticks, expires, boot, host = _OWNER.unpack(body)
        if magic != OWNER_MAGIC or crc != crc32c(body):
            return None
        ext = bytes(raw[_OWNER_BEAT_AT : _OWNER_BEAT_AT + _OWNER_BEAT.size])
        (ext_crc,) = _CRC.unpack_from(raw, _OWNER_BEAT_AT + _OWNER_BEAT.size)
        bmagic, beat = _OWNER_BEAT.unpack(ext)
        if bmagic != OWNER_BEAT_MAGIC or ext_crc != crc32c(ext):
            beat = 0
        return cls(inst, pid, ticks, expires, boot, host.rstrip(b"\0").decode(errors="replace"),
                   beat)


@dataclass(frozen=True, slots=True)
class NodeBeat:
    """A pod node's heartbeat on a shared device (one sector in the slots from
    ``BEAT_OFFSET``): its node id, a counter it advances while it lives, and its process
    (pid and start time on ``host`` in boot ``boot_id``: a same-host taker checks it)."""

    node: str
    beat: int
    pid: int
    start_ticks: int
    boot_id: bytes
    host: str

    def pack(self) -> bytes:
        body = _BEAT.pack(BEAT_MAGIC, self.node.encode()[:64], self.beat, self.pid,
                          self.start_ticks, self.boot_id, self.host.encode()[:64])
        return (body + _CRC.pack(crc32c(body))).ljust(SECTOR, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> NodeBeat | None:
        """The heartbeat in ``raw``, or ``None`` (an empty slot, torn or foreign)."""
        body = bytes(raw[: _BEAT.size])
        (crc,) = _CRC.unpack_from(raw, _BEAT.size)
        magic, node, beat, pid, ticks, boot, host = _BEAT.unpack(body)
        if magic != BEAT_MAGIC or crc != crc32c(body):
            return None
        return cls(node.rstrip(b"\0").decode(errors="replace"), beat, pid, ticks, boot,
                   host.rstrip(b"\0").decode(errors="replace"))


def slots_per_slab(slab_size: int, slot_size: int) -> int:
    """Slots of ``slot_size`` that fit in a slab with its header and header table."""
    if slot_size <= 0 or slot_size % SECTOR:
        return 0
    return max(0, (slab_size - SECTOR) // (SECTOR + slot_size))


def max_table_slots(slab_size: int) -> int:
    """The most header-table entries any slab of ``slab_size`` has (4 KiB slots): what to
    read when a slab's header is damaged and its slot size is unknown."""
    return max(0, (slab_size - SECTOR) // (2 * SECTOR))


def slab_base(slab: int, slab_size: int) -> int:
    """Byte offset of slab ``slab`` (its header) on the device."""
    return DATA_START + slab * slab_size


def header_offset(slab: int, index: int, slab_size: int) -> int:
    """Byte offset of slot ``index``'s record header in ``slab``."""
    return slab_base(slab, slab_size) + SECTOR + index * SECTOR


def payload_offset(slab: int, index: int, slab_size: int, slot_size: int) -> int:
    """Byte offset of slot ``index``'s payload in a slab of ``slot_size`` slots."""
    capacity = slots_per_slab(slab_size, slot_size)
    return slab_base(slab, slab_size) + SECTOR + capacity * SECTOR + index * slot_size


@dataclass(frozen=True, slots=True)
class RecordHeader:
    namespace: bytes
    key: bytes
    length: int
    crc: int
    seq: int
    encrypted: bool
    committed_ns: int = 0
    # The namespace cipher's check value (XtsCipher.check_value) of an encrypted record,
    # in the header's former pad field; 0 when not recorded (unencrypted, or older).
    key_check: int = 0
    # Encrypted at rest by the device's storage layer (FLAG_DEVICE_ENCRYPTED).
    device_encrypted: bool = False
    # The block authenticator (ctxmem_common.codecs.blockauth, TAG_BYTES): a MAC under the
    # namespace's key over the payload's plaintext, binding the key and the record's place
    # (:func:`record_context`); empty (packed as zeros, which never verify) when not made.
    tag: bytes = b""

    def pack(self) -> bytes:
        body = _REC.pack(
            REC_MAGIC,
            REC_VERSION,
            (FLAG_ENCRYPTED if self.encrypted else 0)
            | (FLAG_DEVICE_ENCRYPTED if self.device_encrypted else 0),
            self.key_check,
            self.namespace,
            len(self.key),
            self.key,
            self.length,
            self.crc,
            self.seq,
            self.committed_ns,
            self.tag,
        )
        return (body + _CRC.pack(crc32c(body))).ljust(SECTOR, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> RecordHeader | None:
        """The header in ``raw``, or ``None`` for an empty, torn or foreign entry, or a
        record of version 1 (no authenticator: never served; :func:`record_version`)."""
        if len(raw) < REC_SIZE or bytes(raw[:8]) != REC_MAGIC:
            return None
        body = bytes(raw[: _REC.size])
        (crc,) = _CRC.unpack_from(raw, _REC.size)
        if crc != crc32c(body):
            return None
        _m, version, flags, kcv, ns, klen, key, length, dcrc, seq, ts, tag = _REC.unpack(body)
        if version != REC_VERSION or not 1 <= klen <= 64:
            return None
        return cls(ns, key[:klen], length, dcrc, seq, bool(flags & FLAG_ENCRYPTED), ts, kcv,
                   bool(flags & FLAG_DEVICE_ENCRYPTED), tag if tag != _NO_TAG else b"")


def record_version(raw: bytes | memoryview) -> int:
    """The version of the valid record header in ``raw`` (its magic, version and CRC32C
    at that version's place): :data:`REC_VERSION`, :data:`REC_VERSION_CRC_ONLY`, or 0
    (empty, torn, foreign)."""
    if len(raw) < REC_SIZE or bytes(raw[:8]) != REC_MAGIC:
        return 0
    version = int.from_bytes(bytes(raw[8:10]), "little")
    body = {REC_VERSION: _REC, REC_VERSION_CRC_ONLY: _REC_V1}.get(version)
    if body is None or _CRC.unpack_from(raw, body.size)[0] != crc32c(bytes(raw[: body.size])):
        return 0
    return version


_NO_TAG = bytes(TAG_BYTES)
_CONTEXT = struct.Struct("<16sQQ")


def record_context(device_uuid: bytes, payload_offset: int, seq: int) -> bytes:
    """What a record's authenticator binds besides namespace, key and bytes: where the
    record lies (device UUID, payload offset) and its sequence number. A record copied
    to another slot or device, or given another sequence number, does not verify."""
    return _CONTEXT.pack(device_uuid, payload_offset, seq)


# One parsed table entry: (slot index, namespace, key, length, crc, seq, encrypted, time ns)
TableEntry = tuple[int, bytes, bytes, int, int, int, bool, int]

# The record header as a numpy record over a 4 KiB table entry (same layout as _REC + CRC).
_REC_DTYPE = np.dtype({
    "names": ["magic", "version", "flags", "ns", "klen", "key", "length", "crc", "seq", "ts",
              "hcrc"],
    "formats": ["<u8", "<u2", "<u2", "V16", "u1", "V64", "<u8", "<u4", "<u8", "<u8", "<u4"],
    "offsets": [0, 8, 10, REC_OFF_NAMESPACE, REC_OFF_KEYLEN, REC_OFF_KEY, REC_OFF_LENGTH,
                REC_OFF_CRC, REC_OFF_SEQ, 117, REC_BODY],
    "itemsize": SECTOR,
})
# A version-1 entry's CRC lies where version 2 keeps its authenticator.
_REC_V1_DTYPE = np.dtype({"names": ["magic", "version", "hcrc"],
                          "formats": ["<u8", "<u2", "<u4"],
                          "offsets": [0, 8, _REC_V1.size], "itemsize": SECTOR})


# The same record as the first REC_SIZE bytes of its entry, key check included: what
# pack_record_headers builds a batch of headers in, one row per record.
_REC_ROW_DTYPE = np.dtype({
    "names": ["magic", "version", "flags", "kcv", "ns", "klen", "key", "length", "crc",
              "seq", "ts", "tag", "hcrc"],
    "formats": ["<u8", "<u2", "<u2", "<u4", "V16", "u1", "V64", "<u8", "<u4", "<u8", "<u8",
                f"V{TAG_BYTES}", "<u4"],
    "offsets": [0, 8, 10, 12, REC_OFF_NAMESPACE, REC_OFF_KEYLEN, REC_OFF_KEY, REC_OFF_LENGTH,
                REC_OFF_CRC, REC_OFF_SEQ, 117, REC_OFF_TAG, REC_BODY],
    "itemsize": REC_SIZE,
})


def _padded(values: Sequence[bytes], width: int, what: str) -> np.ndarray:
    """``values`` zero-padded to ``width`` bytes each, as one (n,) ``V<width>`` array
    (one C-level pass: ``bytes.ljust`` mapped, then joined); ValueError when one is
    longer (``struct`` would cut it silently)."""
    joined = b"".join(map(bytes.ljust, values, repeat(width), repeat(b"\0")))
    if len(joined) != width * len(values):
        raise ValueError(f"pack_record_headers: a {what} is longer than {width} bytes")
    return np.frombuffer(joined, dtype=f"V{width}")


def pack_record_headers(namespaces: Sequence[bytes], keys: Sequence[bytes],
                        lengths: Sequence[int], crcs: Sequence[int], seqs: Sequence[int],
                        flags: int | Sequence[int] = 0, key_checks: int | Sequence[int] = 0,
                        time_ns: int | Sequence[int] = 0,
                        tags: Sequence[bytes] | None = None) -> np.ndarray:
    """Record headers built column-wise: a (n, REC_SIZE) uint8 array whose row i is the
    first REC_SIZE bytes of ``RecordHeader(namespaces[i], keys[i], ...).pack()`` (the rest
    of each 4 KiB entry is zero), header CRC32C included.

    Why: a demotion of 512 blocks of 64 KiB writes 512 headers; packing each with
    ``struct`` and its own CRC call was ≈ 2 µs of Python per record, held under the GIL
    by an I/O thread. Here every field is one numpy assignment, the keys and namespaces
    one join, and the CRCs one native call (:func:`crc32c_many`). ``flags``: the record
    flags (``FLAG_ENCRYPTED`` | ``FLAG_DEVICE_ENCRYPTED``), ``key_checks`` and
    ``time_ns``: one value for all or one per record; ``tags``: each record's
    authenticator (zeros when not given: such a record never verifies). ValueError for a
    key of 0 or more than 64 bytes, a namespace longer than 16, a tag longer than
    TAG_BYTES."""
    n = len(keys)
    rows = np.zeros(n, dtype=_REC_ROW_DTYPE)
    if not n:
        return rows.view(np.uint8).reshape(0, REC_SIZE)
    klen = np.fromiter(map(len, keys), dtype=np.int64, count=n)
    if int(klen.min()) < 1 or int(klen.max()) > 64:
        raise ValueError("pack_record_headers: a key is empty or longer than 64 bytes")
    rows["magic"] = _REC_MAGIC_U64
    rows["version"] = REC_VERSION
    rows["flags"] = flags
    rows["kcv"] = key_checks
    rows["ns"] = _padded(namespaces, 16, "namespace")
    rows["klen"] = klen
    rows["key"] = _padded(keys, 64, "key")
    rows["length"] = lengths
    rows["crc"] = crcs
    rows["seq"] = seqs
    rows["ts"] = time_ns
    if tags is not None:
        rows["tag"] = _padded(tags, TAG_BYTES, "tag")
    raw = rows.view(np.uint8).reshape(n, REC_SIZE)
    rows["hcrc"] = crc32c_many(raw.data, range(0, n * REC_SIZE, REC_SIZE), REC_BODY)
    return raw


def record_header_rows(headers: Sequence[RecordHeader]) -> np.ndarray:
    """:func:`pack_record_headers` of ``headers``: row i is ``headers[i].pack()``'s first
    REC_SIZE bytes (the flags from each header's two encryption fields)."""
    hs = headers
    return pack_record_headers(
        [h.namespace for h in hs], [h.key for h in hs], [h.length for h in hs],
        [h.crc for h in hs], [h.seq for h in hs],
        [(FLAG_ENCRYPTED if h.encrypted else 0)
         | (FLAG_DEVICE_ENCRYPTED if h.device_encrypted else 0) for h in hs],
        [h.key_check for h in hs], [h.committed_ns for h in hs], [h.tag for h in hs])


class TableColumns(NamedTuple):
    """The valid records of a header table, column-wise (one list per field)."""

    slot: list[int]
    namespace: list[bytes]
    key: list[bytes]
    length: list[int]
    crc: list[int]
    seq: list[int]
    encrypted: list[bool]
    time_ns: list[int]


_EMPTY = TableColumns([], [], [], [], [], [], [], [])


def parse_header_columns(table: Buffer, slots: int) -> TableColumns:
    """Every valid record header in a slab's header table (``slots`` x 4 KiB), by column.

    The hot loop of a warm restart: numpy selects the entries that carry the record
    magic and pulls their fields out column-wise; the only per-record Python work left is
    the header CRC32C (one C call) and cutting the key to its length.
    """
    if slots <= 0:
        return _EMPTY
    mv = memoryview(table).cast("B")
    rec = np.frombuffer(mv, dtype=_REC_DTYPE, count=slots)
    cand = np.flatnonzero(rec["magic"] == _REC_MAGIC_U64)
    if not len(cand):
        return _EMPTY
    crc = _crc32c.crc32c
    computed = np.fromiter((crc(mv[o : o + REC_BODY]) for o in (cand * SECTOR).tolist()),
                           dtype=np.uint32, count=len(cand))

    def col(name: str, idx: np.ndarray) -> np.ndarray:
        return rec[name][idx]  # a strided field view, gathered: no 4 KiB row copies

    klen = col("klen", cand)
    ok = ((computed == col("hcrc", cand)) & (col("version", cand) == REC_VERSION)
          & (klen >= 1) & (klen <= 64))
    if not ok.all():
        cand = cand[ok]
        klen = klen[ok]
    keys = [k[:n] for k, n in zip(col("key", cand).tolist(), klen.tolist(), strict=True)]
    return TableColumns(
        cand.tolist(), col("ns", cand).tolist(), keys, col("length", cand).tolist(),
        col("crc", cand).tolist(), col("seq", cand).tolist(),
        ((col("flags", cand) & FLAG_ENCRYPTED) != 0).tolist(), col("ts", cand).tolist())


def fit_records(cols: TableColumns, slot_size: int) -> TableColumns:
    """``cols`` without the records whose length is 0 or exceeds ``slot_size``: a header
    that claims more bytes than its slot holds is not a record of this slab (the rebuild
    and the tools skip it; ``ctxmem check`` reports it instead)."""
    if not cols.length or (min(cols.length) > 0 and max(cols.length) <= slot_size):
        return cols
    keep = [0 < n <= slot_size for n in cols.length]
    return TableColumns._make([v for v, k in zip(c, keep, strict=True) if k] for c in cols)


def magic_slots(table: Buffer, slots: int) -> list[int]:
    """The entries of a header table that carry the record magic, valid or not: those that
    :func:`parse_header_columns` rejects are torn or corrupt headers."""
    if slots <= 0:
        return []
    rec = np.frombuffer(memoryview(table).cast("B"), dtype=_REC_DTYPE, count=slots)
    return np.flatnonzero(rec["magic"] == _REC_MAGIC_U64).tolist()


def legacy_slots(table: Buffer, slots: int) -> list[int]:
    """The entries of a header table that hold a valid record of version 1 (CRC32C only,
    no authenticator): never served, since anyone who writes the flash can make one; the
    rebuild counts them, ``ctxmem check`` reports them."""
    if slots <= 0:
        return []
    mv = memoryview(table).cast("B")
    rec = np.frombuffer(mv, dtype=_REC_V1_DTYPE, count=slots)
    cand = np.flatnonzero((rec["magic"] == _REC_MAGIC_U64)
                          & (rec["version"] == REC_VERSION_CRC_ONLY)).tolist()
    crc = _crc32c.crc32c
    hcrc = rec["hcrc"]
    return [i for i in cand if crc(mv[i * SECTOR : i * SECTOR + _REC_V1.size]) == hcrc[i]]


def parse_header_table(table: Buffer, slots: int) -> list[TableEntry]:
    """Every valid record header in a slab's header table, one tuple per record."""
    return list(zip(*parse_header_columns(table, slots), strict=True))


def pack_header_table(slots: int, namespace: bytes, keys: np.ndarray, length: int, crc: int,
                      seqs: np.ndarray, encrypted: bool = False, time_ns: int = 0,
                      tags: np.ndarray | None = None) -> bytearray:
    """A slab's header table holding ``len(keys)`` records in slots 0.. (the rest empty),
    built column-wise: for tools that generate large images (``ctxmem bench recovery``).
    ``keys``: a (n, key length) uint8 array; ``seqs``: n sequence numbers; ``tags``: a
    (n, TAG_BYTES) uint8 array of their authenticators (zeros, which never verify, when
    not given)."""
    n, klen = keys.shape
    if not 1 <= klen <= 64 or n > slots or len(namespace) != 16:
        raise ValueError("pack_header_table: bad key length, count or namespace")
    table = bytearray(slots * SECTOR)
    rec = np.frombuffer(table, dtype=_REC_DTYPE, count=slots)[:n]
    rec["magic"] = _REC_MAGIC_U64
    rec["version"] = REC_VERSION
    rec["flags"] = FLAG_ENCRYPTED if encrypted else 0
    rec["ns"] = np.frombuffer(namespace, dtype="V16")[0]
    rec["klen"] = klen
    raw = np.frombuffer(table, dtype=np.uint8).reshape(slots, SECTOR)
    raw[:n, REC_OFF_KEY:REC_OFF_KEY + klen] = keys
    if tags is not None:
        raw[:n, REC_OFF_TAG:REC_OFF_TAG + TAG_BYTES] = tags
    rec["length"] = length
    rec["crc"] = crc
    rec["seq"] = seqs
    rec["ts"] = time_ns
    mv = memoryview(table)
    crc_fn = _crc32c.crc32c
    rec["hcrc"] = np.fromiter((crc_fn(mv[i * SECTOR : i * SECTOR + REC_BODY]) for i in range(n)),
                              dtype=np.uint32, count=n)
    return table
