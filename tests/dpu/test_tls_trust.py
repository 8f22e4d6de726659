"""``ctxmem_dpu.tls.issued_by_bundle``: what a rotated client CA still trusts (issue 25,
item 5). Real certificates made with ``cryptography``: a root, an intermediate, leaves."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ctxmem_dpu.tls import issued_by_bundle


def _cert(cn: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, ca: bool
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    iname, ikey = issuer if issuer is not None else (name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(iname)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(ikey, hashes.SHA256()))
    return cert, key


def test_chains_to_a_root_of_the_bundle_only() -> None:
    root, root_key = _cert("root", None, True)
    inter, inter_key = _cert("inter", (root.subject, root_key), True)
    leaf, _ = _cert("alice", (inter.subject, inter_key), False)
    direct, _ = _cert("bob", (root.subject, root_key), False)
    other, other_key = _cert("root", None, True)  # same name, another key
    forged, _ = _cert("mallory", (other.subject, other_key), False)
    assert issued_by_bundle(direct, (root,))
    assert issued_by_bundle(leaf, (root, inter))
    assert not issued_by_bundle(leaf, (root,))  # the intermediate is not in the file
    assert not issued_by_bundle(leaf, (inter,))  # no root to end the chain
    assert not issued_by_bundle(direct, (other,))  # the name matches, the signature not
    assert not issued_by_bundle(forged, (root, inter))
    assert issued_by_bundle(forged, (root, other))
