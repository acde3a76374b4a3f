"""s3://bucket/prefix: every object under the prefix, through boto3.

boto3 reads the endpoint (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL: MinIO, Ceph, R2) and the credentials
(env, web identity for IRSA, the instance role) the usual ways, so nothing is configured here. A plain ETag
(no '-') is the object's MD5 and is verified; a multipart upload's ETag is not, so only the size is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from chunkwise.fetch.download import Body, Checksum, Listing, RemoteFile, safe_relpath, with_retries
from chunkwise.fetch.errors import FetchError, TransientError
from chunkwise.fetch.options import FetchOptions
from chunkwise.fetch.uri import S3Uri

CHUNK_BYTES = 1 << 20
_MD5 = re.compile(r"^[0-9a-f]{32}$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
# Error codes a retry can cure; the rest (NoSuchBucket, AccessDenied, ...) are the user's to fix.
_RETRY_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError", "ServiceUnavailable"}
)


def list_s3(uri: S3Uri, options: FetchOptions) -> Listing:
    import boto3
    from botocore.config import Config

    # botocore retries each call itself (standard mode); ours resumes a body that drops mid-file.
    client = boto3.client(
        "s3",
        config=Config(
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=options.timeout_s,
            read_timeout=options.timeout_s,
        ),
    )

    def list_all() -> list[dict[str, Any]]:
        objects: list[dict[str, Any]] = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=uri.bucket, Prefix=uri.prefix
            ):
                objects.extend(page.get("Contents", []))
        except Exception as e:
            raise _classify(e, f"listing {uri.identity}") from e
        return objects

    objects = with_retries(f"listing {uri.identity}", list_all, options.retries, options.backoff_s)
    files = [
        _remote_file(client, uri, obj)
        for obj in objects
        if not obj["Key"].endswith("/")  # "directory" placeholders that consoles create
    ]
    if not files:
        raise FetchError(f"no objects under {uri.identity}")
    etags = sorted(f"{f.path}={f.version}" for f in files)
    return Listing(_digest(etags), files)


def _remote_file(client: Any, uri: S3Uri, obj: dict[str, Any]) -> RemoteFile:
    key: str = obj["Key"]
    path = safe_relpath(key[len(uri.prefix) :], "S3 object")
    etag = str(obj.get("ETag", "")).strip('"').lower()
    checksum = Checksum("md5", etag) if _MD5.match(etag) else None

    def open_at(offset: int, validator: str | None) -> Body:
        kwargs: dict[str, Any] = {"Bucket": uri.bucket, "Key": key}
        if offset:
            kwargs["Range"] = f"bytes={offset}-"
        if etag:
            # The object listed, not one overwritten since: a part must not mix two versions.
            kwargs["IfMatch"] = f'"{etag}"'
        try:
            resp = client.get_object(**kwargs)
        except Exception as e:
            raise _classify(e, f"s3://{uri.bucket}/{key}") from e
        start = 0
        m = _CONTENT_RANGE.match(str(resp.get("ContentRange") or ""))
        if m:
            start = int(m.group(1))
        stream = resp["Body"]
        # With SSE-KMS or SSE-C the ETag is not the MD5 of the bytes.
        encrypted = str(resp.get("ServerSideEncryption", "")).startswith("aws:kms") or bool(
            resp.get("SSECustomerAlgorithm")
        )
        return Body(
            start=start,
            chunks=_chunks(stream),
            close=stream.close,
            total_size=int(obj["Size"]),
            content_type=resp.get("ContentType"),
            checksum_applies=not encrypted,
        )

    return RemoteFile(path=path, size=int(obj["Size"]), checksum=checksum, version=etag or None, open=open_at)


def _chunks(stream: Any) -> Iterator[bytes]:
    while True:
        try:
            chunk = stream.read(CHUNK_BYTES)
        except Exception as e:  # botocore and urllib3 each raise their own kinds for a dropped stream
            raise TransientError(f"connection dropped: {type(e).__name__}: {e}") from e
        if not chunk:
            return
        yield chunk


def _classify(e: Exception, what: str) -> FetchError:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        message = f"{what}: {code or status} {err.get('Message', '')}".rstrip()
        if code in _RETRY_CODES or status >= 500:
            return TransientError(message)
        if code == "PreconditionFailed" or status == 412:
            return FetchError(f"{what} changed while it was being fetched; run the fetch again")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
            return FetchError(f"{message} (check the AWS credentials and the bucket policy)")
        return FetchError(message)
    if isinstance(e, NoCredentialsError):
        return FetchError(
            f"{what}: no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a role)"
        )
    if isinstance(e, BotoCoreError | OSError):
        return TransientError(f"{what}: {type(e).__name__}: {e}")
    return FetchError(f"{what}: {type(e).__name__}: {e}")


def _digest(lines: list[str]) -> str:
    import hashlib

    return "etags-sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
