"""`chunkwise fetch-model gs://...` against a GCS JSON-API server on loopback (STORAGE_EMULATOR_HOST):
paged listings, media downloads at the listed generation, md5Hash verification, bearer tokens."""

from __future__ import annotations

import base64
import hashlib
import json
from contextlib import contextmanager

import pytest

from chunkwise.fetch.errors import FetchError
from chunkwise.fetch.state import read_marker
from tests.fetch.fetch_servers import Loopback, Seen, fetch, json_route, model_files, serving, tree

BUCKET = "models-bkt"
PAGE = 2
FILES = model_files()


@contextmanager
def gcs(objects: dict[str, bytes], token: str | None = None, bad_md5: frozenset[str] = frozenset()):
    names = sorted(objects)

    def list_route(seen: Seen):
        prefix = seen.query.get("prefix", [""])[0]
        matching = [n for n in names if n.startswith(prefix)]
        start = int(seen.query.get("pageToken", ["0"])[0])
        items = []
        for n in matching[start : start + PAGE]:
            md5 = hashlib.md5(b"not it" if n in bad_md5 else objects[n]).digest()
            items.append(
                {
                    "name": n,
                    "size": str(len(objects[n])),
                    "md5Hash": base64.b64encode(md5).decode(),
                    "generation": "1700000000000001",
                }
            )
        page: dict = {"kind": "storage#objects", "items": items}
        if start + PAGE < len(matching):
            page["nextPageToken"] = str(start + PAGE)
        return 200, {"Content-Type": "application/json"}, json.dumps(page).encode()

    state = Loopback(token=token)
    state.routes[f"/storage/v1/b/{BUCKET}/o"] = list_route
    for n, data in objects.items():
        state.files[f"/download/storage/v1/b/{BUCKET}/o/{n}"] = data
    with serving(state) as srv:
        yield srv


@pytest.fixture
def objects():
    out = {f"llama/tiny/{k}": v for k, v in FILES.items()}
    out["llama/tiny-other/config.json"] = b"{}"  # shares the prefix's text, not its directory
    return out


def test_objects_are_listed_across_pages_fetched_and_md5_verified(tmp_path, monkeypatch, objects):
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", "ya29.token")
    with gcs(objects, token="ya29.token") as srv:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", srv.url)
        out = fetch(f"gs://{BUCKET}/llama/tiny", tmp_path / "m")
    assert tree(tmp_path / "m") == FILES
    listings = srv.gets(f"/storage/v1/b/{BUCKET}/o")
    assert [r.query.get("pageToken") for r in listings] == [None, ["2"], ["4"]]
    assert all(r.query["prefix"] == ["llama/tiny/"] for r in listings)
    media = [r for r in srv.requests if r.path.startswith("/download/")]
    assert len(media) == len(FILES)
    assert all(r.query == {"alt": ["media"], "generation": ["1700000000000001"]} for r in media)
    assert all(f.algo == "md5" and f.verified for f in out.marker.files)


def test_a_wrong_md5_is_rejected(tmp_path, monkeypatch, objects):
    monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN", raising=False)
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    with gcs(objects, bad_md5=frozenset({"llama/tiny/model.safetensors"})) as srv:
        # host:port, as emulators say
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", srv.url.removeprefix("http://"))
        with pytest.raises(FetchError, match=r"model\.safetensors: md5 mismatch"):
            fetch(f"gs://{BUCKET}/llama/tiny/", tmp_path / "m")
    assert not (tmp_path / "m" / "model.safetensors").exists() and read_marker(tmp_path / "m") is None
    assert all("authorization" not in r.headers for r in srv.requests)  # anonymous


def test_the_metadata_servers_token_is_used(tmp_path, monkeypatch, objects):
    monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN", raising=False)
    metadata = Loopback()
    path = "/computeMetadata/v1/instance/service-accounts/default/token"
    metadata.routes[path] = json_route(
        {"access_token": "from-metadata", "expires_in": 3599, "token_type": "Bearer"}
    )
    with serving(metadata) as md, gcs(objects, token="from-metadata") as srv:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", srv.url)
        monkeypatch.setenv("GCE_METADATA_HOST", md.url.removeprefix("http://"))
        fetch(f"gs://{BUCKET}/llama/tiny", tmp_path / "m")
    assert tree(tmp_path / "m") == FILES
    assert md.requests[0].headers["metadata-flavor"] == "Google"
    assert len(md.requests) == 1  # cached until it nears expiry
