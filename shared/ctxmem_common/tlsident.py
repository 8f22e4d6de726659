"""Who a client certificate names: the tenant of a mutual-TLS peer (docs/security.md,
"TLS and mTLS").

The service and the tests read a tenant out of a certificate the same way:

1. the first URI subjectAltName of the form ``ctxmem://tenant/NAME`` gives ``NAME``;
2. else the subject's commonName (CN).

A certificate naming neither has no tenant (``None``): the service refuses it. The
certificate has already been verified against ``tls.client_ca_file`` by the TLS stack
when these run; this module only reads names, it does not verify anything.
"""

from __future__ import annotations

from urllib.parse import unquote

from cryptography import x509
from cryptography.x509.oid import NameOID

__all__ = ["TENANT_URI_PREFIX", "tenant_of_certificate", "tenant_of_der", "tenant_of_pem"]

TENANT_URI_PREFIX = "ctxmem://tenant/"


def tenant_of_certificate(cert: x509.Certificate) -> str | None:
    """The tenant ``cert`` names: its ``ctxmem://tenant/NAME`` URI SAN, else its subject
    CN, else None."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = None
    if san is not None:
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith(TENANT_URI_PREFIX):
                name = unquote(uri[len(TENANT_URI_PREFIX):]).strip("/")
                if name:
                    return name
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if cns:
        value = cns[0].value
        name = value.decode() if isinstance(value, bytes) else str(value)
        return name or None
    return None


def tenant_of_der(der: bytes) -> str | None:
    """:func:`tenant_of_certificate` of a DER certificate (``SSLObject.getpeercert(True)``)."""
    return tenant_of_certificate(x509.load_der_x509_certificate(der))


def tenant_of_pem(pem: bytes) -> str | None:
    """:func:`tenant_of_certificate` of the first PEM certificate in ``pem`` (gRPC's
    ``x509_pem_cert`` auth-context property)."""
    return tenant_of_certificate(x509.load_pem_x509_certificate(pem))
