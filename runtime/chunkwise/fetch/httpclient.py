"""Plain HTTP for the Hub, GCS's JSON API and archives: urllib, with ranged bodies and classified errors.

urllib rather than httpx because a byte range, a redirect and a read timeout are all this needs, and the
same code then serves every HTTP source with the same resume behaviour.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from chunkwise.fetch.download import Body
from chunkwise.fetch.errors import FetchError, TransientError

USER_AGENT = "chunkwise-fetch/0.1"
CHUNK_BYTES = 1 << 20
# Statuses a retry can cure: timeouts, throttling and the server's own failures.
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class HttpStatusError(FetchError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _RedirectKeepingAuthOnSameHost(urllib.request.HTTPRedirectHandler):
    """urllib forwards every header on a redirect. The Hub redirects file downloads to a CDN with a signed
    URL, and a bearer token sent there is both a leak and, for S3-style CDNs, a 400 (two auth schemes)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urlsplit(newurl).netloc != urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


_opener = urllib.request.build_opener(_RedirectKeepingAuthOnSameHost())


def redact(url: str) -> str:
    """The URL as logs and errors show it: no credentials, no (possibly presigned) query string."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


def open_url(url: str, headers: Mapping[str, str], timeout_s: float) -> http.client.HTTPResponse:
    """A response with a 2xx status, else HttpStatusError (TransientError for statuses worth retrying)."""
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **headers})
    try:
        resp = _opener.open(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        detail = _error_detail(e)
        message = f"HTTP {e.code} from {redact(url)}" + (f": {detail}" if detail else "")
        e.close()
        if e.code in RETRY_STATUSES:
            raise TransientError(message) from None
        raise HttpStatusError(e.code, message) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise TransientError(f"cannot reach {redact(url)}: {reason}") from e
    return resp


def get_json(url: str, headers: Mapping[str, str], timeout_s: float) -> Any:
    resp = open_url(url, {"Accept": "application/json", **headers}, timeout_s)
    try:
        data = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise TransientError(f"connection to {redact(url)} dropped: {e}") from e
    finally:
        resp.close()
    try:
        return json.loads(data)
    except ValueError as e:
        raise FetchError(f"{redact(url)} did not answer JSON: {data[:200]!r}") from e


def ranged_body(
    url: str, headers: Mapping[str, str], offset: int, validator: str | None, timeout_s: float
) -> Body:
    """GET from byte `offset`. A server that ignores Range (200), or whose content changed since the part
    on disk (If-Range fails: 200), answers from byte 0; Body.start says so and the caller starts over."""
    h = dict(headers)
    if offset:
        h["Range"] = f"bytes={offset}-"
        if validator:
            h["If-Range"] = validator
    try:
        resp = open_url(url, h, timeout_s)
    except HttpStatusError as e:
        if e.status != 416 or not offset:
            raise
        # The part on disk is at least as long as the file: only a changed file does that. Start over.
        resp = open_url(url, headers, timeout_s)
    start, total = 0, _int_or_none(resp.headers.get("Content-Length"))
    if resp.status == 206:
        m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", "").strip())
        if not m:
            resp.close()
            raise FetchError(f"{redact(url)} answered 206 without a usable Content-Range")
        start = int(m.group(1))
        total = int(m.group(3)) if m.group(3) != "*" else None
    etag = resp.headers.get("ETag")
    # If-Range takes only a strong ETag or a date.
    new_validator = etag if etag and not etag.startswith("W/") else resp.headers.get("Last-Modified")
    return Body(
        start=start,
        chunks=_chunks(resp),
        close=resp.close,
        validator=new_validator,
        total_size=total,
        content_type=resp.headers.get("Content-Type"),
    )


def _chunks(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while True:
        try:
            chunk = resp.read(CHUNK_BYTES)
        except (OSError, http.client.HTTPException) as e:
            raise TransientError(f"connection dropped: {type(e).__name__}: {e}") from e
        if not chunk:
            return
        yield chunk


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        raw = e.read(2000)
    except (OSError, http.client.HTTPException):
        return ""
    try:
        data = json.loads(raw)
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict):  # GCS: {"error": {"code": 403, "message": ...}}
                err = err.get("message")
            if isinstance(err, str):
                return err[:300]
    except ValueError:
        pass
    return raw.decode("utf-8", "replace").strip().replace("\n", " ")[:300]
