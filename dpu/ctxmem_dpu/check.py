"""``ctxmem check``: an fsck for ctxmem flash devices.

Reads every device named by the config (or ``--device``) the way a warm restart does and
more strictly: both superblock copies, each slab header, every record header, every
record's payload (decrypted with the namespace key derived from the master key, then
CRC32C-checked against its header, and its authenticator verified: a MAC under the
namespace's authenticator key, binding key, bytes, device, place and sequence number),
duplicate keys across slots and devices, and the device's length against its geometry.
It reports what it finds; with ``--repair`` it fixes what can be fixed without guessing —
it never makes up data:

* a damaged superblock copy is rewritten from the good one;
* a record that fails a check (torn or corrupt header, bad length, payload CRC mismatch,
  payload beyond the end of the device, an authenticator that does not verify on an
  encrypted record whose payload decrypted soundly) is invalidated (its header zeroed), so
  it is an empty slot and its space is reused; a record of format version 1 (no
  authenticator: the service never serves it) too;
* of several records for one key, all but the one the service would serve (highest
  sequence number) are invalidated — and when that one is bad, every record of the key
  is, so an older version never resurfaces;
* records in a slab whose header is damaged are invalidated (they cannot be placed);
* a device whose two superblock copies are both damaged gets its superblock rebuilt
  from the slab headers, device UUID included (:mod:`.check_superblock`).

It never invalidates what may only be unreadable to it: an encrypted record written with
another key (a wrong master key) is reported, not touched; so is an unencrypted record
whose authenticator does not verify (nothing tells a forged record from a wrong master
key there: the service serves neither).

Paths are opened as carefully as the service opens them (:func:`open_device`, through
:mod:`ctxmem_common.safepaths`): a symbolic link at a device's path, or a regular file
owned by another non-root user, is refused before anything is read or written, for a
read-only check as for ``--repair`` and ``--format`` (issue 25, item 5; docs/security.md,
"Files and paths"). ``--format`` formats a device
on purpose (the service formats only blank devices by itself).

Space accounting: on this format a slot is in use exactly when it holds a valid record,
and a restart claims exactly those slots, so "leaked" space is space held by records that
no restart would serve (shadowed duplicates, bad records): the report counts it and
``--repair`` frees it. ``used_bytes`` in the JSON equals the service's
``flash_used_bytes`` right after a restart on a repaired device.

Exit status (as fsck): 0 clean, 1 problems found and all repaired, 4 problems left,
8 operational error (cannot read the config or a device).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
from dataclasses import asdict, dataclass, field

from ctxmem_common.codecs import XtsCipher, crc32c, derive_namespace_key, xts_tweak
from ctxmem_common.codecs.blockauth import BlockAuthenticator
from ctxmem_common.config import Config
from ctxmem_common.errors import ConfigError
from ctxmem_common.flash_format import (
    DATA_START,
    SB_BACKUP_OFFSET,
    SB_OFFSET,
    SECTOR,
    FlashReader,
    RecordHeader,
    SlabHeader,
    Superblock,
    SuperblockPair,
    header_offset,
    max_table_slots,
    payload_offset,
    record_context,
    slab_base,
    slots_per_slab,
)
from ctxmem_common.keyfile import load_service_key
from ctxmem_common.progress import progress
from ctxmem_dpu.check_superblock import open_device, refuse_if_owned
from ctxmem_dpu.check_superblock import rebuild as rebuild_superblock
from ctxmem_dpu.check_superblock import write_pair as write_superblock_pair
from ctxmem_dpu.keyring import PUBLIC_MASTER_KEY

# Problem kinds. "warning" kinds are reported but are not errors.
KINDS = {
    "superblock_copy_damaged": "one superblock copy is damaged; the other is good",
    "no_superblock": "no valid superblock: the device is blank (the service formats it) "
                     "or both copies are damaged (--repair rebuilds them from the slab "
                     "headers)",
    "truncated": "the device is shorter than its formatted slabs",
    "slab_header_damaged": "a slab header is damaged but its table holds records",
    "record_header_corrupt": "a slot's header carries the record magic but fails its CRC "
                             "(a torn or damaged header: the slot is empty to the service)",
    "record_bad_length": "a record's length is 0 or exceeds its slot",
    "payload_crc": "a record's payload does not match its CRC32C",
    "payload_truncated": "a record's payload lies beyond the end of the device",
    "encryption_mismatch": "an encrypted record, and no master key to read it",
    "key_mismatch": "an encrypted record written with another key (wrong master key?): "
                    "not verified, never invalidated",
    "duplicate": "an older or redundant record of a key another record supersedes",
    "superseded_by_bad": "a key's newest record is bad; its older records must not serve",
    "record_auth": "a record's authenticator does not verify (written, copied or patched "
                   "by someone without the master key, or a wrong master key): the "
                   "service serves it as a miss",
    "record_auth_unverified": "a record's authenticator not verified: no master key given "
                              "(or the device UUID is unknown)",
    "record_old_format": "a record of format version 1 (no authenticator): the service "
                         "never serves it and reuses its slot",
}
# Reported, not errors: a torn header is an empty slot to the service (nothing is served
# from it and its space is reused); an encrypted record without a key cannot be checked;
# a record of format version 1 is an empty slot to the service too.
WARNINGS = {"encryption_mismatch", "record_header_corrupt", "key_mismatch",
            "record_auth_unverified", "record_old_format"}


@dataclass
class Problem:
    kind: str
    device: str
    slab: int = -1
    slot: int = -1
    detail: str = ""
    repaired: bool = False


@dataclass
class DeviceReport:
    name: str
    path: str
    size: int = 0
    slab_size: int = 0
    slabs: int = 0
    slabs_used: int = 0
    records: int = 0
    records_ok: int = 0
    used_bytes: int = 0
    reclaimable_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)


@dataclass
class Report:
    devices: list[DeviceReport] = field(default_factory=list)
    blocks: int = 0
    errors: int = 0
    warnings: int = 0
    repaired: int = 0
    payloads_verified: int = 0

    @property
    def clean(self) -> bool:
        return self.errors == 0

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["clean"] = self.clean
        return out


@dataclass
class _Rec:
    dev: DeviceReport
    slab: int
    slot: int
    slot_size: int
    seq: int
    good: bool


class _Device:
    def __init__(self, name: str, path: str, repair: bool) -> None:
        self.name = name
        self.path = path
        self.repair = repair
        self.fd = open_device(name, path, os.O_RDWR if repair else os.O_RDONLY)
        self.in_use = False
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_EX if repair else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError:
            if repair:
                os.close(self.fd)
                raise OSError(errno.EBUSY, f"{path} is in use (a running ctxmem service?); "
                                           f"stop it before --repair") from None
            self.in_use = True
        self.size = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            refuse_if_owned(self.fd, path, self.size)
        except OSError:
            if repair:
                os.close(self.fd)
                raise
            self.in_use = True
        self.dirty = False

    def read(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def zero(self, offset: int, n: int = SECTOR) -> None:
        os.pwrite(self.fd, bytes(n), offset)
        self.dirty = True

    def close(self) -> None:
        if self.dirty:
            os.fsync(self.fd)
        os.close(self.fd)


def check_devices(devices: list[tuple[str, str]], master_key: bytes | None,
                  repair: bool = False, verify_payloads: bool = True,
                  log: list[str] | None = None, slab_size: int = 0,
                  show_progress: bool = False) -> Report:
    """Check (and with ``repair``, fix) ``devices`` = [(name, path)]. ``slab_size``: the
    configured one, tried first when a lost superblock is rebuilt. ``show_progress``: a
    bar per device, slab by slab, on a terminal (:mod:`ctxmem_common.progress`)."""
    report = Report()
    lines = log if log is not None else []
    opened: list[_Device] = []
    by_key: dict[tuple[bytes, bytes], list[_Rec]] = {}
    ciphers: dict[bytes, XtsCipher] = {}
    try:
        for name, path in devices:
            dev = _Device(name, path, repair)
            opened.append(dev)
            rep = DeviceReport(name, path, size=dev.size)
            report.devices.append(rep)
            if dev.in_use:
                lines.append(f"{name}: in use by a running service: a live check may see "
                             f"writes in flight")
            _check_device(dev, rep, master_key, verify_payloads, by_key, ciphers, report,
                          slab_size, show_progress)
        _resolve_duplicates(by_key, {d.name: d for d in opened}, repair)
        for rep in report.devices:
            for p in rep.problems:
                if p.kind in WARNINGS:
                    report.warnings += 1
                else:
                    report.errors += 1
                report.repaired += p.repaired
                where = f" slab {p.slab}" if p.slab >= 0 else ""
                where += f" slot {p.slot}" if p.slot >= 0 else ""
                lines.append(f"{p.device}{where}: {p.kind}: {p.detail}"
                             f"{' (repaired)' if p.repaired else ''}")
        report.blocks = sum(1 for recs in by_key.values() if any(r.good for r in recs))
        for rep in report.devices:
            lines.append(
                f"{rep.name}: {rep.slabs} slabs of {rep.slab_size} bytes, {rep.slabs_used} "
                f"used; {rep.records_ok}/{rep.records} records sound; {rep.used_bytes} bytes "
                f"in use, {rep.reclaimable_bytes} held by records no restart would serve")
    finally:
        for dev in opened:
            dev.close()
    return report


def _check_device(dev: _Device, rep: DeviceReport, master_key: bytes | None,
                  verify_payloads: bool, by_key: dict[tuple[bytes, bytes], list[_Rec]],
                  ciphers: dict[bytes, XtsCipher], report: Report, slab_hint: int = 0,
                  show_progress: bool = False) -> None:
    def problem(kind: str, detail: str, slab: int = -1, slot: int = -1,
                repaired: bool = False) -> Problem:
        p = Problem(kind, rep.name, slab, slot, detail, repaired)
        rep.problems.append(p)
        return p

    reader = FlashReader(dev.fd)
    pair = reader.superblocks()
    sb = pair.current
    uuid_known = True
    if sb is None:
        found = reader.find_slab_headers(dev.size, [slab_hint] if slab_hint else [])
        if not found:
            problem("no_superblock", "neither superblock copy is valid and no slab header "
                                     "was found: a blank device (the service formats it)")
            return
        sb, uuid_known, basis = rebuild_superblock(found, dev.size)
        p = problem("no_superblock", f"both superblock copies are damaged; rebuilt from "
                                     f"the slab headers: {basis}")
        if dev.repair:
            write_superblock_pair(dev.fd, sb)
            p.repaired = True
        pair = SuperblockPair(sb, sb)
    if pair.damaged:
        p = problem("superblock_copy_damaged", f"the {pair.damaged} copy is damaged or missing")
        if dev.repair:
            os.pwrite(dev.fd, sb.pack(), SB_OFFSET if pair.damaged == "primary"
                      else SB_BACKUP_OFFSET)
            dev.dirty = True
            p.repaired = True
    rep.slab_size = sb.slab_size
    rep.slabs = sb.num_slabs
    fits = max(0, (dev.size - DATA_START) // sb.slab_size)
    if fits < sb.num_slabs:
        problem("truncated", f"{dev.size} bytes hold {fits} of {sb.num_slabs} slabs; the "
                             f"rest (and their blocks) are gone")
    n_slabs = min(fits + 1, sb.num_slabs)
    unverified = 0  # records whose authenticator could not be checked (no master key)
    bar = progress(n_slabs, f"ctxmem check {rep.name}", "slabs",
                   show=None if show_progress else False)
    for slab in range(n_slabs):
        bar.set(slab)
        orphaned = False  # records of a slab whose header is damaged (not repaired)
        sh = reader.slab_header(slab, sb.slab_size)
        if sh is None:
            # No (valid) slab header: the slab is free to the service, and records left in
            # its table are lost to it. Their lengths tell the slot size (a slab holds one
            # size, rounded up to 4 KiB), so --repair can write the header back.
            orphans = reader.read_table(slab, sb.slab_size, max_table_slots(sb.slab_size))[0]
            if not orphans.slot:
                continue
            sizes = {(n + SECTOR - 1) // SECTOR * SECTOR for n in orphans.length}
            slot = sizes.pop() if len(sizes) == 1 else 0
            slots = slots_per_slab(sb.slab_size, slot) if slot else 0
            placeable = slots > 0 and max(orphans.slot) < slots
            p = problem("slab_header_damaged",
                        f"{len(orphans.slot)} records in a slab without a valid header"
                        + (f"; their lengths give slot size {slot}: --repair rewrites the "
                           f"header" if placeable else "; no consistent slot size: --repair "
                                                  "invalidates them"), slab)
            if not placeable:
                if dev.repair:
                    p.repaired = True
                    for i in orphans.slot:
                        dev.zero(header_offset(slab, i, sb.slab_size))
                continue
            sh = SlabHeader(slot, slots)
            sh = sh.for_device(sb) if uuid_known else sh
            if dev.repair:
                p.repaired = True
                os.pwrite(dev.fd, sh.pack(), slab_base(slab, sb.slab_size))
                dev.dirty = True
            else:
                orphaned = True  # check its records too; the service does not use them
        if not orphaned:
            rep.slabs_used += 1
        cols, _entries, torn, old = reader.read_table(slab, sb.slab_size, sh.slots, torn=True)
        for i in old:
            p = problem("record_old_format", "a record of format version 1 (written before "
                        "records carried authenticators): the service does not serve it",
                        slab, i)
            if dev.repair:
                dev.zero(header_offset(slab, i, sb.slab_size))
                p.repaired = True
        for i in torn:  # magic but no valid header: torn or corrupt
            p = problem("record_header_corrupt",
                        "the record magic is there but the header fails its CRC32C "
                        "(torn or corrupt); the service ignores it", slab, i)
            if dev.repair:
                dev.zero(header_offset(slab, i, sb.slab_size))
                p.repaired = True
        for i, ns, key, length, crc, seq, enc, _ts in zip(*cols, strict=True):
            fits_slot = 0 < length <= sh.slot_size
            state = (_payload_state(dev, sb, slab, i, sh.slot_size, ns, key, length, crc,
                                    seq, enc, master_key if uuid_known else None, ciphers)
                     if fits_slot and verify_payloads else "")
            if orphaned:
                # Report bad records, but these are not the service's: no accounting.
                if state in ("crc", "truncated"):
                    problem("payload_crc", f"key {key.hex()[:16]} (orphaned record): "
                                           f"{_PAYLOAD_BAD[state]}", slab, i)
                continue
            rep.records += 1
            bad: tuple[str, str] | None = None
            if not fits_slot:
                bad = ("record_bad_length", f"length {length} in a {sh.slot_size}-byte slot")
            elif state == "truncated":
                bad = ("payload_truncated", _PAYLOAD_BAD[state])
            elif state == "no_key":
                problem("encryption_mismatch", "encrypted record; no master key given (or "
                        "the device UUID is unknown), payload not verified", slab, i)
            elif state == "wrong_key":
                problem("key_mismatch", f"key {key.hex()[:16]}: written with another key "
                                        f"(wrong master key?); not verified", slab, i)
            elif state == "auth_no_key":
                report.payloads_verified += 1
                unverified += 1
            elif state == "auth":
                report.payloads_verified += 1
                bad = ("record_auth", f"key {key.hex()[:16]}: the authenticator does not "
                       f"verify, though the payload decrypts soundly under this master key: "
                       f"written, copied or replayed by someone without the key")
            elif state == "auth_unsure":
                report.payloads_verified += 1
                problem("record_auth", f"key {key.hex()[:16]}: the authenticator does not "
                        f"verify (a record written, copied or patched by someone without "
                        f"the master key, or a wrong master key given: unencrypted, nothing "
                        f"tells them apart, so --repair does not invalidate it)", slab, i)
            elif state == "crc_unsure":
                report.payloads_verified += 1
                problem("payload_crc", f"key {key.hex()[:16]}: {_PAYLOAD_BAD['crc']}; "
                        f"encrypted without a key check (older record): it may be a wrong "
                        f"master key, so --repair does not invalidate it", slab, i)
            elif state:
                report.payloads_verified += 1
                if state == "crc":
                    bad = ("payload_crc", f"key {key.hex()[:16]}: {_PAYLOAD_BAD[state]}")
            by_key.setdefault((ns, key), []).append(
                _Rec(rep, slab, i, sh.slot_size, seq, bad is None))
            if bad is not None:
                p = problem(bad[0], bad[1], slab, i)
                if dev.repair:
                    dev.zero(header_offset(slab, i, sb.slab_size))
                    p.repaired = True
                    continue
                rep.reclaimable_bytes += sh.slot_size
            else:
                rep.records_ok += 1
            rep.used_bytes += sh.slot_size
    bar.set(n_slabs)
    bar.close()
    if unverified:
        problem("record_auth_unverified", f"{unverified} records: payload CRC32C checked, "
                f"authenticator not (no master key given, or the device UUID is unknown)")


_PAYLOAD_BAD = {"crc": "payload CRC32C mismatch",
                "truncated": "payload beyond the end of the device"}


def _payload_state(dev: _Device, sb: Superblock, slab: int, i: int, slot_size: int,
                   ns: bytes, key: bytes, length: int, crc: int, seq: int, enc: bool,
                   master_key: bytes | None, ciphers: dict[bytes, XtsCipher]) -> str:
    """Read and check a record's payload: "ok", "crc" (CRC32C mismatch), "truncated"
    (beyond the end of the device), "no_key" (encrypted, and no master key to read it),
    "wrong_key" (its header's key check names another key), "crc_unsure" (a CRC32C
    mismatch of an encrypted record without a key check: maybe a wrong key), "auth" (the
    CRC32C holds after decrypting, so the key is right, but the authenticator does not
    verify), "auth_unsure" (the same, unencrypted: maybe a wrong key) or "auth_no_key"
    (no master key: the authenticator cannot be checked)."""
    poff = payload_offset(slab, i, sb.slab_size, slot_size)
    data = dev.read(poff, slot_size)
    if len(data) < slot_size:
        return "truncated"
    if enc:
        if master_key is None:
            return "no_key"
        cipher = ciphers.get(ns)
        if cipher is None:
            cipher = ciphers[ns] = XtsCipher(derive_namespace_key(master_key, ns))
        plain = bytearray(len(data))
        cipher.decrypt_into(data, plain, xts_tweak(sb.tweak_id, poff))
        data = bytes(plain)
    if crc32c(memoryview(data)[:length]) == crc:
        # Without a master key: the public one a service without a key authenticates with.
        hdr = RecordHeader.unpack(dev.read(header_offset(slab, i, sb.slab_size), SECTOR))
        auth = _authenticator(master_key or PUBLIC_MASTER_KEY, ns)
        if hdr is not None and hdr.key == key and auth.verify(
                key, memoryview(data)[:length], hdr.tag, record_context(sb.device_uuid, poff,
                                                                         seq)):
            return "ok"
        if master_key is None:
            return "auth_no_key"
        return "auth" if enc else "auth_unsure"
    if not enc:
        return "crc"
    hdr = RecordHeader.unpack(dev.read(header_offset(slab, i, sb.slab_size), SECTOR))
    kcv = hdr.key_check if hdr is not None else 0
    if not kcv:
        return "crc_unsure"
    return "crc" if kcv == ciphers[ns].check_value else "wrong_key"


@functools.lru_cache(maxsize=256)
def _authenticator(master_key: bytes, ns: bytes) -> BlockAuthenticator:
    """The namespace's authenticator (its key derived once per namespace)."""
    return BlockAuthenticator.for_namespace(master_key, ns)


