"""Serving real checkpoint directories with the official client: one with a byte-fallback BPE tokenizer and a
Llama-3-style chat template, and one with no tokenizer at all (token ids in and out)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from chunkwise.engine.tokenizer import HFTokenizer
from tests.hf_models import save_byte_fallback_tokenizer
from tests.server.harness import LiveServer, start_server


def _random_llama(path: Path, vocab_size: int, eos: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=eos,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bpe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, HFTokenizer]]:
    path = tmp_path_factory.mktemp("bpe")
    vocab = save_byte_fallback_tokenizer(path)
    tok = HFTokenizer.from_dir(path)
    _random_llama(path, vocab, tok.eos_token_ids[0])
    server = start_server(model=str(path))
    yield server, tok
    server.stop()


@pytest.fixture(scope="module")
def ids_only_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = _random_llama(tmp_path_factory.mktemp("ids"), 320, 2)
    assert not (path / "tokenizer.json").exists()
    server = start_server(model=str(path))
    yield server
    server.stop()


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_chat_renders_the_checkpoint_template_and_streams_the_decode(bpe_server) -> None:
    server, tok = bpe_server
    messages = [{"role": "user", "content": "Say 中文 and 🙂, please"}]
    chunks = list(
        _client(server).chat.completions.create(
            model=server.engine.core.config.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=40,
            temperature=0.0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    )
    first = chunks[0].model_dump()
    # The template's special tokens became their ids (not text), after the tokenizer's BOS.
    prompt_ids = first["prompt_token_ids"]
    header = tok.encode("<|start_header_id|>", add_special_tokens=False)
    assert len(header) == 1 and header[0] in prompt_ids and prompt_ids.count(header[0]) == 2
    assert prompt_ids[0] == tok.bos_token_id and prompt_ids.count(tok.bos_token_id) == 1
    ids = [t for c in chunks[1:] for t in (c.model_dump()["choices"][0].get("token_ids") or [])]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(ids) == 40
    assert text == tok.decode(ids)


def test_completion_streams_a_chunk_per_token(bpe_server) -> None:
    server, tok = bpe_server
    chunks = [
        c.model_dump()
        for c in _client(server).completions.create(
            model=server.engine.core.config.model,
            prompt="naïve café 👩‍👩‍👧 中文",
            max_tokens=24,
            temperature=0.0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    ]
    # One chunk for each step's token, whether or not it completed any text yet.
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1] * 24
    ids = [c["choices"][0]["token_ids"][0] for c in chunks]
    assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(ids)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tok.encode("naïve café 👩‍👩‍👧 中文")


def test_a_checkpoint_without_tokenizer_serves_token_ids(ids_only_server) -> None:
    server = ids_only_server
    client = _client(server)
    model = server.engine.core.config.model
    chunks = [
        c.model_dump()
        for c in client.completions.create(
            model=model,
            prompt=[5, 6, 7, 8],
            max_tokens=6,
            temperature=0.0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    ]
    assert len(chunks) == 6 and all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks)
    assert all(c["choices"][0]["text"] == "" for c in chunks)
    whole = client.completions.create(
        model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.0, extra_body={"return_token_ids": True}
    ).model_dump()
    assert whole["choices"][0]["token_ids"] == [c["choices"][0]["token_ids"][0] for c in chunks]
    assert whole["choices"][0]["prompt_token_ids"] == [5, 6, 7, 8]
    # Text in needs a tokenizer: a clear 400, in OpenAI's error body.
    r = httpx.post(
        f"{server.base_url}/completions", json={"model": model, "prompt": "hello", "max_tokens": 2}
    )
    assert r.status_code == 400
    assert "no tokenizer" in r.json()["error"]["message"] and "token ids" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.base_url}/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 400 and "no tokenizer" in json.dumps(r.json())


# ---------------------------------------------------------------- the bundled trained model (pylm)


@pytest.fixture(scope="module")
def pylm_server() -> Iterator[tuple[LiveServer, HFTokenizer]]:
    """`make serve`'s default: the bundled checkpoint, by name, through the HF-directory loader."""
    from chunkwise.engine.model.bundled import bundled_path

    path = bundled_path("pylm")
    assert path is not None, "the bundled pylm checkpoint is missing from the package"
    from chunkwise.engine.model.loader import read_checkpoint

    _, tok = read_checkpoint(path)  # with config.json's EOS ids, as the engine reads it
    assert isinstance(tok, HFTokenizer)
    server = start_server(model="pylm")
    yield server, tok
    server.stop()


def test_pylm_chat_renders_its_template_streams_the_decode_and_ends_by_eos(pylm_server) -> None:
    server, tok = pylm_server
    messages = [{"role": "user", "content": "Hello!"}]
    chunks = list(
        _client(server).chat.completions.create(
            model="pylm",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0.0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    prompt_ids = chunks[0].model_dump()["prompt_token_ids"]
    # The template's role and end-of-turn markers are single special ids, after one BOS.
    user, end, assistant = (
        tok.encode(t, add_special_tokens=False) for t in ("<|user|>", "<|end|>", "<|assistant|>")
    )
    assert len(user) == len(end) == len(assistant) == 1
    assert prompt_ids[0] == tok.bos_token_id and prompt_ids.count(tok.bos_token_id) == 1
    assert (
        prompt_ids[1] == user[0]
        and end[0] in prompt_ids
        and prompt_ids[-2:] == [assistant[0], tok.encode("\n", add_special_tokens=False)[0]]
    )
    ids = [t for c in chunks[1:] for t in (c.model_dump()["choices"][0].get("token_ids") or [])]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(ids)
    # The model learned to answer with a function and to end its turn: generation stops by EOS.
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"] and ids[-1] in tok.eos_token_ids and len(ids) < 200
    assert text.startswith("def ") and "(" in text


def test_pylm_completion_streams_code_a_chunk_per_token(pylm_server) -> None:
    server, tok = pylm_server
    prompt = "class Queue:\n    def __init__(self"
    chunks = [
        c.model_dump()
        for c in _client(server).completions.create(
            model="pylm",
            prompt=prompt,
            max_tokens=48,
            temperature=0.0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    ]
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1] * 48
    ids = [c["choices"][0]["token_ids"][0] for c in chunks]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == tok.decode(ids)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tok.encode(prompt)
    # Readable Python, not noise: the signature closes, then an indented body.
    assert "):\n        " in text and "self." in text and "\ufffd" not in text


def test_pylm_streams_unicode_and_sampled_text_as_the_full_decode(pylm_server) -> None:
    """Byte-level BPE splits what the stdlib rarely holds (CJK, emoji) into byte pieces: streamed at
    temperature 1, every chunk is whole characters and all of them joined is the full decode."""
    server, tok = pylm_server
    for seed in range(3):
        chunks = [
            c.model_dump()
            for c in _client(server).completions.create(
                model="pylm",
                prompt="# naïve café 👩‍👩‍👧 中文\ns = '",
                max_tokens=40,
                temperature=1.0,
                seed=seed,
                stream=True,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
        ]
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(ids)
