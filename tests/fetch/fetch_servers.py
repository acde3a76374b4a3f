"""Real HTTP servers on loopback for the fetch-model tests: a file server with byte ranges (and ways to
misbehave: drop a connection, ignore Range, go slowly), on which the Hub-style and GCS-style servers are
built as routes. Every request is logged, so that tests assert what the client actually sent."""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import tarfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class Seen:
    path: str  # unquoted, without the query
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names

    @property
    def range(self) -> str | None:
        return self.headers.get("range")


Route = Callable[["Seen"], tuple[int, dict[str, str], bytes]]


@dataclass
class Loopback:
    files: dict[str, bytes] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)  # exact path -> handler (JSON APIs)
    redirects: dict[str, str] = field(default_factory=dict)  # path -> absolute URL
    token: str | None = None  # when set, every request must carry "Authorization: Bearer <token>"
    drop_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before the first drop
    ignore_range: bool = False
    bytes_per_second: float | None = None  # throttles file bodies
    content_types: dict[str, str] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)
    url: str = ""

    def gets(self, path: str) -> list[Seen]:
        return [r for r in self.requests if r.path == path]


def _handler(state: Loopback) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            seen = Seen(
                unquote(parts.path), parse_qs(parts.query), {k.lower(): v for k, v in self.headers.items()}
            )
            state.requests.append(seen)
            if state.token is not None and seen.headers.get("authorization") != f"Bearer {state.token}":
                return self._send(401, {"Content-Type": "application/json"}, b'{"error": "bad token"}')
            if seen.path in state.redirects:
                return self._send(302, {"Location": state.redirects[seen.path]}, b"")
            if seen.path in state.routes:
                status, headers, body = state.routes[seen.path](seen)
                return self._send(status, headers, body)
            if seen.path in state.files:
                return self._file(seen)
            self._send(404, {"Content-Type": "application/json"}, b'{"error": "not found"}')

        def _file(self, seen: Seen) -> None:
            data = state.files[seen.path]
            etag = '"' + hashlib.sha256(data).hexdigest()[:16] + '"'
            start = 0
            m = re.match(r"bytes=(\d+)-$", seen.range or "")
            if_range = seen.headers.get("if-range")
            if m and not state.ignore_range and (if_range is None or if_range == etag):
                start = int(m.group(1))
                if start >= len(data):
                    return self._send(416, {"Content-Range": f"bytes */{len(data)}"}, b"")
            body = data[start:]
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", state.content_types.get(seen.path, "application/octet-stream"))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            limit = state.drop_after.pop(seen.path, None)
            if limit is not None:
                body = body[:limit]
            step = 16384
            for i in range(0, len(body), step):
                self.wfile.write(body[i : i + step])
                if state.bytes_per_second:
                    self.wfile.flush()
                    time.sleep(step / state.bytes_per_second)
            if limit is not None:
                self.wfile.flush()
                self.close_connection = True

        def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@contextmanager
def serving(state: Loopback, host: str = "127.0.0.1") -> Iterator[Loopback]:
    server = ThreadingHTTPServer((host, 0), _handler(state))
    server.daemon_threads = True
    state.url = f"http://{host}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def json_route(payload: Any) -> Route:
    def route(_: Seen) -> tuple[int, dict[str, str], bytes]:
        return 200, {"Content-Type": "application/json"}, json.dumps(payload).encode()

    return route


# ---- a small model directory and its archives


def model_files(weights_bytes: int = 200_000, seed: int = 0) -> dict[str, bytes]:
    # Incompressible, so that an archive is as large as its model.
    weights = random.Random(seed).randbytes(weights_bytes)
    return {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "seed": seed}).encode(),
        "tokenizer.json": b'{"model": {"type": "BPE"}}',
        "tokenizer_config.json": b'{"eos_token": "</s>"}',
        "generation_config.json": b'{"eos_token_id": 2}',
        "model.safetensors": weights,
        "extra/notes.txt": b"nested file\n",
    }


def tar_gz(
    files: dict[str, bytes], top: str = "tiny-model", extra: list[tarfile.TarInfo] | None = None
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        d = tarfile.TarInfo(top)
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for name, data in files.items():
            ti = tarfile.TarInfo(f"{top}/{name}" if top else name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        for ti in extra or []:
            tf.addfile(ti, io.BytesIO(b"x" * ti.size) if ti.isfile() else None)
    return buf.getvalue()


def zip_bytes(files: dict[str, bytes], top: str = "tiny-model") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(f"{top}/{name}" if top else name, data)
    return buf.getvalue()


def tree(path: Path) -> dict[str, bytes]:
    """The model files in a directory (the fetch's own state left out)."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and not rel.startswith(".chunkwise"):
            out[rel] = p.read_bytes()
    return out


# ---- running the fetch


def fetch(uri: str, dest: Path, *, sha256: str | None = None, **options: Any) -> Any:
    """fetch_model in-process, without retries or backoff unless asked (fast, deterministic tests)."""
    from chunkwise.fetch.options import FetchOptions
    from chunkwise.fetch.run import fetch_model
    from chunkwise.fetch.uri import parse_uri

    options.setdefault("retries", 0)
    options.setdefault("backoff_s", 0.0)
    options.setdefault("timeout_s", 10.0)
    return fetch_model(parse_uri(uri, sha256=sha256), dest, FetchOptions(**options))


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Any:
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "chunkwise.cli", "fetch-model", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def cli_popen(*args: str, env: dict[str, str] | None = None) -> Any:
    import os
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-m", "chunkwise.cli", "fetch-model", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
