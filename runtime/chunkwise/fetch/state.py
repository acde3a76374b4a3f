"""What a fetch leaves in DIR besides the model: the completion marker, the in-progress journal, the lock.

- DIR/.chunkwise-fetch.json: written last (atomically), so that its presence means DIR is complete for
  the URI and selection it names. A second run finds it and does nothing.
- DIR/.chunkwise-partial/: .part files, their sidecars, and journal.json, which names the URI being
  fetched and every file already verified and renamed into place, so that a rerun after a crash neither
  mixes in another model nor re-hashes what it already checked. Removed once the marker is written.
- DIR/.chunkwise-fetch.lock: flock()ed for the whole fetch, so that replicas sharing one volume fetch once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from chunkwise.fetch.errors import FetchError

MARKER_NAME = ".chunkwise-fetch.json"
LOCK_NAME = ".chunkwise-fetch.lock"
PARTIAL_DIR = ".chunkwise-partial"
JOURNAL_NAME = "journal.json"
MARKER_VERSION = 1
# Names no fetched file may take: they would overwrite the fetch's own state.
RESERVED_NAMES = frozenset({MARKER_NAME, LOCK_NAME, PARTIAL_DIR})

log = logging.getLogger("chunkwise.fetch")


@dataclass(frozen=True)
class FileRecord:
    path: str  # relative to DIR, '/'-separated
    size: int
    algo: str | None = None  # the checksum's algorithm: "sha256", "md5" or "git-sha1"
    digest: str | None = None  # lower-case hex
    verified: bool = False  # whether `digest` was checked against the source's own sum (else only computed)


@dataclass(frozen=True)
class Marker:
    uri: str  # the URI's identity (uri.py)
    mode: str  # Selection.mode: "full", "tokenizer-only" or "subset"
    includes: tuple[str, ...]
    revision: str | None  # the resolved commit, ETag/generation set or archive sum: what was fetched
    files: tuple[FileRecord, ...]
    finished_at: str  # ISO 8601, UTC
    version: int = MARKER_VERSION


@dataclass
class Journal:
    """The in-progress record (see the module doc). `files` maps a path to its record and its mtime."""

    uri: str
    files: dict[str, tuple[FileRecord, int]] = field(default_factory=dict)


def write_json_atomically(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Makes a rename durable: without it a node crash can forget a rename that the marker relies on."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_marker(dest: Path) -> Marker | None:
    path = dest / MARKER_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Marker(
            uri=data["uri"],
            mode=data["mode"],
            includes=tuple(data.get("includes", ())),
            revision=data.get("revision"),
            files=tuple(FileRecord(**f) for f in data["files"]),
            finished_at=data["finished_at"],
            version=data.get("version", MARKER_VERSION),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FetchError(f"{path} is unreadable ({e}); delete it, or run with --force to fetch afresh") from e


def write_marker(dest: Path, marker: Marker) -> None:
    write_json_atomically(dest / MARKER_NAME, asdict(marker))


def remove_marker(dest: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (dest / MARKER_NAME).unlink()


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def partial_dir(dest: Path) -> Path:
    return dest / PARTIAL_DIR


def read_journal(dest: Path) -> Journal | None:
    path = partial_dir(dest) / JOURNAL_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = {p: (FileRecord(**e["record"]), int(e["mtime_ns"])) for p, e in data["files"].items()}
        return Journal(data["uri"], files)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        # Only a cache of checks already made: without it, files present are verified again.
        log.warning("ignoring an unreadable %s (%s)", path, e)
        return None


def write_journal(dest: Path, journal: Journal) -> None:
    files = {p: {"record": asdict(r), "mtime_ns": m} for p, (r, m) in journal.files.items()}
    partial_dir(dest).mkdir(parents=True, exist_ok=True)
    write_json_atomically(partial_dir(dest) / JOURNAL_NAME, {"uri": journal.uri, "files": files})


def remove_partial_dir(dest: Path) -> None:
    shutil.rmtree(partial_dir(dest), ignore_errors=True)


def remove_fetched_files(dest: Path, paths: Iterator[str] | list[str]) -> int:
    """Deletes files an earlier fetch placed (and only those: DIR may hold things that are not ours)."""
    removed = 0
    for rel in paths:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (dest / rel).unlink()
            removed += 1
    return removed


@contextlib.contextmanager
def dir_lock(dest: Path, log_interval_s: float) -> Iterator[None]:
    """Holds an exclusive flock on DIR/.chunkwise-fetch.lock; waits, saying so, while another process does.

    flock is released by the kernel when its holder dies, so a killed fetch never leaves a stale lock. On
    NFS volumes Linux maps flock to the server's byte-range locks, which serialise across nodes too."""
    path = dest / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited_since: float | None = None
        last_log = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise FetchError(f"cannot lock {path}: {e}") from e
            now = time.monotonic()
            if waited_since is None:
                waited_since = last_log = now
                log.info("another fetch into %s is running (%s); waiting for it", dest, _holder(path))
            elif now - last_log >= log_interval_s:
                last_log = now
                log.info("still waiting for the other fetch into %s (%.0fs)", dest, now - waited_since)
            time.sleep(0.2)
        if waited_since is not None:
            log.info("the other fetch into %s finished after %.1fs", dest, time.monotonic() - waited_since)
        # Who holds it, for the waiting side's log line.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _holder(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip() or "holder unknown"
    except OSError:
        return "holder unknown"
