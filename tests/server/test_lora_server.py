"""`chunkwise serve --enable-lora` as a real process, driven by the official openai client: adapters are models
(listed with their parent), a request naming one gets the PEFT-merged model's greedy tokens, an unknown model
is a 404; with --allow-runtime-lora adapters are loaded and unloaded while serving (a repeat is a 409, a bad
path a 400 naming it, an unloaded one a 404); without the flag the endpoints answer 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.hf_models import peft_merged_greedy, save_random_family, save_random_lora
from tests.server.test_tensor_parallel_server import Served, _start

PROMPTS = [[5, 17, 93, 41, 8, 77, 120, 3], [44, 12, 150, 7, 66, 81, 19]]
MAX_NEW = [8, 7]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, dict[str, Path]]]:
    tmp = tmp_path_factory.mktemp("lora-serve")
    base = save_random_family(tmp, "llama3-rope", seed=7)
    paths = {
        "base": base,
        "tmp": tmp,
        "sql": save_random_lora(base, tmp / "sql", r=4, targets=["q_proj", "o_proj"], seed=1),
        "chat": save_random_lora(
            base, tmp / "chat", r=8, targets=["gate_proj", "up_proj", "down_proj"], seed=2
        ),
    }
    flags = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--allow-runtime-lora"]
    flags += ["--lora-cache-dir", str(tmp / "fetched")]
    s = _start(str(base), tmp / "serve.log", *flags, "--lora-modules", f"sql={paths['sql']}", parallel=())
    try:
        assert s.proc.poll() is None, s.output()
        yield s, paths
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.proc.wait(15)


def _greedy(client: openai.OpenAI, model: str) -> list[list[int]]:
    out = []
    for prompt, n in zip(PROMPTS, MAX_NEW):
        r = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=n,
            temperature=0.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert r.model == model
        out.append(r.model_dump()["choices"][0]["token_ids"])
    return out


def test_adapters_are_models_run_by_name(served: tuple[Served, dict[str, Path]]) -> None:
    s, paths = served
    client = s.client()
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {s.model, "sql"}
    assert cards["sql"]["parent"] == s.model and cards["sql"]["root"] == str(paths["sql"])
    merged = peft_merged_greedy(paths["base"], paths["sql"], PROMPTS, MAX_NEW, paths["tmp"])
    base = peft_merged_greedy(paths["base"], None, PROMPTS, MAX_NEW, paths["tmp"])
    assert merged != base  # the adapter changes the tokens: serving the base model instead would fail
    assert _greedy(client, "sql") == merged
    assert _greedy(client, s.model) == base
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="chat", prompt=[5], max_tokens=1)
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_the_lora_info_metric_names_the_running_adapters(served: tuple[Served, dict[str, Path]]) -> None:
    s, _ = served
    stream = s.client().completions.create(
        model="sql", prompt=PROMPTS[0], max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # running now
    text = httpx.get(f"{s.url}/metrics", trust_env=False).text
    stream.close()
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'running_lora_adapters="sql"' in line and 'max_lora="2"' in line, line
    # What a router reads of it: the base model, the adapters served, the one on the device, its fill's time.
    from chunkwise.router.estimates import parse_metrics

    # Each adapter's finished requests (the earlier tests' greedy runs of sql finished two).
    assert 'chunkwise:lora_requests_total{lora_name="sql",model_name=' in text
    sample = parse_metrics(text, now=0.0)
    assert sample.model_name == s.model
    assert "sql" in sample.lora_adapters and "sql" in sample.lora_resident
    assert sample.lora_loads >= 1 and sample.lora_load_seconds > 0


def test_adapters_load_and_unload_while_serving(served: tuple[Served, dict[str, Path]]) -> None:
    s, paths = served
    client = s.client()

    def post(path: str, body: dict[str, str]) -> httpx.Response:
        return httpx.post(f"{s.url}{path}", json=body, timeout=30, trust_env=False)

    r = post("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["chat"])})
    assert r.status_code == 200, r.text
    assert "chat" in {m.id for m in client.models.list().data}
    assert _greedy(client, "chat") == peft_merged_greedy(
        paths["base"], paths["chat"], PROMPTS, MAX_NEW, paths["tmp"]
    )
    r = post("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["chat"])})
    assert r.status_code == 409 and r.json()["error"]["param"] == "lora_name"
    r = post("/v1/load_lora_adapter", {"lora_name": "nowhere", "lora_path": str(paths["tmp"] / "missing")})
    assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"

    assert post("/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt=[5], max_tokens=1)
    assert post("/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 404
    # Loaded again under its name from another directory (the operator's changed URI): the new weights.
    r = post("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["sql"])})
    assert r.status_code == 200, r.text
    assert (
        _greedy(client, "chat")[0]
        == peft_merged_greedy(paths["base"], paths["sql"], PROMPTS[:1], MAX_NEW[:1], paths["tmp"])[0]
    )
    assert post("/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    # And back under its first name and path: served again, its first tokens.
    assert (
        post("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["chat"])}).status_code
        == 200
    )
    assert (
        _greedy(client, "chat")[0]
        == peft_merged_greedy(paths["base"], paths["chat"], PROMPTS[:1], MAX_NEW[:1], paths["tmp"])[0]
    )


def test_an_adapter_given_as_a_uri_is_fetched_and_reported_as_given(
    served: tuple[Served, dict[str, Path]],
) -> None:
    from tests.fetch.fetch_servers import Loopback, serving, tar_gz, tree

    s, paths = served
    archive = tar_gz(tree(paths["chat"]), top="chat-lora")
    with serving(Loopback(files={"/a/chat.tgz": archive})) as srv:
        uri = f"{srv.url}/a/chat.tgz"
        r = httpx.post(
            f"{s.url}/v1/load_lora_adapter",
            json={"lora_name": "fetched", "lora_path": uri},
            timeout=60,
            trust_env=False,
        )
        assert r.status_code == 200, r.text
        bad = httpx.post(
            f"{s.url}/v1/load_lora_adapter",
            json={"lora_name": "missing", "lora_path": f"{srv.url}/a/none.tgz"},
            timeout=60,
            trust_env=False,
        )
    assert bad.status_code == 400 and "could not be fetched" in bad.json()["error"]["message"]
    client = s.client()
    card = next(m.model_dump() for m in client.models.list().data if m.id == "fetched")
    assert card["root"] == uri  # as given: the operator compares it with its spec's URI
    assert (
        _greedy(client, "fetched")[0]
        == peft_merged_greedy(paths["base"], paths["chat"], PROMPTS[:1], MAX_NEW[:1], paths["tmp"])[0]
    )


def test_runtime_loading_is_off_without_its_flag() -> None:
    from fastapi.testclient import TestClient

    from chunkwise.server.app import build_app

    client = TestClient(build_app(None, served_model_name="m"))
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert r.status_code == 404 and "--allow-runtime-lora" in r.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


def test_lora_flags_without_enable_lora_are_refused(tmp_path: Path) -> None:
    s = _start("tiny", tmp_path / "serve.log", "--lora-modules", "a=/tmp", parallel=())
    assert s.proc.wait(60) == 2
    assert "--lora-modules and --allow-runtime-lora need --enable-lora" in s.output()
