"""The S3-compatible endpoint (docs/s3.md): a compatibility door, not the fast path.

Imported only when ``s3.listen`` is set (botocore, the signature's reference code, is the
optional ``s3`` extra)."""
