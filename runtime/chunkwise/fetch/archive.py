"""Safe extraction of a model archive (.tar, .tar.gz/.tgz, .tar.xz, .tar.bz2, .zip) into DIR.

Every member is checked before a byte is written: an absolute path, a '..' component, a device or a link
that leaves the archive refuses the whole archive. Links inside it are materialised as copies of their
target, so DIR never holds a symlink. If the archive holds one top-level directory, its contents become
DIR (config.json lands in DIR itself, where the loader looks).
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import lzma
import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from chunkwise.fetch.download import safe_relpath
from chunkwise.fetch.errors import FetchError
from chunkwise.fetch.select import Selection
from chunkwise.fetch.state import FileRecord

COPY_CHUNK_BYTES = 1 << 20
_SUFFIXES = (
    (".tar.gz", "tar.gz"),
    (".tgz", "tar.gz"),
    (".tar.xz", "tar.xz"),
    (".txz", "tar.xz"),
    (".tar.bz2", "tar.bz2"),
    (".tbz2", "tar.bz2"),
    (".tar", "tar"),
    (".zip", "zip"),
)
_CONTENT_TYPES = {
    "application/gzip": "tar.gz",
    "application/x-gzip": "tar.gz",
    "application/x-tar": "tar",
    "application/x-gtar": "tar.gz",
    "application/x-xz": "tar.xz",
    "application/x-bzip2": "tar.bz2",
    "application/zip": "zip",
    "application/x-zip-compressed": "zip",
}
# Finder's resource forks in zips made on macOS: never part of a model, and would defeat the top-level
# directory rule.
_IGNORED_TOP = frozenset({"__MACOSX"})
MAX_LINK_HOPS = 16
_TAR_MODES: dict[str, Literal["r:", "r:gz", "r:xz", "r:bz2"]] = {
    "tar": "r:",
    "tar.gz": "r:gz",
    "tar.xz": "r:xz",
    "tar.bz2": "r:bz2",
}
# What a damaged or truncated archive raises (an encrypted zip member: RuntimeError); a disk error is
# reported as itself.
_DAMAGED = (
    tarfile.TarError,
    zipfile.BadZipFile,
    EOFError,
    gzip.BadGzipFile,
    lzma.LZMAError,
    zlib.error,
    RuntimeError,
)

log = logging.getLogger("chunkwise.fetch")


def archive_kind(name: str, content_type: str | None, path: Path) -> str:
    """By the name, else the Content-Type, else the first bytes (servers often say octet-stream)."""
    lower = name.lower()
    for suffix, kind in _SUFFIXES:
        if lower.endswith(suffix):
            return kind
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype in _CONTENT_TYPES:
        return _CONTENT_TYPES[ctype]
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(b"\x1f\x8b"):
        return "tar.gz"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "tar.xz"
    if head.startswith(b"BZh"):
        return "tar.bz2"
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head[257:262] == b"ustar":
        return "tar"
    raise FetchError(
        f"cannot tell what kind of archive {name!r} is (Content-Type {content_type!r}); "
        "name it .tar, .tar.gz, .tgz, .tar.xz or .zip"
    )


@dataclass(frozen=True)
class Member:
    path: str  # safe, relative to the archive's root
    kind: str  # "file", "dir" or "link" (a symlink or hardlink)
    target: str | None  # a link's target, relative to the archive's root
    size: int
    opener: Callable[[], IO[bytes]]


def extract(archive: Path, kind: str, dest: Path, staging: Path, selection: Selection) -> list[FileRecord]:
    """Extracts the selected members into `staging`, then moves them into `dest`; returns their records."""
    try:
        if kind == "zip":
            with zipfile.ZipFile(archive) as zf:
                return _extract(_zip_members(zf), dest, staging, selection)
        with tarfile.open(archive, _TAR_MODES[kind]) as tf:
            return _extract(_tar_members(tf), dest, staging, selection)
    except _DAMAGED as e:
        raise FetchError(f"{archive.name} is not a readable {kind} archive: {type(e).__name__}: {e}") from e


def _tar_members(tf: tarfile.TarFile) -> list[Member]:
    members = []
    for ti in tf.getmembers():
        path = _member_path(ti.name)
        if path is None:
            continue
        if ti.isdir():
            members.append(Member(path, "dir", None, 0, _no_data))
        elif ti.isfile():
            members.append(Member(path, "file", None, ti.size, _tar_opener(tf, ti)))
        elif ti.issym():
            members.append(Member(path, "link", _symlink_target(path, ti.linkname), 0, _no_data))
        elif ti.islnk():
            target = _member_path(ti.linkname)
            if target is None:
                raise FetchError(f"refusing the archive: hard link {ti.name!r} has no target")
            members.append(Member(path, "link", target, 0, _no_data))
        else:
            raise FetchError(f"refusing the archive: member {ti.name!r} is a device or fifo, not a file")
    return members


def _zip_members(zf: zipfile.ZipFile) -> list[Member]:
    members = []
    for zi in zf.infolist():
        path = _member_path(zi.filename)
        if path is None:
            continue
        mode = zi.external_attr >> 16
        if zi.is_dir():
            members.append(Member(path, "dir", None, 0, _no_data))
        elif stat.S_ISLNK(mode):
            target = zf.read(zi).decode("utf-8", "replace")
            members.append(Member(path, "link", _symlink_target(path, target), 0, _no_data))
        else:
            members.append(Member(path, "file", None, zi.file_size, _zip_opener(zf, zi)))
    return members


def _member_path(name: str) -> str | None:
    """The member's safe path; None for the archive's root entry ("./")."""
    if not [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]:
        return None
    return safe_relpath(name, "archive member")


def _symlink_target(path: str, target: str) -> str:
    if target.startswith("/") or target.startswith("\\"):
        raise FetchError(f"refusing the archive: symlink {path!r} points to the absolute path {target!r}")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    if resolved == ".." or resolved.startswith("../"):
        raise FetchError(f"refusing the archive: symlink {path!r} -> {target!r} points outside it")
    return resolved


def _strip_prefix(members: list[Member]) -> str:
    """'X/' when every member lies in one top-level directory X, else ''."""
    tops = {m.path.split("/", 1)[0] for m in members if m.path.split("/", 1)[0] not in _IGNORED_TOP}
    if len(tops) != 1:
        return ""
    (top,) = tops
    if any(m.path == top and m.kind != "dir" for m in members):
        return ""  # a single file, not a directory
    return top + "/"


def _extract(members: list[Member], dest: Path, staging: Path, selection: Selection) -> list[FileRecord]:
    strip = _strip_prefix(members)
    by_path = {m.path: m for m in members}
    chosen: list[tuple[str, Member]] = []
    for m in members:
        if m.path.split("/", 1)[0] in _IGNORED_TOP or m.kind == "dir":
            continue
        source = _resolve(m, by_path)
        if not m.path.startswith(strip):
            continue
        rel = m.path[len(strip) :]
        if selection.matches(rel):
            chosen.append((rel, source))
    if not chosen:
        raise FetchError(
            "the archive holds no files" + ("" if selection.mode == "full" else f" for {selection.mode}")
        )
    log.info("extracting %d file(s)%s", len(chosen), f" from its top-level {strip[:-1]}/" if strip else "")
    shutil.rmtree(staging, ignore_errors=True)
    records = []
    for rel, source in chosen:
        out_path = staging / rel
        out_path.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        size = 0
        with source.opener() as src, open(out_path, "wb") as out:
            while chunk := src.read(COPY_CHUNK_BYTES):
                out.write(chunk)
                h.update(chunk)
                size += len(chunk)
        if size != source.size:
            raise FetchError(
                f"the archive's {source.path!r} holds {size} bytes, its header says {source.size}"
            )
        records.append(FileRecord(rel, size, "sha256", h.hexdigest(), False))
    for record in records:
        target = dest / record.path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / record.path, target)
    shutil.rmtree(staging, ignore_errors=True)
    return records


def _resolve(m: Member, by_path: dict[str, Member]) -> Member:
    """The file a member's bytes come from: itself, or the end of its chain of links."""
    seen = m
    for _ in range(MAX_LINK_HOPS):
        if seen.kind == "file":
            return seen
        target = by_path.get(seen.target or "")
        if target is None or target.kind == "dir":
            what = "a directory" if target is not None else "nothing in the archive"
            raise FetchError(f"refusing the archive: link {m.path!r} points to {what} ({seen.target!r})")
        seen = target
    raise FetchError(f"refusing the archive: link {m.path!r} is a chain of more than {MAX_LINK_HOPS} links")


def _no_data() -> IO[bytes]:
    raise AssertionError("a directory or link has no data of its own")


def _tar_opener(tf: tarfile.TarFile, ti: tarfile.TarInfo) -> Callable[[], IO[bytes]]:
    def opener() -> IO[bytes]:
        f = tf.extractfile(ti)
        if f is None:
            raise FetchError(f"cannot read {ti.name!r} from the archive")
        return f

    return opener


def _zip_opener(zf: zipfile.ZipFile, zi: zipfile.ZipInfo) -> Callable[[], IO[bytes]]:
    def opener() -> IO[bytes]:
        return zf.open(zi)

    return opener
