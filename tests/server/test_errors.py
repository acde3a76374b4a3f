"""Every bad input is a 400 (or 404/405/413) with OpenAI's error body; user input never yields a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.harness import MAX_REQUEST_BYTES, MODEL, LiveServer


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


def completion(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **overrides}


def chat(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **overrides}


BAD_COMPLETIONS = [
    (completion(max_tokens=-1), "max_tokens"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(temperature=-0.5), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_k=-2), "top_k"),
    (completion(presence_penalty=3.0), "presence_penalty"),
    (completion(frequency_penalty=-2.5), "frequency_penalty"),
    (completion(logprobs=21), "logprobs"),
    (completion(prompt_logprobs=21), "prompt_logprobs"),
    (completion(prompt_logprobs=-1), "prompt_logprobs"),
    (completion(n=0), "n"),
    (completion(n=10**6), "n"),
    (completion(best_of=3), "best_of"),
    (completion(stop=[""]), "stop"),
    (completion(prompt=""), "prompt"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=["one", ""]), "prompt"),
    (completion(prompt=[[1, 2], []]), "prompt"),
    (completion(prompt=[[1, 2], [-1]]), "prompt"),
    (completion(prompt=["a"] * 257), "prompt"),
    (completion(prompt=[-1]), "prompt"),
    (completion(prompt=[10**9]), "prompt"),
    # Over max_model_len (512): the prompt alone, and prompt + max_tokens.
    (completion(prompt="a" * 600), "prompt"),
    (completion(prompt="a" * 400, max_tokens=200), "prompt"),
    # Wrong types: strict validation, no silent coercion, and 400 rather than FastAPI's 422.
    (completion(max_tokens="10"), "max_tokens"),
    (completion(max_tokens=True), "max_tokens"),
    (completion(max_tokens=2.5), "max_tokens"),
    (completion(temperature="hot"), "temperature"),
    (completion(prompt=5), "prompt"),
    (completion(prompt=[1, "a"]), "prompt"),
    (completion(stream="yes"), "stream"),
    (completion(stop=[1]), "stop"),
    (completion(seed="x"), "seed"),
    (completion(stream_options={"include_usage": "yes"}), "stream_options"),
    ({"model": MODEL, "max_tokens": 2}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_is_400(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    err = assert_error(http.post("/v1/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


BAD_CHATS = [
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (chat(messages=[{"content": "no role"}]), "messages"),
    (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages",
    ),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(logprobs=1), "logprobs"),
    (chat(max_completion_tokens=-3), "max_tokens"),
    # Supported since issue 21 (tests/server/test_structured.py); what is still refused:
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]), "tools"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (chat(temperature=-1), "temperature"),
    (chat(n=0), "n"),
    (chat(logit_bias={"1": 5.0}), "logit_bias"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_is_400(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", completion(model="no-such-model")), ("/v1/chat/completions", chat(model="gpt-4o"))],
)
def test_a_model_nobody_serves_is_404(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    err = assert_error(http.post(path, json=body), 404, "model")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize(
    "raw",
    [b"{", b"not json", b'{"model": "tiny", "prompt": "hi",}', b"[1, 2, 3]", b'"a string"', b"null", b""],
)
def test_malformed_json_is_400(http: httpx.Client, raw: bytes) -> None:
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_unknown_route_is_404(http: httpx.Client) -> None:
    err = assert_error(http.get("/v1/nothing-here"), 404)
    assert err["type"] == "not_found_error"
    assert_error(http.post("/v2/completions", json=completion()), 404)


def test_wrong_method_is_405(http: httpx.Client) -> None:
    assert_error(http.get("/v1/completions"), 405)


def test_oversized_body_is_413(http: httpx.Client) -> None:
    big = completion(prompt="a" * (MAX_REQUEST_BYTES + 1))
    err = assert_error(http.post("/v1/completions", json=big), 413)
    assert err["code"] == "request_too_large"

    # A chunked body has no Content-Length: refused once it passes the limit.
    def chunks() -> Iterator[bytes]:
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413)


def test_body_under_the_limit_is_accepted(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=completion(prompt="a" * 100, user="x" * (MAX_REQUEST_BYTES // 2)))
    assert r.status_code == 200, r.text


# Odd values for every field: each answer is a 200 or a 400, never a 5xx.
FUZZ_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    1,
    2**70,
    -(2**70),
    0.5,
    float("1e308"),
    "",
    "x",
    [],
    [None],
    {},
    {"a": 1},
]
FUZZ_FIELDS = [
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "logprobs",
    "presence_penalty",
    "stop_token_ids",
    "n",
    "stream_options",
]


@pytest.mark.parametrize("field", FUZZ_FIELDS)
def test_user_input_never_yields_5xx(http: httpx.Client, field: str) -> None:
    for value in FUZZ_VALUES:
        r = http.post("/v1/completions", json=completion(**{field: value}))
        assert r.status_code in (200, 400), (field, value, r.status_code, r.text)
        if r.status_code == 400:
            assert_error(r, 400)
    for value in FUZZ_VALUES:
        body = chat(**{"messages": value} if field == "prompt" else {field: value})
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code in (200, 400), (field, value, r.status_code, r.text)


def test_health(http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_json_body_is_accepted_whatever_its_content_type(http: httpx.Client) -> None:
    # `curl -d` sends application/x-www-form-urlencoded.
    raw = json.dumps(completion()).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        r = http.post("/v1/completions", content=raw, headers={"content-type": content_type})
        assert r.status_code == 200, r.text
