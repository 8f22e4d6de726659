"""The embedded default config (fallback mode on one host) that ``ctxmem serve`` uses
without ``--config``, with its paths resolved for the user loading it
(:mod:`ctxmem_common.safepaths`): never ``/tmp`` or ``/var/tmp``, where another local user
could prepare them."""

from __future__ import annotations

import json
import os
import typing

from ctxmem_common.safepaths import default_runtime_dir, default_state_dir

__all__ = ["DEFAULT_CONFIG_TEMPLATE", "default_config_yaml", "default_shm_socket"]


def default_shm_socket() -> str:
    """``service.shm_socket`` when unset: ``data.sock`` in :func:`default_runtime_dir`."""
    return os.path.join(default_runtime_dir(), "data.sock")


# The embedded default, with its paths left as {placeholders}: default_config_yaml()
# fills them in for the user loading it.
DEFAULT_CONFIG_TEMPLATE = """\
# ctxmem embedded default: fallback mode on one host, 1 GiB DRAM tier, a 4 GiB flash file.
# Paths resolved for this user: runtime {runtime_dir}, state {state_dir}.
mode: fallback
service:
  listen: "127.0.0.1:50051"
  data_listen: "127.0.0.1:50052"
  shm_socket: {shm_socket}
  transports: [shm, tcp]
  insecure: true          # loopback only: trusts the tenant name (docs/security.md)
metrics:
  listen: "127.0.0.1:9464"
dram:
  size: 1GiB
  slab_size: 64MiB
flash:
  write_policy: write_back
  slab_size: 256MiB
  devices:
    - name: flash0
      backend: local
      path: {flash_path}
      size: 4GiB
      create: true
encryption:
  enabled: true
  key_file: {key_file}
"""


def default_config_yaml(euid: int | None = None, env: typing.Mapping[str, str] | None = None
                        ) -> str:
    """The embedded default config with its paths resolved for user ``euid`` (default: the
    effective uid) and environment ``env`` (default: ``os.environ``): the shm socket in
    :func:`~ctxmem_common.safepaths.default_runtime_dir` (``/run/ctxmem`` as root, else
    ``$XDG_RUNTIME_DIR/ctxmem`` or ``/run/user/UID/ctxmem``), the flash file and master key
    in :func:`~ctxmem_common.safepaths.default_state_dir` (``/var/lib/ctxmem`` as root,
    else ``$XDG_STATE_HOME/ctxmem`` or ``~/.local/state/ctxmem``). This is what
    ``ctxmem serve --print-default-config`` prints."""
    run = default_runtime_dir(euid, env)
    state = default_state_dir(euid, env)
    # json.dumps: a valid YAML double-quoted scalar whatever the path holds.
    return DEFAULT_CONFIG_TEMPLATE.format(
        runtime_dir=run, state_dir=state,
        shm_socket=json.dumps(os.path.join(run, "data.sock")),
        flash_path=json.dumps(os.path.join(state, "flash0.img")),
        key_file=json.dumps(os.path.join(state, "master.key")))
