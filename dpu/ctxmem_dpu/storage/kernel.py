"""`kernel` backend: a remote NVMe-oF namespace through the Linux initiator (nvme-cli).

Attach runs `nvme connect` unless sysfs already shows a controller for the same
(transport, traddr, trsvcid, subsystem NQN[, host NQN]) -- e.g. one left by an earlier
run of the service -- then waits for the namespace's block device. The controller is
found through sysfs, never by parsing nvme-cli's output, which differs across versions:

    /sys/class/nvme/nvmeC/{subsysnqn,transport,address,state,hostnqn}
    /sys/class/nvme/nvmeC/nvmeCnN        namespace block device (no native multipath)
    /sys/class/nvme/nvmeC/nvmeScCnN      path device; the block device is nvmeSnN
    /sys/block/nvmeSnN/size              in 512-byte sectors

After connecting (or when reusing a controller) the configured timeouts are written to
the controller's sysfs attributes `reconnect_delay`, `ctrl_loss_tmo` and
`fast_io_fail_tmo`; the last one makes I/O fail with EIO a few seconds after the target
is lost instead of waiting for the reconnect, so the service degrades to misses.

Detach disconnects exactly the matching controllers (`nvme disconnect -d nvmeC`), not
every controller of the subsystem as `nvme disconnect -n NQN` would: other paths or
other services may use the same subsystem.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from ctxmem_common.device_settings import DeviceSpec, KernelOptions

from .base import StorageBackend, StorageError
from .devices import Deadline, probe_o_direct, wait_for

__all__ = ["KernelBackend"]

_CTRL_RE = re.compile(r"^nvme\d+$")
_NS_RE = re.compile(r"^nvme\d+n\d+$")
_PATH_NS_RE = re.compile(r"^nvme(\d+)c\d+n(\d+)$")


class KernelBackend(StorageBackend):
    """NVMe-oF over RDMA or TCP through the kernel initiator.

    Args:
        spec: a `kernel` DeviceSpec.
        nvme_bin: the nvme-cli executable (tests pass a fake).
        sysfs_root: where sysfs is mounted (tests pass a fake tree).
        dev_root: where device nodes appear.
        command_timeout_s: bound for `nvme disconnect` and detach's wait.
    """

    def __init__(self, spec: DeviceSpec, *, nvme_bin: str = "nvme",
                 sysfs_root: str | os.PathLike[str] = "/sys",
                 dev_root: str | os.PathLike[str] = "/dev",
                 command_timeout_s: float = 30.0) -> None:
        if spec.backend != "kernel" or spec.kernel is None:
            raise ValueError(f"device {spec.name!r}: KernelBackend needs a kernel spec")
        super().__init__(spec)
        self.opts: KernelOptions = spec.kernel
        self._nvme_bin = nvme_bin
        self._sysfs = Path(sysfs_root)
        self._dev = Path(dev_root)
        self._command_timeout_s = command_timeout_s
        self._ctrl: str | None = None

    # -- contract ---------------------------------------------------------------------

    def attach(self, timeout_s: float = 30.0) -> str:
        # docstring inherited
        deadline = Deadline(timeout_s)
        ctrl = self._find_controller()
        reused = ctrl is not None
        if ctrl is None:
            self._connect(deadline)
            ctrl = wait_for(self._find_controller, deadline)
            if ctrl is None:
                raise StorageError(
                    f"device {self.spec.name!r}: `nvme connect` succeeded but no controller "
                    f"for {self._target()} appeared under {self._sysfs}/class/nvme within "
                    f"{timeout_s:g}s",
                    "check `dmesg` for nvme errors and `nvme list-subsys`",
                )
        self._apply_timeouts(ctrl, reused)
        block = wait_for(lambda: self._namespace_block(ctrl), deadline)
        if block is None:
            raise StorageError(
                f"device {self.spec.name!r}: controller {ctrl} ({self._target()}, state "
                f"{self._read(ctrl, 'state') or 'unknown'}) shows no namespace "
                f"{self.opts.nsid} within {timeout_s:g}s",
                f"check that subsystem {self.opts.subnqn} exports namespace "
                f"{self.opts.nsid} and that it is enabled on the target "
                f"(`nvme list-ns /dev/{ctrl}`), or set kernel.nsid",
            )
        dev_path = str(self._dev / block)
        if wait_for(lambda: True if os.path.exists(dev_path) else None, deadline) is None:
            raise StorageError(
                f"device {self.spec.name!r}: {block} is in sysfs but {dev_path} did not "
                f"appear within {timeout_s:g}s",
                "check that devtmpfs is mounted on /dev and udev is running",
            )
        actual = probe_o_direct(dev_path, self.spec.name)
        sectors = _read_int(self._sysfs / "block" / block / "size")
        self._size_bytes = self._usable_size(sectors * 512 if sectors else actual, dev_path)
        self._ctrl = ctrl
        self._path = dev_path
        return dev_path

    def detach(self) -> None:
        # docstring inherited
        deadline = Deadline(self._command_timeout_s)
        for ctrl in self._find_controllers():
            result = self._run(["disconnect", f"--device={ctrl}"], deadline, "disconnect")
            if result.returncode != 0 and self._read(ctrl, "subsysnqn") is not None:
                raise StorageError(
                    f"device {self.spec.name!r}: `{' '.join(result.args)}` exited with "
                    f"{result.returncode}: {_tail(result.stderr)}",
                    f"check whether /dev/{ctrl} is still in use (mounted, opened by another "
                    "process); run the command by hand to see the full error",
                )
        leftover = wait_for(lambda: None if self._find_controllers() else True, deadline)
        if leftover is None:
            raise StorageError(
                f"device {self.spec.name!r}: controllers {self._find_controllers()} for "
                f"{self._target()} still present {self._command_timeout_s:g}s after "
                "`nvme disconnect`",
                "check `dmesg`; close any process holding the namespace open",
            )
        self._ctrl = None
        self._path = None
        self._size_bytes = None

    def locate(self) -> str | None:
        # docstring inherited: the namespace's block node behind this target's live
        # controller, found in sysfs; the controller itself is the kernel's to reconnect.
        ctrl = self._find_controller()
        if ctrl is None or self._read(ctrl, "state") != "live":
            return None
        block = self._namespace_block(ctrl)
        if block is None or not (self._dev / block).exists():
            return None
        self._ctrl = ctrl
        self._path = str(self._dev / block)
        return self._path

    def is_healthy(self) -> bool:
        # docstring inherited
        if self._path is None or self._ctrl is None:
            return False
        return self._read(self._ctrl, "state") == "live" and os.path.exists(self._path)

    # -- sysfs ------------------------------------------------------------------------

    def _read(self, ctrl: str, attr: str) -> str | None:
        try:
            return (self._sysfs / "class" / "nvme" / ctrl / attr).read_text().strip()
        except OSError:
            return None

    def _find_controllers(self) -> list[str]:
        """Controllers connected to exactly this device's target, oldest first."""
        base = self._sysfs / "class" / "nvme"
        try:
            names = sorted((p.name for p in base.iterdir() if _CTRL_RE.match(p.name)),
                           key=lambda n: int(n[4:]))
        except OSError:
            return []  # no nvme controllers at all (nvme-core not loaded)
        return [name for name in names if self._matches(name)]

    def _find_controller(self) -> str | None:
        found = self._find_controllers()
        return found[0] if found else None

    def _matches(self, ctrl: str) -> bool:
        o = self.opts
        if self._read(ctrl, "subsysnqn") != o.subnqn:
            return False
        if self._read(ctrl, "transport") != o.transport:
            return False
        address = _parse_address(self._read(ctrl, "address") or "")
        if address.get("traddr") != o.traddr or address.get("trsvcid") != o.trsvcid:
            return False
        return o.hostnqn is None or self._read(ctrl, "hostnqn") == o.hostnqn

    def _namespace_block(self, ctrl: str) -> str | None:
        """The block device name of namespace `nsid` behind `ctrl`, once it exists."""
        ctrl_dir = self._sysfs / "class" / "nvme" / ctrl
        try:
            entries = sorted(p.name for p in ctrl_dir.iterdir())
        except OSError:
            return None
        for entry in entries:
            path_match = _PATH_NS_RE.match(entry)
            if path_match:
                block = f"nvme{path_match.group(1)}n{path_match.group(2)}"
            elif _NS_RE.match(entry):
                block = entry
            else:
                continue
            nsid = _read_int(ctrl_dir / entry / "nsid")
            if nsid is None:
                nsid = int(entry.rsplit("n", 1)[1])
            if nsid == self.opts.nsid and (self._sysfs / "block" / block).exists():
                return block
        return None

    def _apply_timeouts(self, ctrl: str, reused: bool) -> None:
        """Set the configured timeouts on `ctrl` through its writable sysfs attributes.

        `fast_io_fail_tmo` always goes through sysfs: the nvme-cli of Debian 12 (2.3) has
        no option for it, and sysfs works with every version. `reconnect_delay` and
        `ctrl_loss_tmo` are given to `nvme connect`; a reused controller (left by an
        earlier run) gets them here too, so it behaves as configured now. The kernel
        derives ctrl_loss_tmo's retry count from reconnect_delay, hence that order.
        """
        o = self.opts
        wanted: list[tuple[str, int]] = []
        if reused and o.reconnect_delay is not None:
            wanted.append(("reconnect_delay", o.reconnect_delay))
        if reused and o.ctrl_loss_tmo is not None:
            wanted.append(("ctrl_loss_tmo", o.ctrl_loss_tmo))
        if o.fast_io_fail_tmo is not None:
            wanted.append(("fast_io_fail_tmo", o.fast_io_fail_tmo))
        for attr, value in wanted:
            path = self._sysfs / "class" / "nvme" / ctrl / attr
            try:
                path.write_text(f"{value}\n")
            except OSError as ex:
                raise StorageError(
                    f"device {self.spec.name!r}: cannot set {attr}={value} on controller "
                    f"{ctrl} ({path}): [errno {ex.errno}] {ex.strerror}",
                    f"writing it needs root, and a kernel that has the attribute (Linux "
                    f"6.1 has it; older kernels may not); run the service as root, or "
                    f"remove kernel.{attr} from the config",
                    errno=ex.errno,
                ) from ex

    # -- nvme-cli ---------------------------------------------------------------------

    def _connect(self, deadline: Deadline) -> None:
        o = self.opts
        args = ["connect", f"--transport={o.transport}", f"--traddr={o.traddr}",
                f"--trsvcid={o.trsvcid}", f"--nqn={o.subnqn}"]
        if o.hostnqn is not None:
            args.append(f"--hostnqn={o.hostnqn}")
        if o.ctrl_loss_tmo is not None:
            args.append(f"--ctrl-loss-tmo={o.ctrl_loss_tmo}")
        if o.reconnect_delay is not None:
            args.append(f"--reconnect-delay={o.reconnect_delay}")
        if o.nr_io_queues is not None:
            args.append(f"--nr-io-queues={o.nr_io_queues}")
        result = self._run(args, deadline, "connect")
        if result.returncode == 0:
            return
        if "already connected" in result.stderr.lower() and self._find_controller():
            return  # raced with another connect; attach reuses that controller
        raise StorageError(
            f"device {self.spec.name!r}: `{' '.join(result.args)}` exited with "
            f"{result.returncode}: {_tail(result.stderr) or '(no stderr)'}",
            self._connect_remedy(result.stderr),
        )

    def _connect_remedy(self, stderr: str) -> str:
        o = self.opts
        text = stderr.lower()
        first = ""
        if "nvme-fabrics" in text and ("no such file" in text or "failed to open" in text):
            first = f"load the initiator modules (modprobe nvme-fabrics nvme-{o.transport}); "
        elif "invalid argument" in text:
            first = (f"the kernel rejected the parameters; usually nvme-{o.transport} is not "
                     f"loaded (modprobe nvme-{o.transport}); ")
        elif "permission denied" in text or "operation not permitted" in text:
            first = "run the service as root (writing /dev/nvme-fabrics needs CAP_SYS_ADMIN); "
        host = o.hostnqn or "the host NQN in /etc/nvme/hostnqn"
        return (f"{first}check that modprobe nvme-{o.transport} succeeded, that "
                f"{o.traddr} port {o.trsvcid} is reachable over {o.transport}, and that "
                f"subsystem {o.subnqn} exists on the target and allows {host}")

    def _run(self, args: list[str], deadline: Deadline, what: str
             ) -> subprocess.CompletedProcess[str]:
        argv = [self._nvme_bin, *args]
        timeout = deadline.remaining(minimum=1.0)
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except FileNotFoundError as ex:
            raise StorageError(
                f"device {self.spec.name!r}: cannot run {self._nvme_bin!r} for nvme {what}: "
                "not found", "install nvme-cli (apt-get install nvme-cli)", errno=ex.errno,
            ) from ex
        except subprocess.TimeoutExpired as ex:
            raise StorageError(
                f"device {self.spec.name!r}: `{' '.join(argv)}` did not finish within "
                f"{timeout:.1f}s",
                f"check that {self.opts.traddr} port {self.opts.trsvcid} is reachable and "
                "the target is responsive; raise attach's timeout_s for slow fabrics",
            ) from ex

    def _target(self) -> str:
        o = self.opts
        return f"{o.transport}://{o.traddr}:{o.trsvcid} subsystem {o.subnqn}"


def _parse_address(text: str) -> dict[str, str]:
    """`traddr=10.0.0.2,trsvcid=4420,src_addr=...` -> dict."""
    pairs = (item.split("=", 1) for item in text.strip().split(",") if "=" in item)
    return {key.strip(): value.strip() for key, value in pairs}


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _tail(text: str, limit: int = 600) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "..." + text[-limit:]
