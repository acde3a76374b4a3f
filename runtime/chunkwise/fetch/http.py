"""http(s)://host/model.tar.gz: an archive, downloaded (resumable, verified against --sha256 / #sha256=HEX
when given), then extracted safely into DIR (archive.py). The archive itself is deleted once extracted."""

from __future__ import annotations

import contextlib
from pathlib import Path

from chunkwise.fetch.archive import archive_kind, extract
from chunkwise.fetch.download import Body, Checksum, Downloader, RemoteFile
from chunkwise.fetch.httpclient import ranged_body
from chunkwise.fetch.options import FetchOptions
from chunkwise.fetch.state import FileRecord
from chunkwise.fetch.uri import HttpUri


def fetch_archive(
    uri: HttpUri, options: FetchOptions, downloader: Downloader, dest: Path, partial: Path
) -> tuple[str, list[FileRecord]]:
    """(the archive's sha256, the records of the files extracted)."""
    headers = {"Authorization": f"Bearer {options.token}"} if options.token else {}
    # Servers that gzip on the fly would hand back other bytes than the archive's, and break ranges.
    headers["Accept-Encoding"] = "identity"

    def open_at(offset: int, validator: str | None) -> Body:
        return ranged_body(uri.url, headers, offset, validator, options.timeout_s)

    name = uri.filename
    remote = RemoteFile(
        path=name,
        size=None,
        checksum=Checksum("sha256", uri.sha256) if uri.sha256 else None,
        version=None,  # the server's ETag or Last-Modified (If-Range) guards the resume instead
        open=open_at,
    )
    archive = partial / "archive" / name
    placed = downloader.fetch(remote, archive)
    kind = archive_kind(name, placed.content_type, archive)
    records = extract(archive, kind, dest, partial / "extract", options.selection)
    with contextlib.suppress(FileNotFoundError):
        archive.unlink()
    return placed.record.digest or "", records