def _resolve_duplicates(by_key: dict[tuple[bytes, bytes], list[_Rec]],
                        devs: dict[str, _Device], repair: bool) -> None:
    for (_ns, key), recs in by_key.items():
        if len(recs) < 2 and all(r.good for r in recs):
            continue
        recs.sort(key=lambda r: r.seq, reverse=True)
        newest = recs[0].seq
        winners = [r for r in recs if r.seq == newest and r.good]
        keep = winners[0] if winners else None
        for r in recs:
            if r is keep or not r.good:
                continue
            kind = "duplicate" if keep is not None else "superseded_by_bad"
            detail = (f"key {key.hex()[:16]} seq {r.seq}: "
                      + (f"superseded by seq {keep.seq}" if keep is not None
                         else f"its newest record (seq {newest}) is bad"))
            p = Problem(kind, r.dev.name, r.slab, r.slot, detail)
            r.dev.problems.append(p)
            r.dev.reclaimable_bytes += r.slot_size
            if repair:
                dev = devs[r.dev.name]
                dev.zero(header_offset(r.slab, r.slot, r.dev.slab_size))
                p.repaired = True
                r.dev.used_bytes -= r.slot_size
                r.dev.reclaimable_bytes -= r.slot_size
            r.good = False


def read_master_key(cfg: Config) -> bytes | None:
    """The master key the service would use, without creating one; None if unavailable."""
    try:
        return load_service_key(cfg.encryption, create=False)
    except ConfigError:
        return None


def check_command(argv: list[str]) -> int:
    """``ctxmem check`` (:mod:`ctxmem_dpu.check_cli`)."""
    from ctxmem_dpu.check_cli import check_command as run

    return run(argv)
