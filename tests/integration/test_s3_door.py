"""The S3-compatible endpoint (docs/s3.md) driven by boto3 against a real service.

One service per module (s3.listen on a free loopback port, two access keys of two
tenants), the SDK with its default settings: put, get, ranged get (206, byte-exact),
head hit and miss, delete, ListObjectsV2 with a prefix and a delimiter, multipart (three
parts, complete, get byte-exact; abort frees the parts' blocks), path-style and
virtual-hosted addressing, the objects counted in the tenant's usage. The refusals
(bad signature, unknown key, oversized body, skewed clock) are in
tests/adversary/test_s3_refusals.py.
"""

from __future__ import annotations

import hashlib
import re
import socket
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxmem_tools.launcher import ServiceProcess, free_port, local_config

boto3 = pytest.importorskip("boto3")
from botocore.config import Config as BotoConfig  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

KEY_ID, SECRET = "AKIACTXMEMTEST1", "s3cret-for-the-tests-only-0123456789"
OTHER_ID, OTHER_SECRET = "AKIACTXMEMTEST2", "another-secret-for-the-tests-98765"
DOMAIN = "s3.test"
MiB = 1 << 20


def s3_section(port: int, **extra: Any) -> dict[str, Any]:
    return {"listen": f"127.0.0.1:{port}", "domain": DOMAIN, "chunk_size": "1MiB",
            "max_put_bytes": "6MiB",
            "access_keys": {KEY_ID: {"tenant": "s3t", "secret": SECRET},
                            OTHER_ID: {"tenant": "other", "secret_env": "CTXMEM_TEST_S3"}},
            **extra}


