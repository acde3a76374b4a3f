"""What a request asks its output to match: the request-side spec of structured outputs.

Kept free of torch and llguidance (SamplingParams carries it, and the router imports SamplingParams). The
spec is one string per form (a schema as compact JSON), so that equal constraints are equal keys of the
compiler's cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's generated text.

    kind "json": `spec` is a JSON schema as compact JSON text, its keys in order; "regex": a regular
    expression the whole output matches; "choice": a JSON list of the strings the output may be; "grammar":
    a Lark grammar (llguidance's dialect)."""

    kind: Kind
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured_outputs spec must be a string, got {type(self.spec).__name__}")

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """A JSON schema (a dict or bool, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs: the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict | bool):
            raise ValueError(
                f"structured_outputs: a JSON schema must be an object or a bool, got {type(schema).__name__}"
            )
        # Keys keep their order: a schema's "properties" order is the order the output writes them in.
        return cls("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("structured_outputs: regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutput:
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise ValueError("structured_outputs: choice must be a non-empty list of strings")
        if not all(isinstance(o, str) and o for o in options):
            raise ValueError("structured_outputs: choice must hold only non-empty strings")
        return cls("choice", json.dumps(list(dict.fromkeys(options)), ensure_ascii=False))

    @classmethod
    def grammar(cls, lark: str) -> StructuredOutput:
        if not isinstance(lark, str) or not lark.strip():
            raise ValueError("structured_outputs: grammar must be a non-empty Lark grammar")
        return cls("grammar", lark)

    def schema(self) -> Any:
        """The JSON schema of a "json" spec."""
        if self.kind != "json":
            raise ValueError(f"a {self.kind} spec has no JSON schema")
        return json.loads(self.spec)

    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise ValueError(f"a {self.kind} spec has no choices")
        return list(json.loads(self.spec))
