"""Issue 30 item 1: what the S3 endpoint refuses, against a REAL service.

An unsigned request, a bad signature, an unknown access key, a request signed 20 minutes
ago, a body that is not the one signed, a body over s3.max_put_bytes: each gets its S3
XML error (never a traceback), nothing is stored, and the service keeps serving. The
listener is bounded like the others (docs/security.md, "Listeners"): a slow-loris head
is cut off at s3.head_timeout_s, and over s3.max_unauthenticated silent connections the
oldest is closed while a signed request is still served.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import socket
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from ctxmem_tools.launcher import ServiceProcess, free_port, local_config
from tests.adversary.floods import closed_unanswered, trickle_until_cut

boto3 = pytest.importorskip("boto3")
from botocore.auth import S3SigV4Auth  # noqa: E402
from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.config import Config as BotoConfig  # noqa: E402
from botocore.credentials import Credentials  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

KEY_ID, SECRET = "AKIAREFUSALS1", "refusal-tests-secret-0123456789abcdef"
HEAD_TIMEOUT_S = 2.0
MAX_UNAUTH = 4
MiB = 1 << 20


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, int]]:
    workdir = tmp_path_factory.mktemp("s3refusals")
    port = free_port()
    cfg = local_config(workdir, flash_size=None, s3={
        "listen": f"127.0.0.1:{port}", "chunk_size": "1MiB", "max_put_bytes": "2MiB",
        "head_timeout_s": HEAD_TIMEOUT_S, "max_unauthenticated": MAX_UNAUTH,
        "max_unauthenticated_per_source": MAX_UNAUTH,
        "access_keys": {KEY_ID: {"tenant": "t1", "secret": SECRET}}})
    with ServiceProcess(workdir, cfg) as svc:
        yield svc, port


def client(port: int, key_id: str = KEY_ID, secret: str = SECRET) -> Any:
    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}",
                        region_name="us-east-1", aws_access_key_id=key_id,
                        aws_secret_access_key=secret,
                        config=BotoConfig(s3={"addressing_style": "path"},
                                          retries={"max_attempts": 1, "mode": "standard"}))


def still_serves(port: int) -> None:
    c = client(port)
    c.put_object(Bucket="okb", Key="probe", Body=b"alive")
    assert c.get_object(Bucket="okb", Key="probe")["Body"].read() == b"alive"


def signed(port: int, method: str, path: str, body: bytes = b"", *,
           when: datetime.datetime | None = None, payload_sha: str | None = None,
           extra: dict[str, str] | None = None) -> urllib.request.Request:
    """A request signed by botocore's own signer, at ``when`` (default now), claiming
    ``payload_sha`` for its body (default the body's real SHA-256)."""
    stamp = (when or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    url = f"http://127.0.0.1:{port}{path}"
    sha = payload_sha or hashlib.sha256(body).hexdigest()
    req = AWSRequest(method=method, url=url, data=body,
                     headers={"host": f"127.0.0.1:{port}", "x-amz-date": stamp,
                              "x-amz-content-sha256": sha, **(extra or {})})
    req.context["timestamp"] = stamp
    signer = S3SigV4Auth(Credentials(KEY_ID, SECRET), "s3", "us-east-1")
    canonical = signer.canonical_request(req)
    sig = signer.signature(signer.string_to_sign(req, canonical), req)
    headers = dict(req.headers.items())
    headers["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={signer.scope(req)}, SignedHeaders="
        f"{signer.signed_headers(signer.headers_to_sign(req))}, Signature={sig}")
    return urllib.request.Request(url, data=body or None, method=method, headers=headers)


def answer(req: urllib.request.Request) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_unsigned_request_is_refused_with_xml(s3: tuple[ServiceProcess, int]) -> None:
    _, port = s3
    code, body = answer(urllib.request.Request(f"http://127.0.0.1:{port}/ok/probe"))
    assert code == 403
    assert "<Code>AccessDenied</Code>" in body and "Traceback" not in body
    still_serves(port)


@pytest.mark.parametrize(("key_id", "secret", "code"), [
    (KEY_ID, "not-the-secret-at-all-0123456789abcd", "SignatureDoesNotMatch"),
    ("AKIANOSUCHKEY", SECRET, "InvalidAccessKeyId"),
])
def test_bad_signature_and_unknown_key_get_403(s3: tuple[ServiceProcess, int], key_id: str,
                                               secret: str, code: str) -> None:
    _, port = s3
    bad = client(port, key_id, secret)
    for call in (lambda: bad.put_object(Bucket="okb", Key="forged", Body=b"x"),
                 lambda: bad.get_object(Bucket="okb", Key="probe"),
                 lambda: bad.list_objects_v2(Bucket="okb")):
        with pytest.raises(ClientError) as exc:
            call()
        assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        assert exc.value.response["Error"]["Code"] == code
    with pytest.raises(ClientError):
        client(port).head_object(Bucket="okb", Key="forged")  # nothing was stored
    still_serves(port)


def test_hand_signed_request_is_served_and_a_skewed_one_refused(
        s3: tuple[ServiceProcess, int]) -> None:
    _, port = s3
    code, _ = answer(signed(port, "PUT", "/okb/hand", b"by hand"))
    assert code == 200
    assert answer(signed(port, "GET", "/okb/hand")) == (200, "by hand")
    old = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=20)
    code, body = answer(signed(port, "GET", "/okb/hand", when=old))
    assert code == 403 and "<Code>RequestTimeTooSkewed</Code>" in body


def test_a_body_other_than_the_signed_one_is_not_stored(
        s3: tuple[ServiceProcess, int]) -> None:
    _, port = s3
    req = signed(port, "PUT", "/okb/swapped", b"forged body",
                 payload_sha=hashlib.sha256(b"signed body").hexdigest())
    code, body = answer(req)
    assert code == 400 and "<Code>XAmzContentSHA256Mismatch</Code>" in body
    with pytest.raises(ClientError):
        client(port).head_object(Bucket="okb", Key="swapped")
    still_serves(port)


def aws_chunked(data: bytes, crc: int, chunk: int = 4) -> bytes:
    """``data`` in the SDKs' aws-chunked framing, a trailing x-amz-checksum-crc32."""
    out = b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + chunk]), data[i:i + chunk])
                   for i in range(0, len(data), chunk))
    crc64 = base64.b64encode(crc.to_bytes(4, "big"))
    return out + b"0\r\nx-amz-checksum-crc32:" + crc64 + b"\r\n\r\n"


