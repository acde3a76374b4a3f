"""One file from any source into place: resume from the part on disk, retry dropped connections, verify,
rename. Sources only say how to open a byte stream at an offset (RemoteFile.open); everything a user
relies on (where partial bytes live, when a part is reused, what a mismatch does) is decided here, once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from chunkwise.fetch.errors import FetchError, TransientError
from chunkwise.fetch.progress import Progress, human_bytes
from chunkwise.fetch.state import RESERVED_NAMES, FileRecord, Journal, fsync_dir, write_journal

log = logging.getLogger("chunkwise.fetch")

MAX_BACKOFF_S = 60.0
HASH_CHUNK_BYTES = 1 << 20


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...
    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class Checksum:
    algo: str  # "sha256", "md5" or "git-sha1" (the Hub's blob id for files outside LFS)
    hexdigest: str

    def hasher(self, size: int | None) -> Hasher:
        return new_hasher(self.algo, size)


def new_hasher(algo: str, size: int | None) -> Hasher:
    if algo == "git-sha1":
        if size is None:
            raise ValueError("a git blob id needs the file's size")
        h = hashlib.sha1(usedforsecurity=False)
        h.update(b"blob %d\0" % size)
        return h
    return hashlib.new(algo, usedforsecurity=False)


@dataclass
class Body:
    """A response body from byte `start` of the file: the offset asked for, or 0 when the source ignored
    the range (or the content changed since the part on disk was written)."""

    start: int
    chunks: Iterator[bytes]  # raises TransientError when the connection drops
    close: Callable[[], None]
    validator: str | None = None  # what the source says identifies this content (ETag, Last-Modified)
    total_size: int | None = None  # the whole file's size, when the response says it
    content_type: str | None = None
    # False when the source's checksum turns out not to be a digest of the bytes (S3's ETag of an object
    # encrypted with KMS); the size is still checked.
    checksum_applies: bool = True


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to DIR, '/'-separated, checked by safe_relpath
    size: int | None  # None when the source says only as the body arrives (an archive over HTTP)
    checksum: Checksum | None
    version: str | None  # the content's identity at the source; a part written for another is discarded
    open: Callable[[int, str | None], Body]  # (offset, validator) -> the body from there


@dataclass(frozen=True)
class Listing:
    """What a source holds for a URI: its files and the revision they are at (a commit, a set of ETags)."""

    revision: str | None
    files: list[RemoteFile]


@dataclass(frozen=True)
class Placed:
    record: FileRecord
    content_type: str | None  # of the last response, when one was made


def safe_relpath(path: str, what: str) -> str:
    """`path` (from a listing) as a relative path inside DIR; a FetchError for anything that would escape it
    or collide with the fetch's own files."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or path.startswith("/") or ".." in parts or ":" in parts[0]:
        raise FetchError(f"refusing {what} {path!r}: its path would land outside the model directory")
    if parts[0] in RESERVED_NAMES:
        raise FetchError(f"refusing {what} {path!r}: the name is reserved for the fetch's own state")
    return "/".join(parts)


def hash_file(path: Path, hasher: Hasher) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            hasher.update(chunk)


