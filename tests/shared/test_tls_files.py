"""TLS files and names: the key-file check (Kubernetes Secret links accepted, others not),
the tenant a certificate names, the config rules, and the engines' TLS keys."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography import x509

from ctxmem.integrations._common import resolve_tls
from ctxmem_common.config import config_from_dict
from ctxmem_common.errors import ConfigError
from ctxmem_common.identity import check_identity_mode
from ctxmem_common.safepaths import UnsafePathError, read_tls_key_file
from ctxmem_common.tlsident import tenant_of_certificate
from ctxmem_tools.bench.security_pki import make_pki


def test_key_file_symlink_inside_its_directory_is_accepted(tmp_path: Path) -> None:
    # The layout of a Kubernetes Secret volume: tls.key -> ..data/tls.key -> ..TS/tls.key
    vol = tmp_path / "tls"
    (vol / "..2026_01_01").mkdir(parents=True)
    real = vol / "..2026_01_01" / "tls.key"
    fd = os.open(real, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"KEY")
    os.close(fd)
    (vol / "..data").symlink_to("..2026_01_01")
    (vol / "tls.key").symlink_to("..data/tls.key")
    assert read_tls_key_file(vol / "tls.key") == b"KEY"


def test_key_file_symlink_out_of_its_directory_or_readable_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.key"
    fd = os.open(outside, os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "tls.key").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="outside its own directory"):
        read_tls_key_file(tmp_path / "tls" / "tls.key")
    os.chmod(outside, 0o644)
    with pytest.raises(UnsafePathError, match="read or written by group or other"):
        read_tls_key_file(outside)


def test_tenant_from_uri_san_else_cn(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, tenants=("alice",))
    cert = x509.load_pem_x509_certificate(pki.client["alice"][0].read_bytes())
    assert tenant_of_certificate(cert) == "alice"  # the SAN, not the CN "cn-alice"
    server = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    assert tenant_of_certificate(server) == "ctxmem-test-server"  # no tenant SAN: the CN


def test_tls_config_rules() -> None:
    with pytest.raises(ConfigError, match="set both"):
        config_from_dict({"tls": {"cert_file": "/x"}})
    with pytest.raises(ConfigError, match="mutual TLS needs"):
        config_from_dict({"tls": {"client_ca_file": "/x"}})
    wild = {"listen": "0.0.0.0:1", "data_listen": "0.0.0.0:2", "insecure": True}
    with pytest.raises(ConfigError, match="non-loopback"):
        check_identity_mode(config_from_dict({"service": wild}))
    with pytest.raises(ConfigError, match="non-loopback"):  # server-only TLS is not identity
        check_identity_mode(config_from_dict({"service": wild, "tls": {
            "cert_file": "/c", "key_file": "/k"}}))
    assert check_identity_mode(config_from_dict({"service": wild, "tls": {
        "cert_file": "/c", "key_file": "/k", "client_ca_file": "/ca"}})) == "mtls"


def test_engine_tls_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {"ctxmem.tls_ca_file": "/ca.crt", "ctxmem.tls_server_name": "svc"}
    tls = resolve_tls(lambda k, d: extra.get(f"ctxmem.{k}", d))
    assert tls is not None and tls.ca_file == "/ca.crt" and tls.server_name == "svc"
    assert resolve_tls(lambda k, d: d) is None
    monkeypatch.setenv("CTXMEM_TLS_CA_FILE", "/env-ca.crt")
    tls = resolve_tls(lambda k, d: d)
    assert tls is not None and tls.ca_file == "/env-ca.crt"
