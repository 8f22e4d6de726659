"""AWS Signature V4 of an S3 request, verified with botocore's own signer.

The signature is recomputed over the request as received (the method, the path and
query string as sent, the headers the client named in ``SignedHeaders`` with their
received values, and its ``x-amz-content-sha256``) by ``botocore.auth.S3SigV4Auth``, the
code the SDKs sign with, and compared in constant time. A presigned URL carries the same
signature in its query string (``X-Amz-*``, the payload unsigned, valid until
``X-Amz-Expires`` after ``X-Amz-Date``). Nothing here parses more than the
``Authorization`` header's three fields or the query's ``X-Amz-*`` parameters.
"""

from __future__ import annotations

import calendar
import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest, HTTPHeaders
from botocore.credentials import Credentials

__all__ = ["AuthError", "Signed", "verify"]

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
MAX_PRESIGNED_S = 7 * 24 * 3600  # what S3 allows


class AuthError(Exception):
    """A request refused before it is served: ``code`` is the S3 error code."""

    def __init__(self, code: str, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass(frozen=True)
class Signed:
    """A verified request: its access key and the payload hash it signed."""

    access_key: str
    content_sha256: str


class _Verifier(S3SigV4Auth):
    """botocore's S3 signer, signing exactly the headers the client named."""

    def __init__(self, credentials: Credentials, region: str, signed: list[str]) -> None:
        super().__init__(credentials, "s3", region)
        self._signed = signed

    def headers_to_sign(self, request: AWSRequest) -> HTTPHeaders:
        out = HTTPHeaders()
        for name in self._signed:
            for value in request.headers.get_all(name) or []:
                out[name] = value
        return out


def _fields(auth: str) -> dict[str, str]:
    algo, _, rest = auth.partition(" ")
    if algo != ALGORITHM:
        raise AuthError("AccessDenied", f"Authorization uses {algo!r}; only {ALGORITHM} "
                        f"(Signature Version 4) is accepted", 400 if algo else 403)
    out: dict[str, str] = {}
    for part in rest.split(","):
        k, _, v = part.strip().partition("=")
        out[k] = v
    for k in ("Credential", "SignedHeaders", "Signature"):
        if not out.get(k):
            raise AuthError("AuthorizationHeaderMalformed",
                            f"the Authorization header has no {k}", 400)
    return out


def _presigned_fields(query: str) -> dict[str, str]:
    """A presigned URL's X-Amz-* parameters, in the Authorization header's names."""
    params = dict(parse_qsl(query, keep_blank_values=True))
    if params.get("X-Amz-Algorithm") != ALGORITHM:
        raise AuthError("AccessDenied", f"X-Amz-Algorithm must be {ALGORITHM}")
    out = {"Credential": params.get("X-Amz-Credential", ""),
           "SignedHeaders": params.get("X-Amz-SignedHeaders", ""),
           "Signature": params.get("X-Amz-Signature", ""),
           "Date": params.get("X-Amz-Date", ""), "Expires": params.get("X-Amz-Expires", "")}
    for k, v in out.items():
        if not v:
            raise AuthError("AuthorizationQueryParametersError",
                            f"the presigned URL has no X-Amz-{k}", 400)
    return out


def verify(method: str, raw_path: str, headers: Iterable[tuple[str, str]],
           header_map: Mapping[str, str], secrets: Mapping[str, str], region: str,
           max_skew_s: float, now: float | None = None) -> Signed:
    """Check the request's SigV4 signature (its ``Authorization`` header, or a presigned
    URL's query parameters); the access key and payload hash it signed.

    ``raw_path`` is the path and query string as sent (percent-encoded); ``headers`` every
    received header (name, value), ``header_map`` the same looked up case-insensitively.

    Raises:
        AuthError: no or a malformed signature, an unknown key, a clock skew past
            ``max_skew_s`` (a presigned URL: past its expiry), or a signature that does
            not match.
    """
    path, _, query = raw_path.partition("?")
    auth = header_map.get("Authorization", "")
    presigned = not auth and "X-Amz-Signature=" in query
    if not auth and not presigned:
        raise AuthError("AccessDenied", "the request is not signed (no Authorization "
                        "header and no presigned URL parameters)")
    f = _presigned_fields(query) if presigned else _fields(auth)
    cred = f["Credential"].split("/")
    if len(cred) != 5 or cred[4] != "aws4_request" or cred[3] != "s3":
        raise AuthError("AuthorizationHeaderMalformed",
                        f"Credential {f['Credential']!r} is not KEY/DATE/REGION/s3/"
                        f"aws4_request", 400)
    key_id, date, cred_region = cred[0], cred[1], cred[2]
    secret = secrets.get(key_id)
    if secret is None:
        raise AuthError("InvalidAccessKeyId",
                        f"the access key id {key_id!r} is not in this service's "
                        f"s3.access_keys")
    if cred_region != region:
        raise AuthError("AuthorizationHeaderMalformed",
                        f"the request is signed for region {cred_region!r}; this endpoint "
                        f"is {region!r} (s3.region)", 400)
    stamp = f["Date"] if presigned else header_map.get("x-amz-date", "")
    try:
        signed_at = calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        raise AuthError("AccessDenied", f"x-amz-date {stamp!r} is missing or not "
                        f"YYYYMMDDTHHMMSSZ") from None
    if stamp[:8] != date:
        raise AuthError("SignatureDoesNotMatch", "x-amz-date and the credential's date "
                        "differ")
    clock = time.time() if now is None else now
    if presigned:
        try:
            expires = int(f["Expires"])
        except ValueError:
            expires = -1
        if not 1 <= expires <= MAX_PRESIGNED_S:
            raise AuthError("AuthorizationQueryParametersError", f"X-Amz-Expires must be 1 "
                            f"to {MAX_PRESIGNED_S} seconds", 400)
        if clock > signed_at + expires or clock < signed_at - max_skew_s:
            raise AuthError("AccessDenied", "the presigned URL has expired (or is not valid "
                            "yet: check the clocks)")
    elif abs(clock - signed_at) > max_skew_s:
        raise AuthError("RequestTimeTooSkewed",
                        f"the request was signed {abs(clock - signed_at):.0f} s from the "
                        f"service's clock (at most {max_skew_s:.0f} s, "
                        f"s3.max_clock_skew_s); fix the client's clock")
    signed = [h.strip().lower() for h in f["SignedHeaders"].split(";") if h.strip()]
    if "host" not in signed:
        raise AuthError("AccessDenied", "SignedHeaders must include host")
    if presigned:  # signed over the query without its signature, the payload unsigned
        sha = UNSIGNED_PAYLOAD
        rest = "&".join(p for p in query.split("&") if not p.startswith("X-Amz-Signature="))
        url = "http://s3" + path + ("?" + rest if rest else "")
    else:
        sha = header_map.get("x-amz-content-sha256", "")
        if not sha:
            raise AuthError("InvalidRequest", "x-amz-content-sha256 is required", 400)
        url = "http://s3" + raw_path
    request = AWSRequest(method=method, url=url)
    request.headers = HTTPHeaders()
    wanted = set(signed)
    for name, value in headers:
        if name.lower() in wanted:
            request.headers.add_header(name.lower(), value)
    if presigned:  # the payload hash in the canonical request (not a signed header)
        request.headers["X-Amz-Content-SHA256"] = UNSIGNED_PAYLOAD
    request.context["timestamp"] = stamp
    signer = _Verifier(Credentials(key_id, secret), region, signed)
    canonical = signer.canonical_request(request)
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    if not hmac.compare_digest(expected.encode(), f["Signature"].encode()):
        raise AuthError("SignatureDoesNotMatch",
                        "the request signature does not match the one computed with the "
                        "access key's secret; check the secret key and signing method")
    return Signed(key_id, sha)
