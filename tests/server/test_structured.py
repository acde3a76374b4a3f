"""Structured outputs and tool calls through the official openai client against a real server on loopback:
the tiny model (random weights, byte tokenizer) and the bundled trained pylm (BPE tokenizer). Whatever the
weights, a constrained answer parses and validates against its schema."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.harness import MODEL, LiveServer, start_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "owner": {
            "type": "object",
            "properties": {"email": {"type": "string", "maxLength": 16}, "active": {"type": "boolean"}},
            "required": ["email", "active"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 4},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "owner", "tags"],
    "additionalProperties": False,
}
LIST = {
    "type": "array",
    "items": {"type": "integer", "minimum": -50, "maximum": 50},
    "minItems": 2,
    "maxItems": 5,
}
SCHEMAS = {"person": PERSON, "nested": NESTED, "list": LIST}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Any] = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pylm() -> Iterator[LiveServer]:
    server = start_server(model="pylm", engine_kwargs={"max_model_len": 1024, "num_blocks": 256})
    yield server
    server.stop()


@pytest.fixture(params=["tiny", "pylm"])
def server(request: pytest.FixtureRequest, live: LiveServer) -> LiveServer:
    return live if request.param == "tiny" else request.getfixturevalue("pylm")


def _model(server: LiveServer) -> str:
    return server.engine.model_info.model


def _chat(server: LiveServer, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", [{"role": "user", "content": "Give me the data as JSON."}])
    kwargs.setdefault("max_tokens", 300)
    return _client(server).chat.completions.create(model=_model(server), **kwargs)


# -- response_format -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_parse_and_validate(server: LiveServer, name: str, temperature: float) -> None:
    schema = SCHEMAS[name]
    r = _chat(
        server,
        temperature=temperature,
        seed=7,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content)
    jsonschema.validate(value, schema)
    if name == "person":  # written in the schema's order of properties, as OpenAI's are
        assert list(value) == list(PERSON["properties"])


def test_json_object_is_an_object(server: LiveServer) -> None:
    r = _chat(server, temperature=0.0, response_format={"type": "json_object"}, max_tokens=400)
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # a free-form object may outrun max_tokens; what came is still an object's beginning
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_json_schema_streamed_joins_to_a_valid_answer(server: LiveServer) -> None:
    chunks = list(
        _chat(
            server,
            temperature=1.0,
            seed=3,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(live: LiveServer) -> None:
    """A constrained request in the batch leaves a greedy unconstrained one's tokens as they were alone."""
    client = _client(live)
    alone = client.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0).choices[0].text
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [
            pool.submit(
                client.completions.create,
                model=MODEL,
                prompt="abc",
                max_tokens=60,
                temperature=1.0,
                extra_body={"structured_outputs": {"json": PERSON}},
            )
            for _ in range(3)
        ]
        plain = pool.submit(
            client.completions.create, model=MODEL, prompt="abc", max_tokens=24, temperature=0
        )
        assert plain.result().choices[0].text == alone
        for f in constrained:
            c = f.result().choices[0]
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), PERSON)


# -- vLLM's structured_outputs ------------------------------------------------------------------------------
def test_regex_on_both_endpoints(server: LiveServer) -> None:
    pattern = r"[A-Z][a-z]{2,6}-\d{3}"
    r = _client(server).completions.create(
        model=_model(server),
        prompt="Code:",
        max_tokens=40,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    c = _chat(server, temperature=0.0, extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, c.choices[0].message.content)


def test_choice(server: LiveServer) -> None:
    options = ["positive", "negative", 'it\'s "neutral"']
    for seed in range(3):
        r = _chat(server, temperature=1.0, seed=seed, extra_body={"structured_outputs": {"choice": options}})
        assert r.choices[0].message.content in options
        assert r.choices[0].finish_reason == "stop"


def test_lark_grammar(live: LiveServer) -> None:
    grammar = 'start: "(" expr ")"\nexpr: NUM (("+" | "*") NUM)*\nNUM: /[0-9]{1,3}/\n'
    r = _client(live).completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=60,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\(\d{1,3}(?:[+*]\d{1,3})*\)", text), text
    else:
        assert re.fullmatch(r"\(\d{1,3}(?:[+*]\d{1,3})*[+*]?\d{0,3}", text), text


def test_json_via_structured_outputs_streamed_on_completions(live: LiveServer) -> None:
    chunks = list(
        _client(live).completions.create(
            model=MODEL,
            prompt="{",
            max_tokens=200,
            temperature=0.0,
            stream=True,
            extra_body={"structured_outputs": {"json": LIST}},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), LIST)


# -- tools ----------------------------------------------------------------------------------------------------
def test_named_tool_choice_gives_a_call_with_valid_arguments(server: LiveServer) -> None:
    r = _chat(
        server,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=11,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])


