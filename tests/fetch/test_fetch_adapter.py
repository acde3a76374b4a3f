"""`chunkwise fetch-model` with LoRA adapters (issue 34): a PEFT directory (adapter_config.json and
adapter_model.safetensors) instead of a model's config.json, from a Hub-style server and from an archive on
loopback; and a fetch that finds neither is refused, naming what it found."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from chunkwise.fetch.errors import FetchError, UsageError
from chunkwise.fetch.select import Selection
from chunkwise.fetch.state import MARKER_NAME
from tests.fetch.fetch_servers import Loopback, cli, fetch, json_route, model_files, serving, tar_gz, tree

REPO = "org/sql-lora"
SHA = "c" * 40


def adapter_files(rank: int = 8) -> dict[str, bytes]:
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    return {
        "adapter_config.json": json.dumps(config).encode(),
        "adapter_model.safetensors": random.Random(rank).randbytes(20_000),
        "README.md": b"# sql-lora\n",
    }


def hub(files: dict[str, bytes]) -> Loopback:
    """A Hub-style server holding one repo at one commit (every file outside LFS, checked by its blob id)."""
    srv = Loopback()
    siblings = []
    for name, data in files.items():
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        siblings.append({"rfilename": name, "size": len(data), "blobId": blob})
        srv.files[f"/{REPO}/resolve/{SHA}/{name}"] = data
    srv.routes[f"/api/models/{REPO}/revision/main"] = json_route(
        {"id": REPO, "sha": SHA, "siblings": siblings}
    )
    return srv


@pytest.fixture
def no_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


@pytest.mark.parametrize("adapter", [True, False], ids=["--adapter", "recognised"])
def test_a_hub_adapter_is_fetched_whole(tmp_path, no_token, monkeypatch, adapter):
    with serving(hub(adapter_files())) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        out = fetch(f"hf://{REPO}", tmp_path / "sql", adapter=adapter)
    assert tree(tmp_path / "sql") == adapter_files()
    assert out.marker.mode == "full" and out.marker.revision == SHA


def test_an_adapter_archive_is_recognised_by_its_config(tmp_path, caplog):
    caplog.set_level("INFO", logger="chunkwise.fetch")
    with serving(Loopback(files={"/a/sql.tgz": tar_gz(adapter_files(), top="sql-lora")})) as srv:
        fetch(f"{srv.url}/a/sql.tgz", tmp_path / "sql")
    assert tree(tmp_path / "sql") == adapter_files()
    assert any("(a LoRA adapter)" in r.getMessage() for r in caplog.records)


def test_neither_a_model_nor_an_adapter_is_refused_before_any_download(tmp_path, no_token, monkeypatch):
    files = {"weights.safetensors": b"x" * 100, "notes.txt": b"n"}
    with serving(hub(files)) as srv, pytest.raises(FetchError) as e:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        fetch(f"hf://{REPO}", tmp_path / "m")
    message = str(e.value)
    assert "neither config.json (a model) nor adapter_config.json (a PEFT LoRA adapter)" in message
    assert "notes.txt, weights.safetensors" in message
    assert [r.path for r in srv.requests] == [f"/api/models/{REPO}/revision/main"]  # only the listing
    assert not (tmp_path / "m" / MARKER_NAME).exists()


def test_an_archive_of_neither_leaves_no_file_behind(tmp_path):
    archive = tar_gz({"weights.bin": b"w", "a/config.json": b"{}"})
    with (
        serving(Loopback(files={"/x.tgz": archive})) as srv,
        pytest.raises(FetchError, match=r"holds neither config\.json"),
    ):
        fetch(f"{srv.url}/x.tgz", tmp_path / "m")
    assert tree(tmp_path / "m") == {}  # a/config.json is not at the top: the loader would not find it
    assert not (tmp_path / "m" / MARKER_NAME).exists()


def test_adapter_refuses_a_model_and_a_pickled_adapter(tmp_path, no_token, monkeypatch):
    with serving(hub(model_files())) as srv, pytest.raises(FetchError) as e:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        fetch(f"hf://{REPO}", tmp_path / "a", adapter=True)
    assert "is not a PEFT LoRA adapter: it has no adapter_config.json" in str(e.value)
    assert "looks like a model" in str(e.value)
    pickled = {**adapter_files(), "adapter_model.bin": b"pickle"}
    del pickled["adapter_model.safetensors"]
    with serving(hub(pickled)) as srv, pytest.raises(FetchError) as e:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        fetch(f"hf://{REPO}", tmp_path / "b")
    assert "without adapter_model.safetensors" in str(e.value) and "adapter_model.bin" in str(e.value)


def test_a_model_is_still_a_model_without_the_flag(tmp_path, no_token, monkeypatch):
    # A model repo that also carries an adapter_config.json (a merged fine-tune's leftovers) stays a model.
    with serving(hub({**model_files(), "adapter_config.json": b"{}"})) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        fetch(f"hf://{REPO}", tmp_path / "m")
    assert "config.json" in tree(tmp_path / "m")


def test_the_command_exits_1_naming_the_problem_and_2_on_a_flag_clash(tmp_path, no_token):
    with serving(Loopback(files={"/m.tgz": tar_gz(model_files())})) as srv:
        out = cli(f"{srv.url}/m.tgz", str(tmp_path / "a"), "--adapter")
    assert out.returncode == 1
    assert "is not a PEFT LoRA adapter" in out.stderr.strip().splitlines()[-1]
    clash = cli("hf://org/a", str(tmp_path / "b"), "--adapter", "--tokenizer-only")
    assert clash.returncode == 2 and "--adapter fetches the whole adapter" in clash.stderr
    with pytest.raises(UsageError):
        fetch("hf://org/a", tmp_path / "c", adapter=True, selection=Selection(includes=("*.json",)))