class S3Service:
    def __init__(self, svc: ServiceProcess, port: int) -> None:
        self.svc = svc
        self.port = port

    def client(self, key_id: str = KEY_ID, secret: str = SECRET, style: str = "path",
               host: str = "127.0.0.1") -> Any:
        return boto3.client(
            "s3", endpoint_url=f"http://{host}:{self.port}", region_name="us-east-1",
            aws_access_key_id=key_id, aws_secret_access_key=secret,
            config=BotoConfig(s3={"addressing_style": style},
                              retries={"max_attempts": 1, "mode": "standard"}))

    def used(self, tenant: str, tier: str = "dram") -> float:
        url = f"http://{self.svc.metrics_listen}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        series = f'ctxmem_tenant_used_bytes{{tenant="{tenant}",tier="{tier}"}} '
        m = re.search("^" + re.escape(series) + r"(\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Service]:
    workdir = tmp_path_factory.mktemp("s3door")
    port = free_port()
    cfg = local_config(workdir, s3=s3_section(port))
    with pytest.MonkeyPatch.context() as mp:  # the second key's secret_env
        mp.setenv("CTXMEM_TEST_S3", OTHER_SECRET)
        with ServiceProcess(workdir, cfg) as svc:
            yield S3Service(svc, port)


def payload(n: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(seed.to_bytes(4, "little")).digest(n) if n else b""


@pytest.fixture
def resolve_virtual_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """BUCKET.s3.test resolves to 127.0.0.1 in this process (no DNS needed)."""
    real: Callable[..., Any] = socket.getaddrinfo

    def fake(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and (host == DOMAIN or host.endswith("." + DOMAIN)):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_put_get_range_head_delete(s3: S3Service) -> None:
    c = s3.client()
    c.create_bucket(Bucket="alpha")
    data = payload(2 * MiB + 12345, 1)  # three chunks, the last one partial
    put = c.put_object(Bucket="alpha", Key="dir/obj.bin", Body=data)
    assert put["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
    got = c.get_object(Bucket="alpha", Key="dir/obj.bin")
    assert got["ContentLength"] == len(data)
    assert got["Body"].read() == data
    # One range across a chunk boundary: 206, exactly those bytes.
    r = c.get_object(Bucket="alpha", Key="dir/obj.bin", Range=f"bytes={MiB - 10}-{MiB + 99}")
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert r["ContentRange"] == f"bytes {MiB - 10}-{MiB + 99}/{len(data)}"
    assert r["Body"].read() == data[MiB - 10:MiB + 100]
    tail = c.get_object(Bucket="alpha", Key="dir/obj.bin", Range="bytes=-100")
    assert tail["Body"].read() == data[-100:]
    head = c.head_object(Bucket="alpha", Key="dir/obj.bin")
    assert head["ContentLength"] == len(data) and head["ETag"] == put["ETag"]
    with pytest.raises(ClientError) as miss:
        c.head_object(Bucket="alpha", Key="dir/absent")
    assert miss.value.response["Error"]["Code"] == "404"
    with pytest.raises(ClientError) as nokey:
        c.get_object(Bucket="alpha", Key="dir/absent")
    assert nokey.value.response["Error"]["Code"] == "NoSuchKey"
    # Overwrite, then empty object, then delete.
    c.put_object(Bucket="alpha", Key="dir/obj.bin", Body=b"short")
    assert c.get_object(Bucket="alpha", Key="dir/obj.bin")["Body"].read() == b"short"
    c.put_object(Bucket="alpha", Key="empty", Body=b"")
    assert c.get_object(Bucket="alpha", Key="empty")["Body"].read() == b""
    c.delete_object(Bucket="alpha", Key="dir/obj.bin")
    with pytest.raises(ClientError):
        c.head_object(Bucket="alpha", Key="dir/obj.bin")
    c.delete_object(Bucket="alpha", Key="never-there")  # S3: 204 all the same


def test_long_keys_are_hashed_and_listed(s3: S3Service) -> None:
    c = s3.client()
    long_key = "deep/" + "k" * 300  # over the 64-byte block key limit
    c.put_object(Bucket="beta", Key=long_key, Body=b"long")
    for k in ("a/1", "a/2", "a/sub/3", "b/1", "a+plus sign"):
        c.put_object(Bucket="beta", Key=k, Body=k.encode())
    assert c.get_object(Bucket="beta", Key=long_key)["Body"].read() == b"long"
    listed = c.list_objects_v2(Bucket="beta", Prefix="a/")
    assert [o["Key"] for o in listed["Contents"]] == ["a/1", "a/2", "a/sub/3"]
    assert listed["Contents"][0]["Size"] == 3
    deep = c.list_objects_v2(Bucket="beta", Prefix="deep/")
    assert [o["Key"] for o in deep["Contents"]] == [long_key]
    delim = c.list_objects_v2(Bucket="beta", Prefix="a/", Delimiter="/")
    assert [o["Key"] for o in delim["Contents"]] == ["a/1", "a/2"]
    assert [p["Prefix"] for p in delim["CommonPrefixes"]] == ["a/sub/"]
    # Pages: max-keys and the continuation token.
    keys: list[str] = []
    kwargs: dict[str, Any] = {"Bucket": "beta", "MaxKeys": 2}
    while True:
        page = c.list_objects_v2(**kwargs)
        keys += [o["Key"] for o in page.get("Contents", [])]
        if not page["IsTruncated"]:
            break
        kwargs["ContinuationToken"] = page["NextContinuationToken"]
    assert keys == sorted(["a/1", "a/2", "a/sub/3", "b/1", "a+plus sign", long_key])


def test_delete_objects_in_one_request(s3: S3Service) -> None:
    c = s3.client()
    for k in ("x/1", "x/2", "x/3"):
        c.put_object(Bucket="batch", Key=k, Body=k.encode())
    r = c.delete_objects(Bucket="batch", Delete={"Objects": [
        {"Key": "x/1"}, {"Key": "x/3"}, {"Key": "x/absent"}]})
    assert sorted(d["Key"] for d in r["Deleted"]) == ["x/1", "x/3", "x/absent"]
    assert [o["Key"] for o in c.list_objects_v2(Bucket="batch")["Contents"]] == ["x/2"]


def test_multipart_complete_and_abort(s3: S3Service) -> None:
    c = s3.client()
    parts_data = [payload(5 * MiB, 10), payload(5 * MiB + 7, 11), payload(MiB // 2, 12)]
    up = c.create_multipart_upload(Bucket="gamma", Key="big.bin")
    parts = []
    for i, data in enumerate(parts_data, start=1):
        r = c.upload_part(Bucket="gamma", Key="big.bin", UploadId=up["UploadId"],
                          PartNumber=i, Body=data)
        parts.append({"PartNumber": i, "ETag": r["ETag"]})
    done = c.complete_multipart_upload(Bucket="gamma", Key="big.bin",
                                       UploadId=up["UploadId"],
                                       MultipartUpload={"Parts": parts})
    assert done["ETag"].endswith('-3"')
    whole = b"".join(parts_data)
    assert c.get_object(Bucket="gamma", Key="big.bin")["Body"].read() == whole
    cut = 5 * MiB - 3
    r = c.get_object(Bucket="gamma", Key="big.bin", Range=f"bytes={cut}-{cut + 9}")
    assert r["Body"].read() == whole[cut:cut + 10]  # across the parts' boundary
    # Abort gives the parts' blocks back.
    before = s3.used("s3t")
    up2 = c.create_multipart_upload(Bucket="gamma", Key="gone.bin")
    c.upload_part(Bucket="gamma", Key="gone.bin", UploadId=up2["UploadId"], PartNumber=1,
                  Body=payload(5 * MiB, 13))
    assert s3.used("s3t") >= before + 5 * MiB
    c.abort_multipart_upload(Bucket="gamma", Key="gone.bin", UploadId=up2["UploadId"])
    assert s3.used("s3t") <= before
    with pytest.raises(ClientError) as exc:
        c.upload_part(Bucket="gamma", Key="gone.bin", UploadId=up2["UploadId"],
                      PartNumber=2, Body=b"x")
    assert exc.value.response["Error"]["Code"] == "NoSuchUpload"
    with pytest.raises(ClientError):
        c.head_object(Bucket="gamma", Key="gone.bin")


def test_upload_file_through_s3transfer(s3: S3Service, tmp_path: Path) -> None:
    """boto3's managed transfer (threads, multipart over its threshold) round trips."""
    from boto3.s3.transfer import TransferConfig

    c = s3.client()
    src = tmp_path / "src.bin"
    src.write_bytes(payload(11 * MiB + 3, 20))
    cfg = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    c.upload_file(str(src), "delta", "file.bin", Config=cfg)
    dst = tmp_path / "dst.bin"
    c.download_file("delta", "file.bin", str(dst), Config=cfg)
    assert dst.read_bytes() == src.read_bytes()


def test_virtual_hosted_addressing(s3: S3Service, resolve_virtual_hosts: None) -> None:
    v = s3.client(style="virtual", host=DOMAIN)
    v.put_object(Bucket="vhost", Key="x/y.txt", Body=b"virtual")
    assert v.get_object(Bucket="vhost", Key="x/y.txt")["Body"].read() == b"virtual"
    assert [o["Key"] for o in v.list_objects_v2(Bucket="vhost")["Contents"]] == ["x/y.txt"]
    # The same object, path-style: one bucket, two addressings.
    assert s3.client().get_object(Bucket="vhost", Key="x/y.txt")["Body"].read() == b"virtual"


def test_tenants_are_apart_and_counted(s3: S3Service) -> None:
    mine, theirs = s3.client(), s3.client(OTHER_ID, OTHER_SECRET)
    before = s3.used("other")
    theirs.put_object(Bucket="shared-name", Key="k", Body=payload(3 * MiB, 30))
    mine.put_object(Bucket="shared-name", Key="k", Body=b"mine")
    # The bucket names a namespace of each key's own tenant: neither sees the other's.
    assert theirs.get_object(Bucket="shared-name", Key="k")["Body"].read() == \
        payload(3 * MiB, 30)
    assert mine.get_object(Bucket="shared-name", Key="k")["Body"].read() == b"mine"
    assert s3.used("other") >= before + 3 * MiB
    theirs.delete_object(Bucket="shared-name", Key="k")
    assert s3.used("other") <= before
    assert mine.get_object(Bucket="shared-name", Key="k")["Body"].read() == b"mine"


def test_tls_and_the_sdks_aws_chunked_upload(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TLS (the tls: section's certificate) boto3 sends PutObject and UploadPart as
    aws-chunked with a trailing CRC32 (its default): accepted, decoded, checked."""
    from ctxmem_tools.bench.security_pki import make_pki

    pki = make_pki(tmp_path / "pki")
    monkeypatch.setenv("CTXMEM_TEST_S3", OTHER_SECRET)
    port = free_port()
    workdir = tmp_path / "svc"
    cfg = local_config(workdir, flash_size=None, transports=["tcp"], s3=s3_section(port),
                       tls={"cert_file": str(pki.server_cert),
                            "key_file": str(pki.server_key)})
    with ServiceProcess(workdir, cfg):
        c = boto3.client("s3", endpoint_url=f"https://127.0.0.1:{port}",
                         region_name="us-east-1", aws_access_key_id=KEY_ID,
                         aws_secret_access_key=SECRET, verify=str(pki.ca),
                         config=BotoConfig(s3={"addressing_style": "path"},
                                           retries={"max_attempts": 1, "mode": "standard"}))
        sent: list[str] = []
        c.meta.events.register("before-send.s3.*", lambda request, **_: sent.append(
            request.headers.get("x-amz-content-sha256", b"").decode()
            if isinstance(request.headers.get("x-amz-content-sha256"), bytes)
            else str(request.headers.get("x-amz-content-sha256"))))
        data = payload(2 * MiB + 5, 40)
        c.put_object(Bucket="tls", Key="chunked", Body=data)
        assert "STREAMING-UNSIGNED-PAYLOAD-TRAILER" in sent, sent
        assert c.get_object(Bucket="tls", Key="chunked")["Body"].read() == data
        up = c.create_multipart_upload(Bucket="tls", Key="mp")
        r = c.upload_part(Bucket="tls", Key="mp", UploadId=up["UploadId"], PartNumber=1,
                          Body=data)
        c.complete_multipart_upload(Bucket="tls", Key="mp", UploadId=up["UploadId"],
                                    MultipartUpload={"Parts": [{"PartNumber": 1,
                                                                "ETag": r["ETag"]}]})
        assert c.get_object(Bucket="tls", Key="mp")["Body"].read() == data
        # Plain HTTP on the TLS port is not served.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(b"GET /tls/chunked HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"chunked" not in raw.recv(4096)


def test_the_tenants_quota_applies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant held to a quarter of DRAM (no flash) stays within it: its older objects
    are evicted for its newer ones (a GET then answers NoSuchKey), while another
    tenant's object stays."""
    monkeypatch.setenv("CTXMEM_TEST_S3", OTHER_SECRET)
    port = free_port()
    workdir = tmp_path / "svc"
    cfg = local_config(workdir, flash_size=None, dram_size="64MiB", dram_slab="8MiB",
                       s3=s3_section(port),
                       quotas={"tenants": {"s3t": {"dram_max": 0.25}}})
    with ServiceProcess(workdir, cfg) as svc:
        s3 = S3Service(svc, port)
        mine, theirs = s3.client(), s3.client(OTHER_ID, OTHER_SECRET)
        theirs.put_object(Bucket="quota", Key="keep", Body=payload(4 * MiB, 50))
        for i in range(8):
            mine.put_object(Bucket="quota", Key=f"o{i}", Body=payload(3 * MiB, 60 + i))
            assert s3.used("s3t") <= 16 * MiB
        assert mine.get_object(Bucket="quota", Key="o7")["Body"].read() == payload(3 * MiB, 67)
        with pytest.raises(ClientError) as exc:
            mine.get_object(Bucket="quota", Key="o0")
        assert exc.value.response["Error"]["Code"] == "NoSuchKey"
        assert theirs.get_object(Bucket="quota", Key="keep")["Body"].read() == \
            payload(4 * MiB, 50)
