"""`kernel` backend against a FAKE nvme-cli and a FAKE sysfs tree (no kernel involved).

The fake `nvme` is a small script that records its argv and creates/removes the sysfs
entries the kernel would (controller attributes, namespace, /sys/block size) plus a
device file. These tests check command lines, sysfs discovery (plain and native
multipath naming), idempotency and error reporting. The real initiator is exercised in
test_kernel_nvmeof_vm.py inside the QEMU guest.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from storage_backend_suite import BackendTests, MakeBackend

from ctxmem_dpu.storage import StorageError, parse_device_spec
from ctxmem_dpu.storage.kernel import KernelBackend

NQN = "nqn.2014-08.org.example:flash"

FAKE_NVME = r'''
import json, os, re, sys, time
from pathlib import Path
sysfs, dev = Path(os.environ["FAKE_SYSFS"]), Path(os.environ["FAKE_DEV"])
mode = os.environ.get("FAKE_NVME_MODE", "ok")
with open(os.environ["FAKE_NVME_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\n")
args = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
ctrls = sysfs / "class" / "nvme"
if sys.argv[1] == "connect":
    if mode == "sleep":
        time.sleep(30)
    if mode == "fail":
        sys.stderr.write("Failed to write to /dev/nvme-fabrics: Invalid argument\n")
        sys.exit(1)
    n = 0
    while (ctrls / f"nvme{n}").exists():
        n += 1
    c = ctrls / f"nvme{n}"
    c.mkdir(parents=True)
    (c / "subsysnqn").write_text(args["nqn"] + "\n")
    (c / "transport").write_text(args["transport"] + "\n")
    address = f"traddr={args['traddr']},trsvcid={args['trsvcid']},src_addr=10.0.0.9"
    (c / "address").write_text(address + "\n")
    (c / "state").write_text("live\n")
    hostnqn = args.get("hostnqn", "nqn.2014-08.org.nvmexpress:uuid:default")
    (c / "hostnqn").write_text(hostnqn + "\n")
    if mode == "no-namespace":
        sys.exit(0)
    block = f"nvme{n}n1"
    entry = f"nvme{n}c{n}n1" if mode == "multipath" else block
    (c / entry).mkdir()
    (c / entry / "nsid").write_text("1\n")
    (sysfs / "block" / block).mkdir(parents=True)
    (sysfs / "block" / block / "size").write_text(str((32 << 20) // 512) + "\n")
    with open(dev / block, "wb") as f:
        f.truncate(32 << 20)
elif sys.argv[1] == "disconnect":
    name = args["device"]
    c = ctrls / name
    for entry in c.iterdir():
        if entry.is_dir():
            m = re.match(r"^nvme(\d+)c\d+n(\d+)$", entry.name)
            block = f"nvme{m.group(1)}n{m.group(2)}" if m else entry.name
            (dev / block).unlink(missing_ok=True)
            for f in (sysfs / "block" / block).iterdir():
                f.unlink()
            (sysfs / "block" / block).rmdir()
            (entry / "nsid").unlink()
            entry.rmdir()
        else:
            entry.unlink()
    c.rmdir()
'''


class FakeKernel:
    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sysfs, self.dev, self.log = root / "sys", root / "dev", root / "nvme.log"
        (self.sysfs / "class" / "nvme").mkdir(parents=True)
        (self.sysfs / "block").mkdir()
        self.dev.mkdir()
        self.nvme = root / "nvme"
        self.nvme.write_text(f"#!{sys.executable}\n{FAKE_NVME}")
        self.nvme.chmod(0o755)
        monkeypatch.setenv("FAKE_SYSFS", str(self.sysfs))
        monkeypatch.setenv("FAKE_DEV", str(self.dev))
        monkeypatch.setenv("FAKE_NVME_LOG", str(self.log))
        self.monkeypatch = monkeypatch

    def mode(self, mode: str) -> None:
        self.monkeypatch.setenv("FAKE_NVME_MODE", mode)

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def backend(self, **kernel: Any) -> KernelBackend:
        raw = {"transport": "tcp", "traddr": "192.0.2.10", "trsvcid": 4421, "subnqn": NQN}
        raw.update(kernel)
        spec = parse_device_spec({"name": "nvmeof0", "backend": "kernel", "kernel": raw},
                                 "flash.devices[0]")
        return KernelBackend(spec, nvme_bin=str(self.nvme), sysfs_root=self.sysfs,
                             dev_root=self.dev, command_timeout_s=5)

    def controllers(self) -> list[str]:
        return sorted(p.name for p in (self.sysfs / "class" / "nvme").iterdir())


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    return FakeKernel(tmp_path, monkeypatch)


def test_connect_command_line_and_attach(fake: FakeKernel) -> None:
    dev = fake.backend(hostnqn="nqn.2014-08.org.nvmexpress:uuid:host-a", ctrl_loss_tmo=-1,
                       reconnect_delay=2, nr_io_queues=4)
    path = dev.attach(timeout_s=10)
    assert path == str(fake.dev / "nvme0n1")
    assert dev.size_bytes == 32 << 20 and dev.is_healthy()
    assert fake.calls() == [[
        "connect", "--transport=tcp", "--traddr=192.0.2.10", "--trsvcid=4421",
        f"--nqn={NQN}", "--hostnqn=nqn.2014-08.org.nvmexpress:uuid:host-a",
        "--ctrl-loss-tmo=-1", "--reconnect-delay=2", "--nr-io-queues=4"]]
    dev.detach()
    assert fake.calls()[-1] == ["disconnect", "--device=nvme0"]
    assert fake.controllers() == [] and not dev.is_healthy()
    dev.detach()  # idempotent: nothing left to disconnect
    assert len(fake.calls()) == 2


def test_attach_twice_reuses_the_controller(fake: FakeKernel) -> None:
    first = fake.backend()
    path = first.attach(timeout_s=10)
    second = fake.backend()  # a restarted service
    assert second.attach(timeout_s=10) == path
    assert first.attach(timeout_s=10) == path
    assert [c[0] for c in fake.calls()] == ["connect"]
    assert fake.controllers() == ["nvme0"]


def test_other_targets_controllers_are_left_alone(fake: FakeKernel) -> None:
    other = fake.backend(trsvcid=4420)  # same NQN, other port: another path
    other.attach(timeout_s=10)
    mine = fake.backend()
    assert mine.attach(timeout_s=10) == str(fake.dev / "nvme1n1")
    mine.detach()
    assert fake.calls()[-1] == ["disconnect", "--device=nvme1"]
    assert fake.controllers() == ["nvme0"] and other.is_healthy()


def test_native_multipath_naming(fake: FakeKernel) -> None:
    fake.mode("multipath")
    dev = fake.backend()
    assert dev.attach(timeout_s=10) == str(fake.dev / "nvme0n1")
    dev.detach()
    assert fake.controllers() == []


def test_namespace_that_appears_late_is_waited_for(fake: FakeKernel) -> None:
    fake.mode("no-namespace")
    dev = fake.backend()

    def add_namespace() -> None:
        ctrl = fake.sysfs / "class" / "nvme" / "nvme0"
        (ctrl / "nvme0n1").mkdir()
        (fake.sysfs / "block" / "nvme0n1").mkdir()
        (fake.sysfs / "block" / "nvme0n1" / "size").write_text("8192\n")
        with open(fake.dev / "nvme0n1", "wb") as f:
            f.truncate(4 << 20)

    timer = threading.Timer(0.5, add_namespace)
    timer.start()
    try:
        assert dev.attach(timeout_s=10) == str(fake.dev / "nvme0n1")
    finally:
        timer.join()
    assert dev.size_bytes == 4 << 20


def test_missing_namespace_times_out_with_remedy(fake: FakeKernel) -> None:
    fake.mode("no-namespace")
    with pytest.raises(StorageError, match=r"controller nvme0 .*state live.* no namespace 1") as e:
        fake.backend().attach(timeout_s=0.5)
    assert "kernel.nsid" in e.value.remedy


def test_connect_failure_quotes_stderr_exit_code_and_remedy(fake: FakeKernel) -> None:
    fake.mode("fail")
    with pytest.raises(StorageError) as info:
        fake.backend().attach(timeout_s=10)
    err = info.value
    assert "exited with 1" in str(err)
    assert "Failed to write to /dev/nvme-fabrics: Invalid argument" in str(err)
    assert "modprobe nvme-tcp" in err.remedy and NQN in err.remedy
    assert "192.0.2.10 port 4421" in err.remedy


def test_connect_timeout(fake: FakeKernel) -> None:
    fake.mode("sleep")
    with pytest.raises(StorageError, match="did not finish within") as info:
        fake.backend().attach(timeout_s=1.5)
    assert "reachable" in info.value.remedy


def test_missing_nvme_binary(fake: FakeKernel) -> None:
    spec = fake.backend().spec
    dev = KernelBackend(spec, nvme_bin=str(fake.dev / "no-such-nvme"), sysfs_root=fake.sysfs,
                        dev_root=fake.dev)
    with pytest.raises(StorageError, match="not found") as info:
        dev.attach(timeout_s=5)
    assert "nvme-cli" in info.value.remedy


def test_health_follows_controller_state(fake: FakeKernel) -> None:
    dev = fake.backend()
    dev.attach(timeout_s=10)
    (fake.sysfs / "class" / "nvme" / "nvme0" / "state").write_text("connecting\n")
    assert not dev.is_healthy()
    (fake.sysfs / "class" / "nvme" / "nvme0" / "state").write_text("live\n")
    assert dev.is_healthy()
    os.unlink(fake.dev / "nvme0n1")
    assert not dev.is_healthy()


def test_fast_io_fail_tmo_is_written_to_sysfs_after_connect(fake: FakeKernel) -> None:
    dev = fake.backend(ctrl_loss_tmo=-1, reconnect_delay=2, fast_io_fail_tmo=3)
    dev.attach(timeout_s=10)
    ctrl = fake.sysfs / "class" / "nvme" / "nvme0"
    # nvme-cli 2.3 has no option for it: never on the command line, always through sysfs.
    assert not any("fast" in arg for arg in fake.calls()[0])
    assert (ctrl / "fast_io_fail_tmo").read_text() == "3\n"
    # A fresh connect got these from nvme-cli already; they are not rewritten.
    assert not (ctrl / "ctrl_loss_tmo").exists() and not (ctrl / "reconnect_delay").exists()


def test_reused_controller_gets_the_configured_timeouts(fake: FakeKernel) -> None:
    fake.backend().attach(timeout_s=10)  # an earlier run, without timeouts
    ctrl = fake.sysfs / "class" / "nvme" / "nvme0"
    again = fake.backend(ctrl_loss_tmo=-1, reconnect_delay=1, fast_io_fail_tmo=2)
    assert again.attach(timeout_s=10) == str(fake.dev / "nvme0n1")
    assert [c[0] for c in fake.calls()] == ["connect"]  # reused, not reconnected
    assert [(ctrl / a).read_text() for a in ("reconnect_delay", "ctrl_loss_tmo",
                                             "fast_io_fail_tmo")] == ["1\n", "-1\n", "2\n"]


def test_unwritable_timeout_attribute_names_it_with_a_remedy(fake: FakeKernel) -> None:
    fake.backend().attach(timeout_s=10)
    (fake.sysfs / "class" / "nvme" / "nvme0" / "fast_io_fail_tmo").mkdir()  # not writable
    with pytest.raises(StorageError, match=r"cannot set fast_io_fail_tmo=2 on controller "
                                           r"nvme0") as info:
        fake.backend(fast_io_fail_tmo=2).attach(timeout_s=10)
    assert "kernel.fast_io_fail_tmo" in info.value.remedy and info.value.errno is not None


def test_locate_finds_a_re_added_namespace_without_connecting(fake: FakeKernel) -> None:
    """`locate()` (what a running service asks about a failed device) re-reads sysfs: a
    namespace removed and re-added under a new node is found there; while the controller
    is not live, or the namespace is not back, it answers None; it never runs nvme-cli."""
    be = fake.backend()
    path = be.attach(timeout_s=10)
    assert be.locate() == path == str(fake.dev / "nvme0n1")
    calls = len(fake.calls())
    ctrl = fake.sysfs / "class" / "nvme" / "nvme0"
    # The namespace goes away (the host removes its node and sysfs entries) ...
    (fake.dev / "nvme0n1").unlink()
    (fake.sysfs / "block" / "nvme0n1" / "size").unlink()
    (fake.sysfs / "block" / "nvme0n1").rmdir()
    (ctrl / "nvme0n1" / "nsid").unlink()
    (ctrl / "nvme0n1").rmdir()
    assert be.locate() is None
    # ... and comes back as nvme0n2 (the old node is still held open elsewhere).
    (ctrl / "nvme0n2").mkdir()
    (ctrl / "nvme0n2" / "nsid").write_text("1\n")
    (fake.sysfs / "block" / "nvme0n2").mkdir()
    (fake.sysfs / "block" / "nvme0n2" / "size").write_text(str((32 << 20) // 512) + "\n")
    (fake.dev / "nvme0n2").write_bytes(b"")
    (ctrl / "state").write_text("connecting\n")
    assert be.locate() is None  # the controller is not live yet
    (ctrl / "state").write_text("live\n")
    assert be.locate() == str(fake.dev / "nvme0n2") == be.path
    assert len(fake.calls()) == calls, "locate() must not run nvme-cli"


class TestKernelBackend(BackendTests):
    """The shared backend suite against the fake nvme-cli and sysfs."""

    @pytest.fixture
    def make(self, fake: FakeKernel) -> MakeBackend:
        return fake.backend
