"""Who may call the service, and from where: identity modes and the listen-address rule.

Three modes, chosen explicitly in the config (``docs/security.md``, "Authentication and
identity", "TLS and mTLS"):

* **mtls** (``tls.client_ca_file`` set, with the server's ``tls.cert_file``/``key_file``):
  every client presents a certificate signed by that CA, and the tenant is the one the
  certificate names (:func:`ctxmem_common.tlsident.tenant_of_certificate`), never the
  request's. With ``service.tenant_tokens`` set as well, Connect must also present the
  token. Any listen address is allowed. The recommended mode.
* **tokens** (``service.tenant_tokens`` non-empty): Connect must present the tenant's
  token. Any listen address is allowed (with TLS on, the tokens and the data are
  encrypted; without it they cross the network in clear, and the service warns).
* **insecure** (``service.insecure: true``, no tokens): the service trusts the tenant
  name a client sends, so every client is one trust domain. Allowed only when every
  listen address is loopback or a Unix socket; the service logs a warning at start.

A config with none is refused at start: nothing listens without an identity rule.
Server-only TLS encrypts but does not say who the client is, so it does not make the
insecure mode acceptable beyond loopback: that takes mTLS or tokens.
:func:`check_identity_mode` is the one place that decides.

After Connect, every call proves its session with the session token as the call
metadata :data:`SESSION_TOKEN_METADATA_KEY` (binary: the ``-bin`` suffix), or, on the
metrics port's JSON Locate, as the header :data:`SESSION_TOKEN_HTTP_HEADER` (hex).
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Literal

from ctxmem_common.errors import ConfigError

if TYPE_CHECKING:
    from ctxmem_common.config import Config

SESSION_TOKEN_METADATA_KEY = "ctxmem-session-token-bin"
#: The same token, hex, as an HTTP header: the metrics port's ``POST`` :data:`LOCATE_PATH`.
SESSION_TOKEN_HTTP_HEADER = "ctxmem-session-token"
#: Locate as JSON on the metrics port (docs/operations.md, "Routers").
LOCATE_PATH = "/v1/locate"

IdentityMode = Literal["mtls", "tokens", "insecure"]


def is_local_listen(listen: str) -> bool:
    """Whether a listen address reaches only this host: a loopback IP (127.0.0.0/8,
    ``::1``), ``localhost``, or a Unix socket (``unix:``/``unix-abstract:``)."""
    text = listen.strip()
    if text.startswith(("unix:", "unix-abstract:")):
        return True
    host = text.rpartition(":")[0] if ":" in text else text
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, "", "0.0.0.0" or "::" may reach other hosts


def network_listens(cfg: Config) -> list[tuple[str, str]]:
    """``(config key, address)`` of every listener clients reach: the gRPC control plane
    and, with the TCP transport, the data plane. (RDMA connects over the gRPC channel;
    the metrics endpoint serves no tenant data.)"""
    out = [("service.listen", cfg.service.listen)]
    if "tcp" in cfg.service.transports:
        out.append(("service.data_listen", cfg.service.data_listen))
    return out


def check_identity_mode(cfg: Config) -> IdentityMode:
    """The identity mode ``cfg`` asks for, or ConfigError saying why the service must
    not start with it (and what to change).

    Raises:
        ConfigError: no mode, both modes, or insecure mode on a non-loopback address.
    """
    svc = cfg.service
    mutual = bool(cfg.tls.cert_file and cfg.tls.key_file and cfg.tls.client_ca_file)
    if svc.tenant_tokens and svc.insecure:
        raise ConfigError(
            "service.insecure: true and service.tenant_tokens are both set; pick one "
            "(remove service.insecure to require the tenants' tokens)")
    if svc.tenant_tokens:
        for tenant, token in svc.tenant_tokens.items():
            if "change-me" in token.lower():
                raise ConfigError(
                    f"service.tenant_tokens[{tenant!r}] is still the example's placeholder; "
                    f"set a secret token (e.g. `python -c 'import secrets; "
                    f"print(secrets.token_hex(16))'`)")
            if len(token) < 16:
                raise ConfigError(
                    f"service.tenant_tokens[{tenant!r}]: a token must be at least 16 "
                    f"characters (e.g. `python -c 'import secrets; "
                    f"print(secrets.token_hex(16))'`)")
        return "mtls" if mutual else "tokens"
    if mutual:
        return "mtls"  # the certificate names the tenant; service.insecure changes nothing
    exposed = [f"{key}={addr!r}" for key, addr in network_listens(cfg)
               if not is_local_listen(addr)]
    if not svc.insecure:
        raise ConfigError(
            "no identity mode: set tls.client_ca_file with tls.cert_file/key_file (mutual "
            "TLS: the client certificate names the tenant), or service.tenant_tokens "
            "(tenant -> token; Connect must present it), or, on one host only, "
            "service.insecure: true (trusts the tenant name; loopback or Unix-socket "
            "listen addresses only)")
    if exposed:
        raise ConfigError(
            f"service.insecure: true trusts the tenant name any client sends, so it is "
            f"refused on a non-loopback address ({', '.join(exposed)}), with or without "
            f"server-only TLS (which encrypts but does not identify the client); listen on "
            f"127.0.0.1, or set tls.client_ca_file (mutual TLS) or service.tenant_tokens")
    abstract = [f"{key}={addr!r}" for key, addr in network_listens(cfg)
                if addr.strip().startswith("unix-abstract:")]
    if abstract and svc.local_users != "shared":
        raise ConfigError(
            f"service.insecure: true with service.local_users: {svc.local_users} needs to "
            f"know which local user calls, and an abstract Unix socket ({', '.join(abstract)}) "
            f"has no file mode to restrict it: listen on 127.0.0.1 or a unix: path, or set "
            f"service.local_users: shared (any local user may act as any tenant)")
    return "insecure"


UID_SCOPE = "@uid"
"""What separates a tenant name from its user's uid in insecure mode (``NAME@uidN``)."""


def scoped_tenant(name: str, uid: int) -> str:
    """The tenant a local user other than the service's acts as: ``NAME@uidN``."""
    return f"{name}{UID_SCOPE}{uid}"


def tenant_scope(tenant: str) -> str:
    """The local user a tenant belongs to: ``"uidN"`` for ``NAME@uidN``, ``""`` for the
    service's own user (and every tenant of the tokens and mtls modes)."""
    return tenant.rpartition("@")[2] if UID_SCOPE in tenant else ""
