"""The image build's step progress (deploy/image/progress.sh, sourced by build.sh): on a
terminal "[i/N] STEP — elapsed, ETA" from the last run's timings; nothing on a pipe or in
CI; the timings file rewritten by every run. The build itself needs root and minutes
(deploy/image/smoke.sh); these drive the same functions with made-up steps.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = ROOT / "deploy" / "image" / "progress.sh"
SCRIPT = f""". {PROGRESS}
progress_init "$1" base wheels layers
progress_step base
progress_step wheels
sleep 1
progress_step layers
progress_finish
"""


def run(timings: Path, tty: bool, ci: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "CTXMEM_PROGRESS")}
    if ci:
        env["CI"] = "true"
    if not tty:
        proc = subprocess.run(["bash", "-c", SCRIPT, "build", str(timings)], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr
    master, slave = pty.openpty()
    try:
        proc2 = subprocess.run(["bash", "-c", SCRIPT, "build", str(timings)], env=env,
                               stdout=subprocess.PIPE, stderr=slave, timeout=60)
        out = b""
        while select.select([master], [], [], 0.2)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            out += chunk
    finally:
        os.close(slave)
        os.close(master)
    assert proc2.returncode == 0, out
    return out.decode("utf-8", "replace").replace("\r\n", "\n")


def test_eta_from_the_last_run_on_a_terminal(tmp_path: Path) -> None:
    timings = tmp_path / "timings.txt"
    timings.write_text("base 5\nwheels 70\nlayers 30\n")
    out = run(timings, tty=True)
    lines = out.strip().splitlines()
    assert re.fullmatch(r"\[1/3\] base — 0 s elapsed, ETA ~1 min 45 s \(from the last "
                        r"run's timings\)", lines[0]), out
    assert lines[1].startswith("[2/3] wheels — ") and "ETA ~1 min 40 s" in lines[1], out
    assert lines[2].startswith("[3/3] layers — ") and "ETA ~30 s" in lines[2], out
    assert re.fullmatch(r"\[3/3\] done in \d+ s", lines[3]), out
    # This run's timings replace the last run's: wheels took the 1 s sleep.
    got = dict(line.split() for line in timings.read_text().splitlines())
    assert set(got) == {"base", "wheels", "layers"}
    assert 1 <= int(got["wheels"]) <= 5 and int(got["base"]) <= 1


def test_first_run_has_no_eta(tmp_path: Path) -> None:
    out = run(tmp_path / "none" / "timings.txt", tty=True)
    assert "[1/3] base — 0 s elapsed, no ETA yet" in out, out
    assert (tmp_path / "none" / "timings.txt").is_file()


def test_quiet_on_a_pipe_and_in_ci(tmp_path: Path) -> None:
    timings = tmp_path / "timings.txt"
    assert run(timings, tty=False) == ""
    assert timings.is_file()  # still recorded, for the next run on a terminal
    assert run(timings, tty=True, ci=True) == ""


def test_build_sh_reports_its_five_steps() -> None:
    script = (ROOT / "deploy" / "image" / "build.sh").read_text()
    assert '. "$HERE/progress.sh"' in script
    init = re.search(r"^progress_init \S+ (.+)$", script, re.M)
    assert init, "build.sh does not call progress_init"
    steps = init.group(1).split()
    assert steps == re.findall(r"^progress_step (\S+)$", script, re.M)
    assert len(steps) == 5
    assert script.index("progress_finish") > script.index("progress_step output")
