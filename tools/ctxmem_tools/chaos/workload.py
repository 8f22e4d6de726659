"""The campaign's workload: put, get, evict and delete through the shim, each checked
against the key model (wrong, lost and resurrected blocks; flash space accounting).
"""

from __future__ import annotations

from ctxmem_common.flash_format import (
    SECTOR,
)
from ctxmem_tools.chaos.driver import ServiceDriver
from ctxmem_tools.chaos.records import (
    IO_ERRORS,
    TENANTS,
    Key,
)


class Workload(ServiceDriver):
    """Operations and checks on top of :class:`ServiceDriver`."""

    # -- restarts ------------------------------------------------------------------------
    def crashed(self) -> None:
        """The service is gone (killed by us or by a fault point): restart and verify."""
        self._fold_counters(final=True)
        self.svc.kill()
        self.st.kills += 1
        self.restart_and_verify()

    def restart_and_verify(self, env: dict[str, str] | None = None) -> None:
        while not self.start(env):
            env = None  # died in the rebuild: start again, plainly
            self.st.kills += 1
        self.leak_check()
        self.verify_all(after_restart=True)

    # -- operations (each tolerates the service dying under it) -------------------------
    def put(self, tenant: str, keys: list[bytes]) -> bool:
        ns = self.ns[tenant]
        for key in keys:
            self.keys[key] = Key(tenant, uncertain=True)
            self.deleted.pop(key, None)
        try:
            r = ns.put(keys, [self.content_of(k) for k in keys])
        except IO_ERRORS:
            if self.alive():
                self.st.op_errors += 1
                for key in keys:  # refused (e.g. DRAM full while flash fails): not stored
                    self.keys.pop(key, None)
            return False
        self.st.blocks_committed += r.stored
        for key in keys:
            self.keys[key].uncertain = False
        return True

    def tiers(self, tenant: str, keys: list[bytes]) -> list[str]:
        assert self.client is not None
        return self.ns[tenant].tiers(keys)

    def evict(self, tenant: str, keys: list[bytes]) -> None:
        if not keys:
            return
        ns = self.ns[tenant]
        marks = {k: self.keys[k].uncertain for k in keys if k in self.keys}
        for k in marks:
            self.keys[k].uncertain = True
        try:
            ns.evict(keys)
            tiers = self.tiers(tenant, keys)
        except IO_ERRORS:
            if self.alive():
                self.st.op_errors += 1
            return
        for k, tier in zip(keys, tiers, strict=True):
            if k in self.keys:
                self.keys[k].uncertain = marks.get(k, False)
                if tier == "flash":
                    self.keys[k].durable = True

    def delete(self, tenant: str, keys: list[bytes]) -> None:
        for k in keys:
            self.keys[k].uncertain = True
        try:
            self.ns[tenant].delete(keys)
        except IO_ERRORS:
            if self.alive():
                self.st.op_errors += 1
            return
        for k in keys:
            state = self.keys.pop(k)
            state.uncertain = False
            state.deleted = True
            self.deleted[k] = state

    def get(self, tenant: str, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Get ``keys`` (not a chain: a miss does not hide the keys after it); every
        served block is compared with the key's content. Returns (served, missed)."""
        ns = self.ns[tenant]
        bufs = [bytearray(self.block) for _ in keys]
        served: list[bytes] = []
        missed: list[bytes] = []
        i = 0
        while i < len(keys):
            try:
                n = ns.get(keys[i:], bufs[i:])
            except IO_ERRORS:
                n = 0
            for j in range(i, i + n):
                self._check_served(keys[j], bufs[j])
                served.append(keys[j])
            i += n
            if i < len(keys):
                # A run can also come back short when DRAM cannot stage more right now
                # (another tenant holds the slabs): ask for that key alone before calling
                # it a miss.
                try:
                    one = ns.get([keys[i]], [bufs[i]])
                except IO_ERRORS:
                    one = 0
                if one:
                    self._check_served(keys[i], bufs[i])
                    served.append(keys[i])
                else:
                    missed.append(keys[i])
                i += 1
            if not self.alive():
                missed += keys[i:]
                break
        return served, missed

    def _check_served(self, key: bytes, data: bytearray) -> None:
        self.st.blocks_served += 1
        if data != self.content_of(key):
            self.st.wrong_blocks += 1
            k = self.keys.get(key) or self.deleted.get(key)
            self.st.problems.append(f"WRONG BLOCK served for key {key.hex()[:16]} ({k})")
        if key in self.deleted and key not in self.keys:
            k = self.deleted[key]
            if not k.tainted and not k.uncertain:
                self.st.resurrected_blocks += 1
                self.st.problems.append(f"deleted key {key.hex()[:16]} served again")

    def verify_all(self, after_restart: bool) -> None:
        """Read every key of the model; after a restart, durable ones must all be there."""
        for tenant in TENANTS:
            keys = [k for k, s in self.keys.items() if s.tenant == tenant]
            gone = [k for k, s in self.deleted.items() if s.tenant == tenant][-200:]
            try:
                present = self.ns[tenant].exists(keys + gone) if keys or gone else []
            except IO_ERRORS:
                return
            want = [k for k, p in zip(keys + gone, present, strict=True) if p]
            served, _missed = self.get(tenant, want)
            got = set(served)
            for key in keys:
                s = self.keys[key]
                if key in got:
                    if after_restart:
                        s.durable = True
                        s.uncertain = False
                    continue
                if not after_restart:
                    if s.tainted:
                        self.st.tainted_misses += 1
                    continue
                if s.durable and not s.tainted and not s.uncertain:
                    self.st.durable_blocks_lost += 1
                    loc = self.files.seen.get(key)
                    where = (f"last seen on {loc.dev} slab {loc.slab} slot {loc.slot}"
                             if loc else "never seen on flash")
                    self.st.problems.append(
                        f"durable key {key.hex()[:16]} lost ({s}; {where}); recent: "
                        + " | ".join(list(self.events)[-40:]))
                elif s.tainted:
                    self.st.tainted_misses += 1
                elif not s.durable and not s.uncertain:
                    self.st.blocks_lost += 1  # committed, not yet durable at the crash
                del self.keys[key]
            if after_restart:
                for key in gone:
                    if key not in got:
                        self.deleted[key].uncertain = False

    def leak_check(self) -> None:
        """Right after a restart: every allocated flash byte is a valid record's slot."""
        try:
            st = self.stats()
        except IO_ERRORS:
            return
        slot = (self.block + SECTOR - 1) // SECTOR * SECTOR
        used = st["flash_used_bytes"] - st["flash_quarantined_slots"] * slot
        on_disk = sum(loc.slot_size for loc in self.files.scan(restart_view=True))
        self.st.leak_checks += 1
        if used != on_disk:
            self.st.space_leak_bytes = max(self.st.space_leak_bytes, int(abs(used - on_disk)))
            self.st.problems.append(f"space accounting: service uses {used:.0f} bytes, "
                                    f"valid records on flash hold {on_disk}")

    # -- workload -----------------------------------------------------------------------
    def workload_round(self) -> None:
        """Put a batch, make part of it durable, read a sample, trim the working set."""
        tenant = self.rng.choice(TENANTS)
        keys = self.fresh_keys(tenant, self.rng.randint(4, 16))
        if not self.put(tenant, keys):
            return
        self.evict(tenant, keys[: len(keys) * 3 // 4])
        sample = self.rng.sample(list(self.keys), min(24, len(self.keys)))
        for t in TENANTS:
            self.get(t, [k for k in sample if self.keys.get(k, Key("?")).tenant == t])
        over = len(self.keys) > self.working_set
        if over or self.rng.random() < 0.2:
            old = [k for k, s in self.keys.items() if s.tenant == tenant and not s.uncertain]
            victims = old[: max(8, len(self.keys) - self.working_set) if over else 4]
            self._capture_before_delete(tenant, victims[:2])
            self.delete(tenant, victims)

    def _capture_before_delete(self, tenant: str, keys: list[bytes]) -> None:
        if len(self.captured) > 64 or not keys:
            return
        locs = {loc.key: loc for loc in self.files.scan() if loc.key in keys}
        for key in keys:
            loc = locs.get(key)
            if loc is not None:
                hdr = self.files.read(loc.dev, loc.header_off, SECTOR)
                body = self.files.read(loc.dev, loc.payload_off, loc.slot_size)
                self.captured.append((tenant, key, hdr, body))
