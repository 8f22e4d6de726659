"""The S3 operations the door serves, one request each, for an authenticated tenant.

Objects: PutObject, GetObject (whole or one ``Range``: 206), HeadObject (404 without a
body), DeleteObject, DeleteObjects, ListObjectsV2 (prefix, delimiter, start-after, continuation);
multipart: CreateMultipartUpload, UploadPart, CompleteMultipartUpload,
AbortMultipartUpload; buckets: CreateBucket and HeadBucket (a bucket exists once named:
it is a namespace), DeleteBucket (refused while it holds objects). Anything else answers
``501 NotImplemented`` naming the operation.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import re
import secrets
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from urllib.parse import quote

from aiohttp import web

from ctxmem_common.config_s3 import S3Config
from ctxmem_dpu.s3.body import Body, body_size
from ctxmem_dpu.s3.objects import Manifest, ObjectStore, S3Error, Upload, chunk_keys

__all__ = ["XMLNS", "Operations", "xml_response"]

XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_MAX_COMPLETE_XML = 1 << 20
_MAX_KEY = 1024


def xml_response(root: ET.Element, status: int = 200, namespace: bool = True
                 ) -> web.Response:
    if namespace:
        root.set("xmlns", XMLNS)
    body = b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="utf-8")
    return web.Response(status=status, body=body, content_type="application/xml")


def _sub(parent: ET.Element, tag: str, text: object) -> ET.Element:
    e = ET.SubElement(parent, tag)
    e.text = str(text)
    return e


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))


def check_names(bucket: str, key: str) -> None:
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise S3Error(400, "InvalidBucketName", f"bucket name {bucket!r}: 3 to 63 lower-case "
                      f"letters, digits, dots and hyphens")
    if len(key.encode()) > _MAX_KEY:
        raise S3Error(400, "KeyTooLongError", f"an object key is at most {_MAX_KEY} bytes")


class Operations:
    """Dispatch by method and query to the S3 operations over an :class:`ObjectStore`."""

    def __init__(self, objects: ObjectStore, cfg: S3Config) -> None:
        self.objects = objects
        self.cfg = cfg

    async def dispatch(self, request: web.BaseRequest, tenant: str, bucket: str, key: str,
                       sha: str) -> web.StreamResponse:
        m, q = request.method, query(request)
        if not bucket:
            if m == "GET":
                return self._list_buckets(tenant)
            raise S3Error(405, "MethodNotAllowed", f"{m} / is not an S3 operation")
        check_names(bucket, key)
        if not key:
            return await self._bucket_op(request, tenant, bucket, sha)
        if "x-amz-copy-source" in request.headers:
            raise S3Error(501, "NotImplemented", "CopyObject and UploadPartCopy are not "
                          "supported by this endpoint (docs/s3.md)")
        if m == "PUT" and "uploadId" in q:
            return await self._upload_part(request, tenant, bucket, key, sha)
        if m == "PUT":
            return await self._put(request, tenant, bucket, key, sha)
        if m in ("GET", "HEAD") and "uploadId" not in q and not _sub_resource(q):
            return await self._get(request, tenant, bucket, key)
        if m == "DELETE" and "uploadId" in q:
            return await self._abort(tenant, bucket, key, q["uploadId"])
        if m == "DELETE" and not _sub_resource(q):
            with self.objects.session(tenant) as s:
                async with self.objects.locked(tenant, bucket, key):
                    await self.objects.delete_object(s, bucket, key)
            return web.Response(status=204)
        if m == "POST" and "uploads" in q:
            return self._create_upload(request, tenant, bucket, key)
        if m == "POST" and "uploadId" in q:
            return await self._complete(request, tenant, bucket, key, q["uploadId"], sha)
        raise S3Error(501, "NotImplemented", f"{m} on an object with "
                      f"{sorted(q)} is not supported by this endpoint (docs/s3.md)")

    # -- buckets -----------------------------------------------------------------------
    def _list_buckets(self, tenant: str) -> web.Response:
        names = sorted({ns.model_id[3:] for ns in self.objects.store.namespaces.values()
                        if ns.tenant == tenant and ns.model_id.startswith("s3/")})
        root = ET.Element("ListAllMyBucketsResult")
        owner = ET.SubElement(root, "Owner")
        _sub(owner, "ID", tenant)
        _sub(owner, "DisplayName", tenant)
        buckets = ET.SubElement(root, "Buckets")
        for name in names:
            b = ET.SubElement(buckets, "Bucket")
            _sub(b, "Name", name)
            _sub(b, "CreationDate", _iso(0))
        return xml_response(root)

    async def _bucket_op(self, request: web.BaseRequest, tenant: str, bucket: str, sha: str
                         ) -> web.StreamResponse:
        m, q = request.method, query(request)
        if m == "POST" and "delete" in q:
            return await self._delete_objects(request, tenant, bucket, sha)
        if m == "PUT" and not q:
            with self.objects.session(tenant) as s:
                self.objects.namespaces(s, bucket)
            return web.Response(status=200, headers={"Location": f"/{bucket}"})
        if m == "HEAD":
            return web.Response(status=200)
        if m == "GET" and q.get("list-type") == "2":
            return await self._list_v2(tenant, bucket, q)
        if m == "GET" and "location" in q:
            root = ET.Element("LocationConstraint")
            root.text = self.cfg.region
            return xml_response(root)
        if m == "DELETE" and not q:
            with self.objects.session(tenant) as s:
                meta, _ = self.objects.namespaces(s, bucket)
                if self.objects.store.index.get(meta.digest):
                    raise S3Error(409, "BucketNotEmpty", f"bucket {bucket!r} holds objects; "
                                  f"delete them first")
            return web.Response(status=204)
        raise S3Error(501, "NotImplemented", f"{m} on a bucket with {sorted(q)} is not "
                      f"supported by this endpoint (ListObjectsV2 is: list-type=2)")

    async def _delete_objects(self, request: web.BaseRequest, tenant: str, bucket: str,
                              sha: str) -> web.Response:
        """DeleteObjects: up to 1000 keys; each answered Deleted (present or not)."""
        doc = await _xml_body(request, sha, "DeleteObjects")
        keys = [(c.text or "") for o in doc.iter() if _tag(o) == "Object"
                for c in o if _tag(c) == "Key"]
        quiet = any(_tag(e) == "Quiet" and (e.text or "").strip() == "true"
                    for e in doc.iter())
        if not 1 <= len(keys) <= 1000:
            raise S3Error(400, "MalformedXML", f"DeleteObjects names {len(keys)} keys; "
                          f"1 to 1000")
        root = ET.Element("DeleteResult")
        with self.objects.session(tenant) as s:
            for key in keys:
                try:
                    check_names(bucket, key)
                    async with self.objects.locked(tenant, bucket, key):
                        await self.objects.delete_object(s, bucket, key)
                except S3Error as exc:
                    err = ET.SubElement(root, "Error")
                    _sub(err, "Key", key)
                    _sub(err, "Code", exc.code)
                    _sub(err, "Message", str(exc))
                    continue
                if not quiet:
                    _sub(ET.SubElement(root, "Deleted"), "Key", key)
        return xml_response(root)

    async def _list_v2(self, tenant: str, bucket: str, q: Mapping[str, str]) -> web.Response:
        prefix = q.get("prefix", "")
        delim = q.get("delimiter", "")
        try:
            max_keys = max(0, min(1000, int(q.get("max-keys", "1000"))))
        except ValueError:
            raise S3Error(400, "InvalidArgument", "max-keys must be an integer") from None
        token = q.get("continuation-token", "")
        try:
            after = base64.urlsafe_b64decode(token).decode() if token else \
                q.get("start-after", "")
        except ValueError:
            raise S3Error(400, "InvalidArgument", "bad continuation-token") from None
        url = q.get("encoding-type") == "url"

        def enc(v: str) -> str:
            return quote(v, safe="/") if url else v

        with self.objects.session(tenant) as s:
            meta, _ = self.objects.namespaces(s, bucket)
            names = await self.objects.list_names(s, meta, prefix)
            entries: list[tuple[str, bool]] = []  # (name or common prefix, is prefix)
            seen: set[str] = set()
            for name in sorted(names):
                cut = name.find(delim, len(prefix)) if delim else -1
                if cut >= 0:
                    cp = name[:cut + len(delim)]
                    if cp not in seen and cp > after and not after.startswith(cp):
                        seen.add(cp)
                        entries.append((cp, True))
                elif name > after:
                    entries.append((name, False))
            page, truncated = entries[:max_keys], len(entries) > max_keys
            root = ET.Element("ListBucketResult")
            _sub(root, "Name", bucket)
            _sub(root, "Prefix", enc(prefix))
            if delim:
                _sub(root, "Delimiter", enc(delim))
            _sub(root, "MaxKeys", max_keys)
            _sub(root, "KeyCount", len(page))
            _sub(root, "IsTruncated", "true" if truncated else "false")
            if token:
                _sub(root, "ContinuationToken", token)
            if "start-after" in q:
                _sub(root, "StartAfter", enc(q["start-after"]))
            if url:
                _sub(root, "EncodingType", "url")
            if truncated and page:
                _sub(root, "NextContinuationToken",
                     base64.urlsafe_b64encode(page[-1][0].encode()).decode())
            for name, is_prefix in page:
                if is_prefix:
                    _sub(ET.SubElement(root, "CommonPrefixes"), "Prefix", enc(name))
                    continue
                man = await self.objects.manifest_of(s, meta, names[name])
                if man is None:
                    continue  # deleted (or evicted) meanwhile
                c = ET.SubElement(root, "Contents")
                _sub(c, "Key", enc(name))
                _sub(c, "LastModified", _iso(man.mtime))
                _sub(c, "ETag", man.etag)
                _sub(c, "Size", man.size)
                _sub(c, "StorageClass", "STANDARD")
        return xml_response(root)

    # -- objects -----------------------------------------------------------------------
    async def _read_body(self, request: web.BaseRequest, sha: str
                         ) -> Body:
        size = body_size(request.headers, request.content_length, sha)
        if size > self.cfg.max_put_bytes:
            raise S3Error(400, "EntityTooLarge", f"the body is {size} bytes; this endpoint "
                          f"takes at most {self.cfg.max_put_bytes} per PutObject or "
                          f"UploadPart (s3.max_put_bytes); use a multipart upload with "
                          f"smaller parts")
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return Body(request.content, request.headers, sha, size)

    async def _put(self, request: web.BaseRequest, tenant: str, bucket: str, key: str,
                   sha: str) -> web.Response:
        body = await self._read_body(request, sha)
        with self.objects.session(tenant) as s:
            _, data = self.objects.namespaces(s, bucket)
            pid = await self.objects.put_part(s, data, body.size, body.fill)
            try:
                await body.finish()
            except BaseException:
                await self.objects.delete(data, _keys(self.objects, pid, body.size))
                raise
            etag = f'"{body.md5.hexdigest()}"'
            m = Manifest(key, body.size, etag, time.time(), [(pid, body.size)],
                         request.headers.get("Content-Type", "binary/octet-stream"))
            async with self.objects.locked(tenant, bucket, key):
                await self.objects.commit_object(s, bucket, m)
        return web.Response(status=200, headers={"ETag": etag})

    async def _get(self, request: web.BaseRequest, tenant: str, bucket: str, key: str
                   ) -> web.StreamResponse:
        head = request.method == "HEAD"
        with self.objects.session(tenant) as s:
            meta, data = self.objects.namespaces(s, bucket)
            m = await self.objects.read_manifest(s, meta, key)
            if m is None:
                raise S3Error(404, "NoSuchKey", f"no object {key!r} in bucket {bucket!r}")
            start, end, status = 0, m.size, 200
            rng = request.headers.get("Range")
            headers = {"ETag": m.etag, "Accept-Ranges": "bytes",
                       "Last-Modified": email.utils.formatdate(m.mtime, usegmt=True),
                       "Content-Type": m.content_type or "binary/octet-stream"}
            if rng is not None:
                start, end = _range(rng, m.size)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{m.size}"
            headers["Content-Length"] = str(end - start)
            resp = web.StreamResponse(status=status, headers=headers)
            if head:
                return resp
            spans = self.objects.spans(m, start, end)
            chunks = self.objects.read_spans(s, data, spans)
            try:
                first = await anext(chunks, None) if spans else None  # a gone chunk: 404
                await resp.prepare(request)
                request[STREAMING] = resp  # from here an error can only close the connection
                if first is not None:
                    await resp.write(first)
                async for chunk in chunks:
                    await resp.write(chunk)
                await resp.write_eof()
            except S3Error:
                if not resp.prepared:
                    raise
                cut_short(request)
            finally:
                await chunks.aclose()  # unpins what it still holds
            return resp

    # -- multipart ---------------------------------------------------------------------
    def _create_upload(self, request: web.BaseRequest, tenant: str, bucket: str, key: str
                       ) -> web.Response:
        ups = self.objects.uploads
        mine = sum(1 for u in ups.values() if u.tenant == tenant)
        if mine >= self.objects.max_uploads:
            raise S3Error(503, "SlowDown", f"tenant {tenant!r} has {mine} multipart uploads "
                          f"in progress (s3.max_uploads); complete or abort some")
        upload_id = secrets.token_urlsafe(24)
        ups[upload_id] = Upload(tenant, bucket, key, time.time(),
                                request.headers.get("Content-Type", "binary/octet-stream"))
        root = ET.Element("InitiateMultipartUploadResult")
        _sub(root, "Bucket", bucket)
        _sub(root, "Key", key)
        _sub(root, "UploadId", upload_id)
        return xml_response(root)

    def _upload(self, tenant: str, bucket: str, key: str, upload_id: str) -> Upload:
        up = self.objects.uploads.get(upload_id)
        if up is None or (up.tenant, up.bucket, up.key) != (tenant, bucket, key):
            raise S3Error(404, "NoSuchUpload", f"no multipart upload {upload_id!r} for "
                          f"{bucket}/{key} (completed, aborted, or the service restarted)")
        return up

    async def _upload_part(self, request: web.BaseRequest, tenant: str, bucket: str,
                           key: str, sha: str) -> web.Response:
        q = query(request)
        up = self._upload(tenant, bucket, key, q["uploadId"])
        try:
            number = int(q.get("partNumber", ""))
        except ValueError:
            number = 0
        if not 1 <= number <= self.cfg.max_parts:
            raise S3Error(400, "InvalidArgument", f"partNumber must be 1..{self.cfg.max_parts}"
                          f" (s3.max_parts)")
        body = await self._read_body(request, sha)
        with self.objects.session(tenant) as s:
            _, data = self.objects.namespaces(s, bucket)
            pid = await self.objects.put_part(s, data, body.size, body.fill)
            try:
                await body.finish()
                if self.objects.uploads.get(q["uploadId"]) is not up:
                    raise S3Error(404, "NoSuchUpload", "the upload was aborted meanwhile")
            except BaseException:
                await self.objects.delete(data, _keys(self.objects, pid, body.size))
                raise
            old = up.parts.get(number)
            up.parts[number] = (pid, body.size, body.md5.digest())
            if old is not None:
                await self.objects.delete(data, _keys(self.objects, old[0], old[1]))
        return web.Response(status=200, headers={"ETag": f'"{body.md5.hexdigest()}"'})

    async def _complete(self, request: web.BaseRequest, tenant: str, bucket: str, key: str,
                        upload_id: str, sha: str) -> web.Response:
        up = self._upload(tenant, bucket, key, upload_id)
        doc = await _xml_body(request, sha, "CompleteMultipartUpload")
        listed: list[tuple[int, str]] = []
        for part in doc.iter():
            if _tag(part) != "Part":
                continue
            fields = {_tag(c): (c.text or "").strip() for c in part}
            try:
                listed.append((int(fields.get("PartNumber", "")),
                               fields.get("ETag", "").strip('"')))
            except ValueError:
                raise S3Error(400, "MalformedXML", "a Part without a PartNumber") from None
        if not listed or [n for n, _ in listed] != sorted({n for n, _ in listed}):
            raise S3Error(400, "InvalidPartOrder", "list the parts once each, in ascending "
                          "PartNumber order")
        chosen = []
        for number, etag in listed:
            have = up.parts.get(number)
            if have is None or (etag and etag != have[2].hex()):
                raise S3Error(400, "InvalidPart", f"part {number} was not uploaded, or its "
                              f"ETag differs")
            chosen.append(have)
        etag = f'"{hashlib.md5(b"".join(md5 for _, _, md5 in chosen)).hexdigest()}' \
               f'-{len(chosen)}"'
        size = sum(n for _, n, _ in chosen)
        m = Manifest(key, size, etag, time.time(), [(pid, n) for pid, n, _ in chosen],
                     up.content_type)
        with self.objects.session(tenant) as s:
            async with self.objects.locked(tenant, bucket, key):
                await self.objects.commit_object(s, bucket, m)
            if self.objects.uploads.get(upload_id) is up:
                del self.objects.uploads[upload_id]
            used = {pid for pid, _, _ in chosen}
            _, data = self.objects.namespaces(s, bucket)
            for pid, n, _ in up.parts.values():
                if pid not in used:
                    await self.objects.delete(data, _keys(self.objects, pid, n))
        root = ET.Element("CompleteMultipartUploadResult")
        _sub(root, "Bucket", bucket)
        _sub(root, "Key", key)
        _sub(root, "ETag", etag)
        return xml_response(root)

    async def _abort(self, tenant: str, bucket: str, key: str, upload_id: str
                     ) -> web.Response:
        self._upload(tenant, bucket, key, upload_id)
        with self.objects.session(tenant) as s:
            await self.objects.drop_upload(s, upload_id)
        return web.Response(status=204)


STREAMING = "ctxmem.s3.streaming"


def query(request: web.BaseRequest) -> dict[str, str]:
    """The request's query parameters less a presigned URL's own (``X-Amz-*``)."""
    return {k: v for k, v in request.query.items() if not k.startswith("X-Amz-")}


def _tag(e: ET.Element) -> str:
    return e.tag.rsplit("}", 1)[-1]


async def _xml_body(request: web.BaseRequest, sha: str, what: str) -> ET.Element:
    """The request's small XML body (at most 1 MiB, its Content-Length read whole, its
    SHA-256 checked when the request signed it), parsed."""
    n = request.content_length
    if n is None or n > _MAX_COMPLETE_XML:
        raise S3Error(400, "MalformedXML", f"the {what} body must have a Content-Length of "
                      f"at most {_MAX_COMPLETE_XML} bytes")
    try:
        raw = await request.content.readexactly(n)
    except asyncio.IncompleteReadError:
        raise S3Error(400, "IncompleteBody", f"the {what} body ended early") from None
    if len(sha) == 64 and hashlib.sha256(raw).hexdigest() != sha:
        raise S3Error(400, "XAmzContentSHA256Mismatch", f"the {what} body's SHA-256 does not "
                      f"match x-amz-content-sha256")
    try:
        return ET.fromstring(raw)
    except ET.ParseError as exc:
        raise S3Error(400, "MalformedXML", f"{what}: {exc}") from None


def cut_short(request: web.BaseRequest) -> None:
    """End a GET whose headers are out: close the connection short of its length."""
    if request.transport is not None:
        request.transport.close()


def _keys(objects: ObjectStore, pid: bytes, size: int) -> list[bytes]:
    return chunk_keys(pid, size, objects.chunk)


def _sub_resource(q: Mapping[str, str]) -> bool:
    """Whether the query names a sub-resource (acl, tagging, ...) this door lacks."""
    return any(k in q for k in ("acl", "tagging", "retention", "legal-hold", "torrent",
                                "attributes", "restore", "select"))


def _range(header: str, size: int) -> tuple[int, int]:
    """``[start, end)`` of one ``bytes=`` range of an object of ``size`` bytes."""
    m = _RANGE.match(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        raise S3Error(416 if "," not in header else 501,
                      "InvalidRange" if "," not in header else "NotImplemented",
                      f"Range {header!r}: one bytes=FIRST-LAST, FIRST- or -SUFFIX range "
                      f"is supported")
    a, b = m.group(1), m.group(2)
    if not a:  # the last b bytes
        start, end = max(0, size - int(b)), size
    else:
        start = int(a)
        end = min(size, int(b) + 1) if b else size
    if start >= size or start >= end:
        raise S3Error(416, "InvalidRange", f"Range {header!r} is outside the object's "
                      f"{size} bytes")
    return start, end