def test_required_tool_choice_gives_calls_of_known_tools(server: LiveServer) -> None:
    for seed in range(2):
        r = _chat(server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=400)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_named_tool_choice_streamed_as_tool_call_deltas(server: LiveServer) -> None:
    chunks = list(
        _chat(
            server,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}},
            temperature=0.0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "add"
    assert calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS["add"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_and_auto_answer_with_content(live: LiveServer) -> None:
    for choice in ("none", "auto"):
        r = _chat(live, tools=TOOLS, tool_choice=choice, max_tokens=10, temperature=0.0)
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "length"


HERMES_CALL = r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
LLAMA_CALL = r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_and_llama3_calls(live: LiveServer, stream: bool) -> None:
    """The model's text is forced (structured_outputs regex) to each style of call; tool_choice "auto" reads
    it back as tool_calls, the Hermes call's leading text as content."""
    for pattern, name, content in ((HERMES_CALL, "add", "Sure."), (LLAMA_CALL, "get_weather", None)):
        kwargs: dict[str, Any] = {
            "tools": TOOLS,
            "tool_choice": "auto",
            "temperature": 1.0,
            "seed": 4,
            "extra_body": {"structured_outputs": {"regex": pattern}},
        }
        if not stream:
            choice = _chat(live, **kwargs).choices[0]
            got_content, calls = choice.message.content, choice.message.tool_calls
            finish = choice.finish_reason
        else:
            chunks = [c for c in _chat(live, stream=True, **kwargs) if c.choices]
            got_content = "".join(c.choices[0].delta.content or "" for c in chunks) or None
            calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
            assert all(tc.index == 0 for tc in calls)
            finish = chunks[-1].choices[0].finish_reason
        assert finish == "tool_calls"
        assert (got_content or "").strip() == (content or "")
        (call,) = calls
        assert call.function.name == name and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[name])


def test_the_published_schema_has_the_new_fields(live: LiveServer) -> None:
    doc = httpx.get(live.url + "/openapi.json", trust_env=False).json()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "response_format", "structured_outputs"} <= set(chat)
    assert "structured_outputs" in schemas["CompletionRequest"]["properties"]
    assert {"json", "regex", "choice", "grammar"} <= set(schemas["StructuredOutputsParams"]["properties"])
    assert "schema" in schemas["JsonSchemaFormat"]["properties"]
    assert schemas["Tool"]["required"] == ["type", "function"]


def test_tools_reach_the_chat_template() -> None:
    """A template that renders `tools` (as HF passes them) sees their definitions."""
    from chunkwise.server.chat import ChatMessage, render_chat

    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    text = render_chat([ChatMessage("user", "hi")], template, tools=TOOLS)
    assert text == "[get_weather][add]hi"


# -- refusals ---------------------------------------------------------------------------------------------------
def _post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=30, trust_env=False)


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(ab"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"structured_outputs": {"json": 3}}, "structured_outputs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
            "tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_structured_requests_are_400s_naming_the_param(
    live: LiveServer, body: dict[str, Any], param: str
) -> None:
    r = _post(live, "/chat/completions", {"messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_bad_structured_outputs_on_completions_is_a_400(live: LiveServer) -> None:
    r = _post(live, "/completions", {"prompt": "x", "structured_outputs": {"json": {"type": 5}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


def test_a_model_without_a_tokenizer_refuses_structured_outputs() -> None:
    from chunkwise.engine.datatypes.structured_output import StructuredOutput
    from chunkwise.engine.sampling.structured.compiler import GrammarCompiler, StructuredOutputUnavailable
    from chunkwise.engine.tokenizer import NoTokenizer

    compiler = GrammarCompiler(NoTokenizer(100, None, [1]), 100, [1])
    with pytest.raises(StructuredOutputUnavailable, match="not available"):
        compiler.check(StructuredOutput.json_object())
    with pytest.raises(StructuredOutputUnavailable, match="EOS"):
        GrammarCompiler(NoTokenizer(100, None, []), 100, []).check(StructuredOutput.json_object())


def test_a_batch_of_prompts_is_constrained_prompt_by_prompt(live: LiveServer) -> None:
    r = _client(live).completions.create(
        model=MODEL,
        prompt=["one", "two", "three"],
        max_tokens=40,
        temperature=1.0,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in r.choices)


def test_n_choices_each_follow_the_schema_and_each_make_their_call(live: LiveServer) -> None:
    r = _chat(
        live,
        n=3,
        temperature=1.0,
        seed=9,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    values = [json.loads(c.message.content) for c in r.choices]
    for v in values:
        jsonschema.validate(v, PERSON)
    assert len({json.dumps(v) for v in values}) > 1
    chunks = [
        c
        for c in _chat(
            live,
            n=2,
            stream=True,
            temperature=1.0,
            seed=3,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}},
        )
        if c.choices
    ]
    calls = {c.choices[0].index: tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])}
    assert sorted(calls) == [0, 1]
    for tc in calls.values():
        assert tc.function.name == "add"
        jsonschema.validate(json.loads(tc.function.arguments), PARAMS["add"])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["tool_calls", "tool_calls"]