@pytest.mark.parametrize("good", [True, False])
def test_aws_chunked_trailer_checksum_is_checked(s3: tuple[ServiceProcess, int],
                                                 good: bool) -> None:
    _, port = s3
    data = b"hello, chunked world"
    crc = zlib.crc32(data) ^ (0 if good else 1)
    key = f"/okb/chunked-{good}"
    req = signed(port, "PUT", key, aws_chunked(data, crc),
                 payload_sha="STREAMING-UNSIGNED-PAYLOAD-TRAILER",
                 extra={"content-encoding": "aws-chunked",
                        "x-amz-decoded-content-length": str(len(data)),
                        "x-amz-trailer": "x-amz-checksum-crc32"})
    code, body = answer(req)
    if good:
        assert code == 200, body
        assert answer(signed(port, "GET", key)) == (200, data.decode())
    else:
        assert code == 400 and "<Code>BadDigest</Code>" in body
        assert answer(signed(port, "GET", key))[0] == 404  # nothing stored
    still_serves(port)


def test_oversized_body_is_refused(s3: tuple[ServiceProcess, int]) -> None:
    _, port = s3
    c = client(port)
    with pytest.raises(ClientError) as exc:  # a file-like body: Expect: 100-continue
        c.put_object(Bucket="okb", Key="big", Body=io.BytesIO(bytes(3 * MiB)))
    assert exc.value.response["Error"]["Code"] == "EntityTooLarge"
    with pytest.raises(ClientError):
        c.head_object(Bucket="okb", Key="big")
    still_serves(port)


def test_slow_loris_is_cut_at_the_head_deadline(s3: tuple[ServiceProcess, int]) -> None:
    _, port = s3
    loris = socket.create_connection(("127.0.0.1", port))
    closed_after = trickle_until_cut(loris, b"GET /ok/probe HTTP/1.1\r\nHost: x\r\n",
                                     HEAD_TIMEOUT_S + 5)
    assert closed_after is not None, "a client trickling header lines was never cut off"
    assert closed_after < HEAD_TIMEOUT_S + 2
    still_serves(port)