class Downloader:
    def __init__(
        self,
        dest: Path,
        partial: Path,
        journal: Journal,
        progress: Progress,
        *,
        retries: int,
        backoff_s: float,
        trusted: dict[str, FileRecord] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.dest = dest
        self.partial = partial
        self.journal = journal
        self.progress = progress
        self.retries = retries
        self.backoff_s = backoff_s
        # Records of an earlier complete fetch of the same URI (its marker): a file there with the same
        # size and sum as the source's needs no download and no re-hash.
        self.trusted = trusted or {}
        self.sleep = sleep

    def fetch(self, f: RemoteFile, target: Path | None = None) -> Placed:
        """Puts `f` at `target` (default DIR/f.path), verified; returns its record."""
        target = target or self.dest / f.path
        present = self._present(f, target)
        if present is not None:
            self.progress.present(f.path, present.size)
            return Placed(present, None)
        part = self.partial / (f.path + ".part")
        sidecar = part.with_name(part.name + ".json")
        part.parent.mkdir(parents=True, exist_ok=True)
        meta = _read_sidecar(sidecar)
        offset = part.stat().st_size if part.exists() else 0
        if offset and (meta.get("version") != f.version or (f.size is not None and offset > f.size)):
            log.info("discarding %s's partial download: the source's content changed", f.path)
            part.unlink()
            offset = 0
        checksum = f.checksum
        # Without a checksum from the source a sum is still computed, for the marker.
        hasher = checksum.hasher(f.size) if checksum else new_hasher("sha256", None)
        if offset:
            hash_file(part, hasher)  # resuming across runs: the bytes on disk count toward the sum
        validator: str | None = meta.get("validator")
        checksum_applies = bool(meta.get("checksum_applies", True))
        content_type: str | None = None
        size = f.size
        failures = 0
        self.progress.start_file(f.path, size, offset)
        with open(part, "ab") as out:
            while size is None or offset < size:
                body: Body | None = None
                progressed = False
                try:
                    body = f.open(offset, validator)
                    if body.start != offset:
                        if body.start != 0:
                            raise FetchError(
                                f"{f.path}: asked for bytes from {offset}, got from {body.start}"
                            )
                        log.warning(
                            "%s: the source answered from byte 0, not %d; starting over", f.path, offset
                        )
                        out.truncate(0)
                        self.progress.rewind(offset)
                        offset = 0
                        hasher = checksum.hasher(f.size) if checksum else new_hasher("sha256", None)
                    validator = body.validator or validator
                    checksum_applies = checksum_applies and body.checksum_applies
                    content_type = body.content_type or content_type
                    if size is None and body.total_size is not None:
                        size = body.total_size
                        self.progress.set_file_size(size)
                    _write_sidecar(sidecar, f.version, validator, checksum_applies)
                    for chunk in body.chunks:
                        out.write(chunk)
                        hasher.update(chunk)
                        offset += len(chunk)
                        progressed = True
                        self.progress.advance(len(chunk))
                    if size is None:
                        break  # no length known: the end of the body is the end of the file
                    if offset < size:
                        raise TransientError(f"connection closed at byte {offset} of {size}")
                except TransientError as e:
                    out.flush()
                    # A connection that keeps delivering is worth following however often it drops; only
                    # failures in a row without a byte count against --retries.
                    failures = 1 if progressed else failures + 1
                    if failures > self.retries:
                        raise FetchError(
                            f"{f.path}: giving up after {self.retries} retries at byte {offset}: {e}"
                        ) from e
                    wait = min(self.backoff_s * 2 ** (failures - 1), MAX_BACKOFF_S)
                    log.warning(
                        "%s: %s; retry %d of %d in %.1fs from byte %d",
                        f.path,
                        e,
                        failures,
                        self.retries,
                        wait,
                        offset,
                    )
                    self.sleep(wait)
                finally:
                    if body is not None:
                        body.close()
            out.flush()
            os.fsync(out.fileno())
        if size is not None and offset != size:
            _discard(part, sidecar)
            raise FetchError(
                f"{f.path}: got {offset} bytes, the source said {size}; the partial file was deleted"
            )
        digest = hasher.hexdigest()
        algo: str | None = "sha256"
        verified = False
        if checksum is not None and checksum_applies:
            if digest != checksum.hexdigest:
                _discard(part, sidecar)
                raise FetchError(
                    f"{f.path}: {checksum.algo} mismatch (expected {checksum.hexdigest}, got {digest}); "
                    "the download was deleted"
                )
            algo, verified = checksum.algo, True
        elif checksum is not None:
            log.info("%s: the source's %s is no digest of its bytes; checked the size", f.path, checksum.algo)
            algo, digest = None, ""
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, target)
        fsync_dir(target.parent)
        with contextlib.suppress(FileNotFoundError):
            sidecar.unlink()
        record = FileRecord(f.path, offset, algo, digest or None, verified)
        self.journal.files[f.path] = (record, target.stat().st_mtime_ns)
        write_journal(self.dest, self.journal)
        self.progress.end_file()
        log.info("%s: done (%s%s)", f.path, human_bytes(offset), f", {algo} verified" if verified else "")
        return Placed(record, content_type)

    def _present(self, f: RemoteFile, target: Path) -> FileRecord | None:
        """The record of a file already at `target` with the source's content, else None."""
        try:
            st = target.stat()
        except FileNotFoundError:
            return None
        if not target.is_file() or (f.size is not None and st.st_size != f.size):
            return None
        want = (f.checksum.algo, f.checksum.hexdigest) if f.checksum else None
        entry = self.journal.files.get(f.path)
        if entry is not None:
            record, mtime_ns = entry
            # Our own record of a file we verified and placed, untouched since (same size and mtime).
            same = want is None or record.algo is None or (record.algo, record.digest) == want
            if record.size == st.st_size and mtime_ns == st.st_mtime_ns and same:
                return record
        earlier = self.trusted.get(f.path)
        if earlier is not None and earlier.size == st.st_size and _same_sum(earlier, want, f.size):
            return earlier
        if f.checksum is None or f.size is None:
            return None  # nothing to check a stranger's file against: fetch it
        hasher = f.checksum.hasher(f.size)
        log.info("verifying %s, already in %s", f.path, self.dest)
        hash_file(target, hasher)
        if hasher.hexdigest() != f.checksum.hexdigest:
            return None
        record = FileRecord(f.path, st.st_size, f.checksum.algo, f.checksum.hexdigest, True)
        self.journal.files[f.path] = (record, st.st_mtime_ns)
        write_journal(self.dest, self.journal)
        return record


def _same_sum(record: FileRecord, want: tuple[str, str] | None, size: int | None) -> bool:
    if want is None or record.algo is None:
        # A size-only source (or a sum that proved not to be a digest): the size matched, all it offers.
        return want is not None or size is not None
    return (record.algo, record.digest) == want


def _read_sidecar(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_sidecar(path: Path, version: str | None, validator: str | None, checksum_applies: bool) -> None:
    data = {"version": version, "validator": validator, "checksum_applies": checksum_applies}
    path.write_text(json.dumps(data), encoding="utf-8")


def _discard(part: Path, sidecar: Path) -> None:
    for p in (part, sidecar):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def with_retries(what: str, fn: Callable[[], Any], retries: int, backoff_s: float) -> Any:
    """fn() retried on TransientError with the downloads' backoff: listings and metadata calls."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except TransientError as e:
            if attempt == retries:
                raise FetchError(f"{what}: giving up after {retries} retries: {e}") from e
            wait = min(backoff_s * 2**attempt, MAX_BACKOFF_S)
            log.warning("%s: %s; retry %d of %d in %.1fs", what, e, attempt + 1, retries, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")
