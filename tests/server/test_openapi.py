"""/openapi.json describes what the server takes, and schemathesis, sending what that document allows (and
what it does not), finds no 5xx and no error outside OpenAI's error body. A real server on loopback."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server.harness import LiveServer, start_server

# Every generation ends within this many tokens, and a request holds at most MAX_NUM_SEQS choices and
# MAX_WAITING prompts before the rest are shed: each generated request is quick on the tiny model, even a
# batch of 256 prompts with n at its bound.
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4
MAX_WAITING = 16


@pytest.fixture(scope="module")
def bounded() -> Iterator[LiveServer]:
    server = start_server(
        {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS}, max_waiting=MAX_WAITING
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(bounded: LiveServer) -> Any:
    return schemathesis.openapi.from_url(bounded.url + "/openapi.json")


def test_the_document_names_both_generation_bodies_and_their_errors(bounded: LiveServer) -> None:
    doc = httpx.get(bounded.url + "/openapi.json", trust_env=False).json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        post = doc["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert {"400", "429", "503"} <= set(post["responses"])
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    # n is bounded by what this engine batches.
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == MAX_NUM_SEQS


def _openai_error(body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    )


def test_no_request_the_document_allows_or_not_gets_a_5xx_or_a_bare_error(api_schema: Any) -> None:
    checked: list[str] = []
    statuses: Counter[tuple[str, int]] = Counter()
    for result in api_schema.get_all_operations():
        operation = result.ok()
        checked.append(f"{operation.method.upper()} {operation.path}")
        # Positive: bodies the document allows; negative: bodies it does not (wrong types, missing fields).
        modes = [GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":  # a GET without parameters has nothing to get wrong
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
            )
            def check(case: Any) -> None:
                response = case.call(timeout=60)
                statuses[(f"{case.method} {case.path}", response.status_code)] += 1
                where = f"{case.method} {case.path} {case.body!r:.300}"
                assert response.status_code < 500, (
                    f"{response.status_code} for {where}: {response.text[:300]}"
                )
                if response.status_code >= 400:
                    assert _openai_error(response.json()), (
                        f"{response.status_code}, not OpenAI's error, for {where}"
                    )

            check()
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= set(checked)
    # Both generation routes were driven to both outcomes: served, and refused with a 4xx.
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        codes = {code for (r, code), _ in statuses.items() if r == route}
        assert 200 in codes and any(400 <= c < 500 for c in codes), (route, sorted(codes))
