"""Tool calls in chat: what `tools` and `tool_choice` make of a request, and how an answer's text becomes
OpenAI's `tool_calls`.

- named (`{"type": "function", "function": {"name": ...}}`): the output is constrained to the function's
  parameters schema; the whole output is that one call's arguments (as vLLM does).
- required: the output is constrained to a JSON list of one or more `{"name": ..., "parameters": {...}}`,
  one alternative (anyOf) per tool.
- auto: unconstrained; the text is parsed for Hermes-style `<tool_call>{"name", "arguments"}</tool_call>`
  blocks or a Llama-3-style JSON call `{"name", "parameters"}` (several may be joined by ";").
- none: no parsing, the text is the content.

`ToolStream` turns the text deltas of a streamed answer into content deltas and, at the end, `tool_calls`
deltas: the text that may be a call is held back until it is known (a call's arguments come in one delta).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from chunkwise.engine.datatypes.structured_output import StructuredOutput

ToolMode = Literal["auto", "required", "named"]
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def as_delta(self, index: int) -> dict[str, Any]:
        """The streamed form: the whole call in one delta, with its place among the answer's calls."""
        return {"index": index, **self.as_dict()}


@dataclass(frozen=True)
class ToolParsing:
    """How one chat answer's text is read for tool calls."""

    mode: ToolMode
    names: frozenset[str]
    name: str | None = None  # named mode's function

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer; no calls leaves the text as the content."""
        if self.mode == "named":
            assert self.name is not None
            args = _json_object(text)
            if args is None:
                return text, []
            return None, [ToolCall(self.name, _dumps(args))]
        if self.mode == "required":
            calls = _calls_from(_json(text), self.names, "parameters")
            return (None, calls) if calls else (text, [])
        return parse_tool_calls(text, self.names)

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _json_object(text: str) -> dict[str, Any] | None:
    value = _json(text)
    return value if isinstance(value, dict) else None


def _calls_from(value: Any, names: frozenset[str], *arg_keys: str) -> list[ToolCall]:
    """Calls from a decoded `{"name", <arg key>}` object or a list of them; [] unless every one is a call
    of a known tool with an object (or JSON text of one) for its arguments."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        args: Any = next((item[k] for k in arg_keys if k in item), {})
        if isinstance(args, str):  # some models write the arguments as JSON text
            args = _json_object(args)
        if not isinstance(args, dict):
            return []
        calls.append(ToolCall(item["name"], _dumps(args)))
    return calls


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
    """tool_choice "auto": the tool calls in a model's answer, and the content around them.

    Hermes (Qwen, Hermes, many fine-tunes): content, then `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` blocks. Llama 3: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`; several calls joined by ";"). Calls naming no known tool are left as content."""
    if HERMES_OPEN in text:
        calls = []
        for m in _HERMES.finditer(text):
            found = _calls_from(_json(m.group(1)), names, "arguments", "parameters")
            if not found:
                return text, []
            calls.extend(found)
        if calls:
            content = text[: text.index(HERMES_OPEN)].strip()
            return content or None, calls
        return text, []
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if body.startswith(("{", "[")):
        calls = _calls_from(_json(body), names, "parameters", "arguments")
        if not calls and ";" in body:
            calls = []
            for part in body.split(";"):
                found = _calls_from(_json(part.strip()), names, "parameters", "arguments")
                if not found:
                    calls = []
                    break
                calls.extend(found)
        if calls:
            return None, calls
    return text, []


def required_spec(tools: list[tuple[str, dict[str, Any]]]) -> StructuredOutput:
    """tool_choice "required": a list of one or more calls, each of one of the tools with its parameters."""
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in tools
    ]
    return StructuredOutput.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": alternatives}})


def held_from(text: str, mode: ToolMode) -> int:
    """Where the part of a streamed answer that may still become a tool call starts (len(text): none)."""
    if mode != "auto":
        return 0  # a constrained answer is all call
    stripped = text.lstrip()
    lead = len(text) - len(stripped)
    # Llama-3 style: the answer opens with the call.
    if stripped.startswith(("{", "[")) or (stripped and PYTHON_TAG.startswith(stripped[: len(PYTHON_TAG)])):
        return lead
    if not stripped:
        return lead
    i = text.find(HERMES_OPEN)
    if i >= 0:
        return i
    # A suffix that could be the start of "<tool_call>".
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ToolStream:
    """One streamed chat answer's text, split into what can be shown now and the held-back tail."""

    def __init__(self, parsing: ToolParsing) -> None:
        self.parsing = parsing
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> str:
        """The content that can be streamed now, after `delta`."""
        self.text += delta
        end = max(held_from(self.text, self.parsing.mode), self.emitted)
        out, self.emitted = self.text[self.emitted : end], end
        return out

    def finish(self, complete: bool) -> tuple[str, list[ToolCall]]:
        """At the end: the content still to show and the calls (none unless the answer `complete`d)."""
        content, calls = self.parsing.extract(self.text) if complete else (self.text, [])
        if calls:
            # What was already streamed stays shown; the rest of the content (before the calls) follows.
            shown = self.text[: self.emitted]
            rest = (content or "")[len(shown) :] if (content or "").startswith(shown) else ""
            return rest, calls
        return self.text[self.emitted :], []
