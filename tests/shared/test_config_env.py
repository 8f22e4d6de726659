"""Config only through the schema: every ``CTXMEM_*`` environment variable the code of
``dpu/``, ``host/`` and ``shared/`` names (and the benchmark harness that runs inside a
service, ``tools/ctxmem_tools/bench/authoff/``) is listed, with why it is not a config key, in
``ctxmem_common.config_env.ENVIRONMENT`` (which docs/config.md renders), every listed one is
still read, and the tuning knobs that were variables are schema keys with their defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ctxmem_common.config import parse_config, reference_markdown
from ctxmem_common.config_env import ENVIRONMENT
from ctxmem_common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"CTXMEM_[A-Z0-9_]+")
# The code that runs in a service process: the product's, and the benchmark harness that
# `ctxmem bench --auth-ab` loads into a service (its sitecustomize.py).
TOPS = ("dpu", "host", "shared", "tools/ctxmem_tools/bench/authoff")


def _named_in_code() -> dict[str, list[str]]:
    """Every CTXMEM_* name in the product's source (comments and docstrings included: a
    docstring that names a variable the code no longer reads is stale too) -> files."""
    found: dict[str, list[str]] = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "config_env.py" or "_pb2" in path.name:
                continue
            for name in set(NAME.findall(path.read_text())):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_code_names_is_listed_with_its_reason() -> None:
    listed = {v.name for v in ENVIRONMENT}
    unlisted = {}
    for name, files in _named_in_code().items():
        if name.endswith("_"):  # a prefix (f"CTXMEM_TLS_{k.upper()}"): its names are listed
            if not any(v.startswith(name) for v in listed):
                unlisted[name] = files
        elif name not in listed:
            unlisted[name] = files
    assert not unlisted, (
        f"CTXMEM_* environment variables named in the code but not listed in "
        f"ctxmem_common.config_env.ENVIRONMENT: {unlisted}; make a tuning knob a config key "
        f"(ctxmem_common.config), or list the variable there with why it stays")


# A read of the process environment by a literal name: os.environ.get("X"),
# environ["X"], env.setdefault("X", ...) in a module that touches the environment.
READ = re.compile(r'(?:\.(?:get|setdefault|pop)\(\s*|environ\[\s*)"([A-Z][A-Z0-9_]*)"')
# The WSGI request's environ in ctxmem_dpu.metrics (request fields, not the process's).
WSGI = {"PATH_INFO", "REQUEST_METHOD", "CONTENT_LENGTH", "HTTP_"}


def _read_by_name() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text()
            if path.name == "config_env.py" or ("environ" not in text and
                                                "getenv" not in text):
                continue
            for name in set(READ.findall(text)) - WSGI:
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_other_variable_read_by_name_is_listed() -> None:
    listed = {v.name for v in ENVIRONMENT}
    read = _read_by_name()
    assert {"NOTIFY_SOCKET", "XDG_RUNTIME_DIR", "CI"} <= set(read)  # the scan sees them
    assert {n: f for n, f in read.items() if n not in listed} == {}


def test_every_listed_variable_is_still_named_in_the_code() -> None:
    named = set(_named_in_code()) | set(_read_by_name())
    stale = [v.name for v in ENVIRONMENT
             if v.name not in named and not any(v.name.startswith(p) for p in named
                                                if p.endswith("_"))]
    assert stale == []
    assert len({v.name for v in ENVIRONMENT}) == len(ENVIRONMENT)
    assert all(v.read_by and v.why for v in ENVIRONMENT)


def test_the_reference_lists_every_variable() -> None:
    doc = reference_markdown()
    section = doc[doc.index("## Environment variables"):]
    assert [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")] \
        == [v.name for v in ENVIRONMENT]


@pytest.mark.parametrize("gone", ["CTXMEM_FLASH_SLOW_IO_S", "CTXMEM_FLASH_PROBE_INTERVAL_S",
                                  "CTXMEM_COLD_PIECE_BYTES"])
def test_former_variables_are_config_keys_now(gone: str) -> None:
    assert gone not in _named_in_code()


def test_flash_tuning_keys_keep_their_defaults_and_validate() -> None:
    cfg = parse_config("{}")
    assert (cfg.flash.slow_io_s, cfg.flash.probe_interval_s, cfg.flash.cold_piece_bytes) \
        == (2.0, 2.0, 0)
    cfg = parse_config("flash: {slow_io_s: 0.5, probe_interval_s: 0.05, "
                       "cold_piece_bytes: 16MiB}")
    assert (cfg.flash.slow_io_s, cfg.flash.probe_interval_s, cfg.flash.cold_piece_bytes) \
        == (0.5, 0.05, 16 << 20)
    for bad in ("slow_io_s: 0", "probe_interval_s: -1"):
        with pytest.raises(ConfigError, match=r"flash\.slow_io_s and flash\.probe_interval_s"):
            parse_config(f"flash: {{{bad}}}")
