"""server/tools.py: tool calls read from a model's text (tool_choice "auto": Hermes and Llama-3 styles;
named; required) and a streamed answer split into content shown now and calls delivered at the end."""

from __future__ import annotations

import json

import pytest

from chunkwise.server.tools import ToolParsing, held_from, parse_tool_calls, required_spec

NAMES = frozenset({"get_weather", "add"})


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_with_content_before_them() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == 2


def test_hermes_alone_unclosed_and_arguments_as_text() -> None:
    content, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}', NAMES)
    assert content is None and _calls(calls) == [("add", {"a": 5})]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '  <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
    ],
)
def test_llama3_json_call(text: str) -> None:
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]


def test_llama3_several_calls_joined_by_semicolons_or_a_list() -> None:
    a = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    b = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    for text in (f"{a}; {b}", f"[{a}, {b}]"):
        _, calls = parse_tool_calls(text, NAMES)
        assert _calls(calls) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "unknown_tool", "parameters": {}}',  # not one of the tools
        '{"city": "Paris"}',  # JSON, but not a call
        '{"name": "add", "parameters": [1, 2]}',  # arguments that are not an object
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # broken JSON
        '{"name": "add", "parameters": {"a": 1}} trailing',
    ],
)
def test_text_that_is_not_a_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_named_and_required_extraction() -> None:
    named = ToolParsing("named", NAMES, "add")
    content, calls = named.extract('{"a": 1, "b": 2}')
    assert content is None and _calls(calls) == [("add", {"a": 1, "b": 2})]
    assert named.extract("not json") == ("not json", [])
    required = ToolParsing("required", NAMES)
    _, calls = required.extract('[{"name": "add", "parameters": {"a": 3}}]')
    assert _calls(calls) == [("add", {"a": 3})]
    assert required.extract("[]") == ("[]", [])


def test_required_spec_is_a_list_of_calls_of_the_tools() -> None:
    import jsonschema

    schema = required_spec([("add", {"type": "object", "properties": {"a": {"type": "integer"}}})]).schema()
    jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "add", "parameters": {"a": "x"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_held_back_text_in_auto_mode() -> None:
    assert held_from("Hello there", "auto") == len("Hello there")
    assert held_from("Hello <tool", "auto") == len("Hello ")  # may become <tool_call>
    assert held_from("Hello <tool_call>{", "auto") == len("Hello ")
    assert held_from('  {"name"', "auto") == 2  # a Llama-3 call opens the answer
    assert held_from("<|pyth", "auto") == 0
    assert held_from("anything", "named") == 0


def test_a_streamed_auto_answer_shows_content_then_delivers_the_call() -> None:
    stream = ToolParsing("auto", NAMES).stream()
    pieces = ["Sure", ", checking. <to", 'ol_call>{"name": "add", ', '"arguments": {"a": 2}}</tool_call>']
    shown = "".join(stream.feed(p) for p in pieces)
    assert shown == "Sure, checking. "
    rest, calls = stream.finish(complete=True)
    assert rest == "" and _calls(calls) == [("add", {"a": 2})]


def test_a_streamed_answer_that_is_no_call_is_all_shown() -> None:
    stream = ToolParsing("auto", NAMES).stream()
    shown = stream.feed("I think <tool") + stream.feed(" is a word")
    rest, calls = stream.finish(complete=True)
    assert shown + rest == "I think <tool is a word" and calls == []
    # Cut short (finish_reason "length"): no calls, the held text is shown.
    stream = ToolParsing("auto", NAMES).stream()
    assert stream.feed('{"name": "add", "arguments": {"a"') == ""
    assert stream.finish(complete=False) == ('{"name": "add", "arguments": {"a"', [])


# -- the chat formatter's shapes --------------------------------------------------------------------------------
def _formatter(mode: str = "auto", name: str | None = None, stream: bool = False, n: int = 1):  # type: ignore[no-untyped-def]
    from chunkwise.server.formatters import ChatFormatter, ChatOptions, Prompt, ResponseHead

    head = ResponseHead(id="x", created=1, model="m", prompts=(Prompt([1], "p"),), n=n)
    opts = ChatOptions(stream=stream, tools=ToolParsing(mode, NAMES, name))  # type: ignore[arg-type]
    return ChatFormatter(head, opts, str)


def _delta(text: str, finish_reason: str | None = None, index: int = 0):  # type: ignore[no-untyped-def]
    from chunkwise.engine.datatypes.outputs import CompletionOutput

    return CompletionOutput(index=index, text=text, token_ids=[0], finish_reason=finish_reason)


def _answer(fmt, text: str, finish_reason: str):  # type: ignore[no-untyped-def]
    from chunkwise.server.formatters import CollectedResponse, Usage

    result = CollectedResponse(fmt.head)
    result.choices[0].text = text
    result.choices[0].finish_reason = finish_reason
    return fmt.answer(result, Usage(1, 1, 0))["choices"][0]


def test_answer_with_tool_calls_has_null_content_and_finish_reason_tool_calls() -> None:
    fmt = _formatter()
    choice = _answer(fmt, '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "stop")
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    # Cut short by max_tokens: no call is made of it.
    choice = _answer(fmt, '<tool_call>{"name": "add"', "length")
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]


def test_streamed_chunks_hold_the_call_and_deliver_it_with_an_index() -> None:
    fmt = _formatter(stream=True)
    a = fmt.chunk(0, _delta("Ok. "))
    b = fmt.chunk(0, _delta('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'))
    c = fmt.chunk(0, _delta("", "stop"))
    assert a["choices"][0]["delta"] == {"content": "Ok. "}
    assert b["choices"][0]["delta"] == {}
    last = c["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "add", "arguments": '{"a": 1}'}


def test_named_streams_no_content() -> None:
    fmt = _formatter("named", "add", stream=True)
    assert fmt.chunk(0, _delta('{"a": '))["choices"][0]["delta"] == {}
    last = fmt.chunk(0, _delta("7}", "stop"))["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 7}'}


def test_each_choice_has_its_own_tool_stream() -> None:
    fmt = _formatter("named", "add", stream=True, n=2)
    fmt.chunk(0, _delta('{"a": 1', index=0))
    fmt.chunk(0, _delta('{"a": 2', index=1))
    first = fmt.chunk(0, _delta("}", "stop", index=0))["choices"][0]
    second = fmt.chunk(0, _delta("}", "stop", index=1))["choices"][0]
    assert first["index"] == 0 and first["delta"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert second["index"] == 1 and second["delta"]["tool_calls"][0]["function"]["arguments"] == '{"a": 2}'
