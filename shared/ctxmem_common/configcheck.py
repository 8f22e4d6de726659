"""``ctxmem config check FILE``: validate a config before deploying it.

The file goes through the one typed loader the service uses (``load_config``: every key,
the cross-field rules, the storage backends' ``kernel:``/``spdk:`` sub-keys); on success
the effective config, every default filled in, is printed as YAML. Nothing is started,
opened, bound or created (the service's start-time identity rule, a pure check, runs
too): files the config names (flash devices, key and certificate
files, SPDK's socket) are only looked up with ``os.path.exists`` and reported as
warnings on stderr when missing, since they may well exist only on the target machine;
the index's client key, CA and certificate (``pod.index_*_file``), when present, must be
readable and the key private, as the service requires at start (else invalid). An index
reached without a password or client certificate is invalid beyond loopback (the service
refuses it; a warning only when the password may come from ``pod.index_password_env`` on
the target machine) and a warning on loopback.
Exit status: 0 valid, 2 invalid (the loader's message names the key and the problem).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

import yaml

from ctxmem_common.config import Config, load_config
from ctxmem_common.config_pod import index_auth_problem
from ctxmem_common.errors import CtxmemError
from ctxmem_common.identity import check_identity_mode
from ctxmem_common.safepaths import read_tls_key_file

REDACTED = "<redacted>"


def effective_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data, defaults included (``None`` sub-sections left out)."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x is not None}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    out: dict[str, Any] = clean(dataclasses.asdict(cfg))
    # Secrets are not echoed: a checked config's output may end up in a CI log.
    out["service"]["tenant_tokens"] = dict.fromkeys(out["service"]["tenant_tokens"], REDACTED)
    return out


def referenced_files(cfg: Config) -> list[tuple[str, str]]:
    """(key path, file) for every file or device the config names."""
    out: list[tuple[str, str]] = []

    def add(key: str, path: str | None) -> None:
        if path:
            out.append((key, path))

    add("encryption.key_file", cfg.encryption.key_file)
    add("tls.cert_file", cfg.tls.cert_file)
    add("tls.key_file", cfg.tls.key_file)
    add("tls.client_ca_file", cfg.tls.client_ca_file)
    if cfg.pod.enabled:
        for key in ("index_ca_file", "index_cert_file", "index_key_file", "tls_cert_file",
                    "tls_key_file", "tls_ca_file"):
            add(f"pod.{key}", getattr(cfg.pod, key))
    for i, dev in enumerate(cfg.flash.devices):
        where = f"flash.devices[{i}]"
        if dev.backend == "local" and not dev.create:
            add(f"{where}.path", dev.path)
        elif dev.backend == "local":
            add(f"{where}.path (its directory)", os.path.dirname(dev.path) or ".")
        if dev.spdk is not None:
            add(f"{where}.spdk.rpc_socket", dev.spdk.rpc_socket)
            add(f"{where}.spdk.psk_path", dev.spdk.psk_path)
            add(f"{where}.spdk.crypto.key_file", dev.spdk.crypto.key_file)
    return out


def missing_files(cfg: Config) -> list[str]:
    """A warning line per referenced file that does not exist on this machine."""
    return [f"{key}: {path} does not exist on this machine (fine if it will on the target)"
            for key, path in referenced_files(cfg) if not os.path.exists(path)]


def unsafe_files(cfg: Config) -> list[str]:
    """An error line per file the config names that exists here but the service would
    refuse at start: ``pod.index_key_file`` not private (the rule of every ctxmem key file,
    :func:`~ctxmem_common.safepaths.read_tls_key_file`) or not readable, and the index's
    client certificate or CA not readable."""
    out: list[str] = []
    if not cfg.pod.enabled:
        return out
    for key in ("index_ca_file", "index_cert_file", "index_key_file"):
        path = getattr(cfg.pod, key)
        if not path or not os.path.exists(path):
            continue  # a missing file is a warning (missing_files)
        try:
            if key == "index_key_file":
                read_tls_key_file(path, "TLS client key file (pod.index_key_file)")
            else:
                with open(path, "rb"):
                    pass
        except CtxmemError as exc:
            out.append(str(exc))
        except OSError as exc:
            out.append(f"pod.{key}: {path} cannot be read: {exc.strerror or exc} "
                       f"(errno {exc.errno})")
    return out


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser (also what tests/deploy/test_doc_shell_blocks.py
    checks the documented command lines with)."""
    p = argparse.ArgumentParser(
        prog="ctxmem config", description="Check a config file without starting anything.")
    sub = p.add_subparsers(dest="action", required=True)
    chk = sub.add_parser("check", help="validate FILE and print the effective config (YAML, "
                         "defaults filled in); missing referenced files are warnings")
    chk.add_argument("file", help="the YAML config file to check")
    chk.add_argument("--quiet", action="store_true", help="print nothing when valid")
    return p


def config_command(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.file)
        identity = check_identity_mode(cfg)  # the start-time rule: no open listener
    except CtxmemError as exc:
        print(f"ctxmem config check: invalid: {exc}", file=sys.stderr)
        return 2
    fatal, index_problem = index_auth_problem(cfg.pod)
    if fatal and not (cfg.pod.index_password_env and cfg.pod.index_password_env
                      not in os.environ):
        unsafe = [index_problem, *unsafe_files(cfg)]
    else:
        unsafe = unsafe_files(cfg)
        if fatal:  # the password may come from the variable on the target machine
            print(f"warning: {index_problem} (${cfg.pod.index_password_env} is not set "
                  f"here; the service refuses to start unless it is set there)",
                  file=sys.stderr)
        elif index_problem:
            print(f"warning: {index_problem}", file=sys.stderr)
    if unsafe:
        for line in unsafe:
            print(f"ctxmem config check: invalid: {line}", file=sys.stderr)
        return 2
    for line in missing_files(cfg):
        print(f"warning: {line}", file=sys.stderr)
    if not args.quiet:
        print(f"# {args.file}: valid (identity mode {identity}); the effective config, "
              f"defaults filled in, tenant tokens redacted", flush=True)
        print(yaml.safe_dump(effective_dict(cfg), sort_keys=False), end="")
    return 0