def test_over_the_cap_the_oldest_silent_connection_is_closed(
        s3: tuple[ServiceProcess, int]) -> None:
    _, port = s3
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_UNAUTH)]
    try:
        time.sleep(0.3)
        still_serves(port)  # a new connection, signed at once: served
        if not closed_unanswered(held[0]):
            pytest.fail("the oldest silent connection was kept over s3.max_unauthenticated")
    finally:
        for s in held:
            s.close()


def test_mutual_tls_certificate_must_name_the_keys_tenant(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """With tls.client_ca_file the S3 port requires a client certificate, and the tenant
    it names must be the access key's: alice's key with bob's certificate is refused."""
    from ctxmem_tools.bench.security_pki import make_pki

    root = tmp_path_factory.mktemp("s3mtls")
    pki = make_pki(root / "pki")
    port = free_port()
    cfg = local_config(root / "svc", flash_size=None, transports=["tcp"], s3={
        "listen": f"127.0.0.1:{port}", "access_keys": {KEY_ID: {"tenant": "alice",
                                                                "secret": SECRET}}},
        tls={"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
             "client_ca_file": str(pki.ca)})
    with ServiceProcess(root / "svc", cfg):
        def tls_client(tenant: str | None) -> Any:
            return boto3.client(
                "s3", endpoint_url=f"https://127.0.0.1:{port}", region_name="us-east-1",
                aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET, verify=str(pki.ca),
                config=BotoConfig(s3={"addressing_style": "path"},
                                  retries={"max_attempts": 1, "mode": "standard"},
                                  client_cert=tuple(map(str, pki.client[tenant]))
                                  if tenant else None))

        alice = tls_client("alice")
        alice.put_object(Bucket="mtls", Key="k", Body=b"alice's")
        assert alice.get_object(Bucket="mtls", Key="k")["Body"].read() == b"alice's"
        with pytest.raises(ClientError) as exc:
            tls_client("bob").get_object(Bucket="mtls", Key="k")
        assert exc.value.response["Error"]["Code"] == "AccessDenied"
        with pytest.raises(Exception) as no_cert:  # the TLS layer refuses it
            tls_client(None).get_object(Bucket="mtls", Key="k")
        assert not isinstance(no_cert.value, ClientError)  # no HTTP answer at all
        assert alice.get_object(Bucket="mtls", Key="k")["Body"].read() == b"alice's"


def test_presigned_urls_served_until_they_expire(s3: tuple[ServiceProcess, int]) -> None:
    """A presigned GET and PUT (query-string SigV4, botocore's presigner) are served; the
    same URL with another key, or past its expiry, is refused."""
    _, port = s3
    c = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                     aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
                     config=BotoConfig(s3={"addressing_style": "path"},
                                       signature_version="s3v4"))
    put_url = c.generate_presigned_url("put_object", Params={"Bucket": "okb",
                                                             "Key": "pre/x y"}, ExpiresIn=60)
    assert answer(urllib.request.Request(put_url, data=b"presigned", method="PUT"))[0] == 200
    url = c.generate_presigned_url("get_object", Params={"Bucket": "okb", "Key": "pre/x y"},
                                   ExpiresIn=60)
    assert answer(urllib.request.Request(url)) == (200, "presigned")
    code, body = answer(urllib.request.Request(url.replace("pre/x%20y", "pre/other")))
    assert code == 403 and "<Code>SignatureDoesNotMatch</Code>" in body
    short = c.generate_presigned_url("get_object", Params={"Bucket": "okb",
                                                           "Key": "pre/x y"}, ExpiresIn=1)
    time.sleep(2.2)
    code, body = answer(urllib.request.Request(short))
    assert code == 403 and "expired" in body
    # boto3's default presigner for a custom endpoint is Signature Version 2: refused.
    v2 = client(port).generate_presigned_url("get_object", Params={"Bucket": "okb",
                                                                   "Key": "pre/x y"})
    assert "Signature=" in v2 and answer(urllib.request.Request(v2))[0] == 403
