"""The on-flash format: self-describing, so the index can be rebuilt from the device.

The single definition of the format and of its reader: the service's flash tier,
``ctxmem check``, the recovery benchmark and the chaos campaign all read and write devices
through this package. :mod:`.records` holds the structures (pure format code, no I/O);
:mod:`.reader` reads them from a device (the superblock pair, the slab walk).

Device layout (all offsets and sizes multiples of 4 KiB; every service I/O is O_DIRECT)::

    0          superblock (4 KiB): magic "CTXMEMSB", version, slab size, slab count,
               device UUID, CRC32C
    4 KiB      backup superblock (identical copy; used when the first one is damaged)
    8 KiB      probe sector (scratch: the health probe writes and reads it back)
    12 KiB     owner sector: magic "CTXOWNR1", service instance 16 B, pid u32, process
               start u64 (clock ticks since boot), lease expiry u64 (wall-clock ns),
               boot id 16 B, host name 64 B, CRC32C; then magic "CTXOWNRB", heartbeat
               counter u64, CRC32C; zero when no service has the device
    16 KiB     pod heartbeat slots (a shared device): one sector per node: magic
               "CTXBEAT1", node id 64 B, counter u64, pid u32, process start u64, boot id
               16 B, host name 64 B, CRC32C
    1 MiB      slab 0 | slab 1 | ... (flash.slab_size each)

    slab:      slab header (4 KiB): magic "CTXSLAB1", version, slot size, slot count, CRC,
               then the extension: magic "CTXSLABX", device UUID 16 B, slab size u64,
               slab count u64, CRC32C (the superblock's geometry when the slab was
               assigned; a header without it, from before it existed, is still valid);
               on a shared device then: magic "CTXSLABP", owner node id 64 B, fencing
               epoch u64, CRC32C (the pod node that leased the slab; ctxmem_dpu.pod);
               a slab leased but not yet assigned has slot size 0 (no records)
               record-header table: slot count x 4 KiB (one header per slot)
               payload area: slot count x slot size

    record header (first bytes of its 4 KiB entry, little-endian):
        magic "CTXREC01" | version u16 (2) | flags u16 (bit 0: payload encrypted by
        ctxmem, AES-XTS in software; bit 1: encrypted at rest by the device's storage
        layer, e.g. an SPDK crypto bdev, ctxmem wrote plaintext) |
        key check u32 (an encrypted record's cipher check value; 0: none recorded) |
        namespace digest 16 B | key length u8 | key 64 B | payload length u64 |
        CRC32C of the plaintext payload u32 | sequence number u64 | write time ns u64 |
        authenticator 28 B (nonce 12 B, GMAC tag 16 B: ctxmem_common.codecs.blockauth,
        under the namespace's key, over the plaintext payload, binding namespace, key,
        length and the record's place: device UUID, payload offset, sequence number) |
        CRC32C of everything before it u32

    A record header of version 1 (the same fields without the authenticator, its CRC at
    offset 125) is never served: anyone who can write the device can make one.

Why the headers sit in a table and not in front of each payload: a warm restart reads
one contiguous table per slab instead of one 4 KiB read per block (1M blocks is 4 GiB of
tables, read at device speed). Why each header has a whole 4 KiB sector: a sector write
is the unit a device writes atomically, so a torn header write can never damage another
block's header.

A device with no valid superblock is formatted implicitly only when it is blank (no
valid slab header either): otherwise its superblock pair is rebuilt from the slab
headers' extension by ``ctxmem check --repair``. The owner sector makes the device's
exclusive use visible on every path to it (see ``ctxmem_dpu.tiers.flash_owner``).

Write ordering (see docs/reliability.md): payload → ``fdatasync`` → header →
``fdatasync``. A valid header therefore always names a payload that is on stable
storage, so after any crash or power cut every record the rebuild finds is complete; a
torn header fails its own CRC and is an empty slot. An extent's header is zeroed (and
synced) before the extent is freed for reuse (delete, flash eviction), and a slab's header
table is zeroed when the slab is assigned, so a freed or reassigned extent never carries a
stale record.
"""

from ctxmem_common.flash_format.reader import (
    BufferPool,
    FlashReader,
    ReadInto,
    SlabScan,
    SuperblockPair,
    aligned_buffer,
    fd_read_into,
)
from ctxmem_common.flash_format.records import (
    BEAT_OFFSET,
    BEAT_SLOTS,
    DATA_START,
    FLAG_DEVICE_ENCRYPTED,
    FLAG_ENCRYPTED,
    FORMAT_VERSION,
    OWNER_MAGIC,
    OWNER_OFFSET,
    PROBE_OFFSET,
    REC_BODY,
    REC_MAGIC,
    REC_OFF_CRC,
    REC_OFF_KEY,
    REC_OFF_KEYLEN,
    REC_OFF_LENGTH,
    REC_OFF_NAMESPACE,
    REC_OFF_SEQ,
    REC_OFF_TAG,
    REC_SIZE,
    REC_VERSION,
    REC_VERSION_CRC_ONLY,
    SB_BACKUP_OFFSET,
    SB_MAGIC,
    SB_OFFSET,
    SECTOR,
    SLAB_EXT_MAGIC,
    SLAB_MAGIC,
    SLAB_POD_MAGIC,
    NodeBeat,
    OwnerRecord,
    RecordHeader,
    SlabHeader,
    Superblock,
    TableColumns,
    TableEntry,
    fit_records,
    header_offset,
    legacy_slots,
    magic_slots,
    max_table_slots,
    pack_header_table,
    pack_record_headers,
    parse_header_columns,
    parse_header_table,
    payload_offset,
    record_context,
    record_header_rows,
    record_version,
    slab_base,
    slots_per_slab,
)

__all__ = [
    "BEAT_OFFSET",
    "BEAT_SLOTS",
    "DATA_START",
    "FLAG_DEVICE_ENCRYPTED",
    "FLAG_ENCRYPTED",
    "FORMAT_VERSION",
    "OWNER_MAGIC",
    "OWNER_OFFSET",
    "PROBE_OFFSET",
    "REC_BODY",
    "REC_MAGIC",
    "REC_OFF_CRC",
    "REC_OFF_KEY",
    "REC_OFF_KEYLEN",
    "REC_OFF_LENGTH",
    "REC_OFF_NAMESPACE",
    "REC_OFF_SEQ",
    "REC_OFF_TAG",
    "REC_SIZE",
    "REC_VERSION",
    "REC_VERSION_CRC_ONLY",
    "SB_BACKUP_OFFSET",
    "SB_MAGIC",
    "SB_OFFSET",
    "SECTOR",
    "SLAB_EXT_MAGIC",
    "SLAB_MAGIC",
    "SLAB_POD_MAGIC",
    "BufferPool",
    "FlashReader",
    "NodeBeat",
    "OwnerRecord",
    "ReadInto",
    "RecordHeader",
    "SlabHeader",
    "SlabScan",
    "Superblock",
    "SuperblockPair",
    "TableColumns",
    "TableEntry",
    "aligned_buffer",
    "fd_read_into",
    "fit_records",
    "header_offset",
    "legacy_slots",
    "magic_slots",
    "max_table_slots",
    "pack_header_table",
    "pack_record_headers",
    "parse_header_columns",
    "parse_header_table",
    "payload_offset",
    "record_context",
    "record_header_rows",
    "record_version",
    "slab_base",
    "slots_per_slab",
]
