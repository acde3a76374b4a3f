"""`chunkwise fetch-model hf://...` against a Hub-style server on loopback (HF_ENDPOINT): the revision API,
resolve URLs, LFS files redirected to a CDN on another port, and a bearer token."""

from __future__ import annotations

import hashlib
from contextlib import ExitStack, contextmanager

import pytest

from chunkwise.fetch.errors import FetchError
from chunkwise.fetch.select import Selection
from chunkwise.fetch.state import PARTIAL_DIR, read_marker
from tests.fetch.fetch_servers import Loopback, cli, fetch, json_route, model_files, serving, tree

TOKEN = "hf_secret"
REPO = "org/tiny"
SHAS = {"main": "a" * 40, "v1": "b" * 40}
LFS = {"model.safetensors", "pytorch_model.bin"}


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _repo_files(revision: str) -> dict[str, bytes]:
    files = model_files(seed=0 if revision == "main" else 1)
    files["pytorch_model.bin"] = b"the same weights, in a format the engine does not load"
    return files


@contextmanager
def hub(lfs_sha_override: dict[str, str] | None = None, blob_override: dict[str, str] | None = None):
    with ExitStack() as stack:
        cdn = stack.enter_context(serving(Loopback()))
        srv = stack.enter_context(serving(Loopback(token=TOKEN)))
        for revision, sha in SHAS.items():
            siblings = []
            for name, data in _repo_files(revision).items():
                entry: dict = {"rfilename": name, "size": len(data)}
                if name in LFS:
                    digest = hashlib.sha256(data).hexdigest()
                    entry["lfs"] = {"sha256": (lfs_sha_override or {}).get(name, digest), "size": len(data)}
                    # The Hub answers LFS files with a redirect to its CDN, with a signed URL.
                    cdn.files[f"/{digest}"] = data
                    srv.redirects[f"/{REPO}/resolve/{sha}/{name}"] = f"{cdn.url}/{digest}?X-Sig=1"
                else:
                    entry["blobId"] = (blob_override or {}).get(name, _git_blob_id(data))
                    srv.files[f"/{REPO}/resolve/{sha}/{name}"] = data
                siblings.append(entry)
            info = {"id": REPO, "sha": sha, "siblings": siblings}
            srv.routes[f"/api/models/{REPO}/revision/{revision}"] = json_route(info)
            if revision == "main":
                srv.routes[f"/api/models/{REPO}/revision/{sha}"] = json_route(info)
        yield srv, cdn


@pytest.fixture
def hub_env(monkeypatch):
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)


def test_a_hub_repo_is_fetched_at_its_commit_with_the_token(tmp_path, hub_env, monkeypatch):
    with hub() as (srv, cdn):
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        out = fetch(f"hf://{REPO}", tmp_path / "m")
    expected = _repo_files("main")
    del expected["pytorch_model.bin"]  # safetensors are there: the .bin is skipped
    assert tree(tmp_path / "m") == expected
    assert out.marker.revision == SHAS["main"] and out.marker.uri == f"hf://{REPO}@main"
    api = srv.requests[0]
    assert api.path == f"/api/models/{REPO}/revision/main" and api.query == {"blobs": ["true"]}
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in srv.requests)
    assert not any(r.path.endswith("pytorch_model.bin") for r in srv.requests)
    # The token never follows the redirect to the CDN's host.
    assert [r.path for r in cdn.requests] == [f"/{hashlib.sha256(expected['model.safetensors']).hexdigest()}"]
    assert "authorization" not in cdn.requests[0].headers
    sums = {f.path: (f.algo, f.verified) for f in out.marker.files}
    assert sums["model.safetensors"] == ("sha256", True) and sums["config.json"] == ("git-sha1", True)


def test_the_revision_is_honoured(tmp_path, hub_env, monkeypatch):
    with hub() as (srv, _):
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        out = fetch(f"hf://{REPO}@v1", tmp_path / "m", selection=Selection(includes=("*.json",)))
    assert out.marker.revision == SHAS["v1"] and out.marker.uri == f"hf://{REPO}@v1"
    assert tree(tmp_path / "m") == {k: v for k, v in _repo_files("v1").items() if k.endswith(".json")}
    assert all(f"/resolve/{SHAS['v1']}/" in r.path for r in srv.requests[1:])


@pytest.mark.parametrize(
    ("lfs", "blob", "victim"),
    [
        ({"model.safetensors": "0" * 64}, None, "model.safetensors"),
        (None, {"config.json": "1" * 40}, "config.json"),
    ],
)
def test_a_file_not_matching_the_hubs_sum_is_rejected(tmp_path, hub_env, monkeypatch, lfs, blob, victim):
    with hub(lfs, blob) as (srv, _):
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        with pytest.raises(FetchError, match=f"{victim}: .*mismatch"):
            fetch(f"hf://{REPO}", tmp_path / "m")
    assert not (tmp_path / "m" / victim).exists()
    assert not list((tmp_path / "m" / PARTIAL_DIR).rglob("*.part"))
    assert read_marker(tmp_path / "m") is None


def test_tokenizer_only_fetches_only_the_tokenizer_files(tmp_path, hub_env, monkeypatch):
    with hub() as (srv, cdn):
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        out = fetch(f"hf://{REPO}", tmp_path / "m", selection=Selection(tokenizer_only=True))
    names = {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert set(tree(tmp_path / "m")) == names and out.marker.mode == "tokenizer-only"
    assert {r.path.rsplit("/", 1)[-1] for r in srv.requests[1:]} == names
    assert cdn.requests == []


def test_the_token_file_is_used_and_a_refusal_names_the_fix(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with hub() as (srv, _):
        env = {"HF_ENDPOINT": srv.url, "HF_TOKEN": ""}
        ok = cli(
            f"hf://{REPO}", str(tmp_path / "m"), "--token-file", str(token_file), "--tokenizer-only", env=env
        )
        denied = cli(f"hf://{REPO}", str(tmp_path / "n"), "--retries", "0", env=env)
    assert ok.returncode == 0, ok.stderr
    assert denied.returncode == 1
    last = denied.stderr.strip().splitlines()[-1]
    assert "access denied (HTTP 401)" in last and "HF_TOKEN" in last


def test_too_little_disk_space_fails_before_downloading(tmp_path, hub_env, monkeypatch):
    import shutil

    from chunkwise.fetch import run

    monkeypatch.setattr(
        run.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)
    )
    with hub() as (srv, cdn):
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        with pytest.raises(FetchError, match=r"1\.00 kB free; the fetch needs 200\.13 kB more"):
            fetch(f"hf://{REPO}", tmp_path / "m")
    assert len(srv.requests) == 1 and cdn.requests == []  # the listing only
