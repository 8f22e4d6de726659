"""systemd's readiness protocol (``sd_notify``), without libsystemd.

With ``Type=notify`` systemd sets ``$NOTIFY_SOCKET`` to a Unix datagram socket (a path,
or an abstract name written with a leading ``@``) and waits for ``READY=1`` before it
counts the service as started; ``STOPPING=1`` says a stop has begun and ``STATUS=`` is
the one-line status ``systemctl status`` shows. Each message is one datagram of
``KEY=VALUE`` lines. Without ``$NOTIFY_SOCKET`` (not under systemd) nothing is sent.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 1.0


def notify(*fields: str, env: dict[str, str] | None = None) -> bool:
    """Send ``fields`` (``"READY=1"``, ``"STATUS=..."``) as one datagram to
    ``$NOTIFY_SOCKET``; ``False`` when there is none or the send failed (logged: a
    supervisor that cannot hear us must not stop the service)."""
    addr = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr[0] not in "/@":
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract name (@...); "
                    "readiness not sent", addr)
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr
    payload = "\n".join(f.replace("\n", " ") for f in fields).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(SEND_TIMEOUT_S)
            s.sendto(payload, target)
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s (systemd will not see %s; check the "
                    "unit's NotifyAccess=)", addr, exc, ", ".join(fields))
        return False
    return True
