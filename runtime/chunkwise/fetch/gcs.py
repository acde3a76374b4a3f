"""gs://bucket/prefix: every object under the prefix, through GCS's JSON API over plain HTTP.

STORAGE_EMULATOR_HOST (the convention of Google's client libraries) points it at an emulator. The token:
--token-file, else GOOGLE_OAUTH_ACCESS_TOKEN, else the metadata server's for the pod's service account
(GKE Workload Identity; GCE_METADATA_HOST overrides its address, as for google-auth), else none (public
buckets). Each object is read at the generation listed, so an overwrite mid-fetch cannot mix versions.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import logging
import os
import time
from typing import Any
from urllib.parse import quote, urlencode

from chunkwise.fetch.download import Body, Checksum, Listing, RemoteFile, safe_relpath, with_retries
from chunkwise.fetch.errors import FetchError
from chunkwise.fetch.httpclient import HttpStatusError, get_json, ranged_body
from chunkwise.fetch.options import FetchOptions
from chunkwise.fetch.uri import GcsUri

DEFAULT_HOST = "https://storage.googleapis.com"
METADATA_HOST = "metadata.google.internal"
METADATA_TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
# Off GKE there is no metadata server; finding that out must not hold up the fetch.
METADATA_TIMEOUT_S = 2.0
# A metadata token lives about an hour; one is renewed this long before it expires (long downloads).
TOKEN_RENEW_MARGIN_S = 300.0

log = logging.getLogger("chunkwise.fetch")


class TokenSource:
    """The Authorization header for each request, renewing a metadata-server token before it expires."""

    def __init__(self, options: FetchOptions, emulated: bool) -> None:
        self._static = options.token or os.environ.get("GOOGLE_OAUTH_ACCESS_TOKEN") or None
        # An emulator needs no token, unless a metadata server is named explicitly.
        self._use_metadata = self._static is None and (
            not emulated or bool(os.environ.get("GCE_METADATA_HOST"))
        )
        self._token: str | None = None
        self._expires = 0.0

    def headers(self) -> dict[str, str]:
        token = self._static or self._metadata_token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _metadata_token(self) -> str | None:
        if not self._use_metadata:
            return None
        if self._token is not None and time.monotonic() < self._expires - TOKEN_RENEW_MARGIN_S:
            return self._token
        host = os.environ.get("GCE_METADATA_HOST") or METADATA_HOST
        url = f"http://{host}{METADATA_TOKEN_PATH}"
        try:
            data = get_json(url, {"Metadata-Flavor": "Google"}, METADATA_TIMEOUT_S)
        except FetchError as e:
            if self._token is None:
                log.info("no GCE metadata server (%s); reading GCS anonymously", e)
                self._use_metadata = False
                return None
            raise
        self._token = str(data["access_token"])
        self._expires = time.monotonic() + float(data.get("expires_in", 3600))
        return self._token


def storage_host() -> tuple[str, bool]:
    """(the API's base URL, whether it is an emulator)."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if not emulator:
        return DEFAULT_HOST, False
    if "://" not in emulator:
        emulator = f"http://{emulator}"
    return emulator.rstrip("/"), True


def list_gcs(uri: GcsUri, options: FetchOptions) -> Listing:
    host, emulated = storage_host()
    tokens = TokenSource(options, emulated)
    items: list[dict[str, Any]] = []
    page_token: str | None = None
    while True:
        query = {"prefix": uri.prefix} if uri.prefix else {}
        if page_token:
            query["pageToken"] = page_token
        url = f"{host}/storage/v1/b/{quote(uri.bucket, safe='')}/o?{urlencode(query)}"
        try:
            page = with_retries(
                f"listing {uri.identity}",
                functools.partial(_get_page, url, tokens, options.timeout_s),
                options.retries,
                options.backoff_s,
            )
        except HttpStatusError as e:
            if e.status in (401, 403):
                raise FetchError(f"listing {uri.identity}: access denied ({e}); check the token") from e
            raise FetchError(f"listing {uri.identity}: {e}") from e
        items.extend(page.get("items") or [])
        page_token = page.get("nextPageToken")
        if not page_token:
            break
    files = [
        _remote_file(host, uri, item, tokens, options) for item in items if not item["name"].endswith("/")
    ]
    if not files:
        raise FetchError(f"no objects under {uri.identity}")
    generations = "\n".join(sorted(f"{f.path}={f.version}" for f in files))
    return Listing("generations-sha256:" + hashlib.sha256(generations.encode()).hexdigest()[:16], files)


def _get_page(url: str, tokens: TokenSource, timeout_s: float) -> Any:
    return get_json(url, tokens.headers(), timeout_s)


def _remote_file(
    host: str, uri: GcsUri, item: dict[str, Any], tokens: TokenSource, options: FetchOptions
) -> RemoteFile:
    name: str = item["name"]
    path = safe_relpath(name[len(uri.prefix) :], "GCS object")
    checksum = None
    if item.get("md5Hash"):  # absent for composite objects, which carry only a CRC32C
        try:
            checksum = Checksum("md5", base64.b64decode(item["md5Hash"], validate=True).hex())
        except (binascii.Error, ValueError) as e:
            raise FetchError(f"gs://{uri.bucket}/{name}: unreadable md5Hash {item['md5Hash']!r}") from e
    generation = str(item.get("generation") or "")
    query = {"alt": "media", **({"generation": generation} if generation else {})}
    url = f"{host}/download/storage/v1/b/{quote(uri.bucket, safe='')}/o/{quote(name, safe='')}?{urlencode(query)}"

    def open_at(offset: int, validator: str | None) -> Body:
        return ranged_body(url, tokens.headers(), offset, validator, options.timeout_s)

    return RemoteFile(
        path=path,
        size=int(item["size"]) if item.get("size") is not None else None,
        checksum=checksum,
        version=generation or (checksum.hexdigest if checksum else None),
        open=open_at,
    )
