"""Each endpoint's request side: its body -> what to generate (prompt, SamplingParams) and what to show
(ResponseOptions), with the fields it cannot honour refused as 400s; and which formatter shapes its answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from chunkwise.engine.datatypes.sampling_params import MAX_LOGPROBS, SamplingParams
from chunkwise.engine.datatypes.structured_output import StructuredOutput
from chunkwise.server.chat import ChatMessage, ChatTemplateError, message_text, render_chat
from chunkwise.server.errors import bad_request, from_value_error
from chunkwise.server.formatters import (
    ChatFormatter,
    ChatOptions,
    CompletionFormatter,
    Formatter,
    ResponseOptions,
)
from chunkwise.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from chunkwise.server.tools import ToolParsing, required_spec

if TYPE_CHECKING:
    from chunkwise.engine import AsyncEngine

B = TypeVar("B", bound=_Sampling)


# The most prompts one /v1/completions body may batch: each is an engine request of its own, and a client
# that wants more is better served by sending several bodies (load shedding then sees them one by one).
MAX_BATCH_PROMPTS = 256


@dataclass(frozen=True)
class Generation:
    """One request as the serving path runs it: one engine request per prompt, each with `params.n`
    choices."""

    prompts: list[str | list[int]]
    params: SamplingParams
    options: ResponseOptions


@dataclass(frozen=True)
class Endpoint(Generic[B]):
    """What sets one endpoint apart on the shared serving path."""

    route: str  # the engine's route label (metrics, shedding): "<served model>:<route>"
    id_prefix: str
    prompt_param: str  # the body field an invalid prompt is blamed on
    formatter: type[Formatter]
    build: Callable[[B, AsyncEngine], Generation]  # the endpoint's own checks, prompt and parameters

    def prepare(self, body: B, engine: AsyncEngine) -> Generation:
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        return self.build(body, engine)


def _sampling_params(
    body: _Sampling,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    top_k = 0 if body.top_k is None else body.top_k
    # A top_k past the vocabulary filters nothing; clamped so an absurd value never reaches the sampler.
    top_k = min(top_k, vocab_size)
    try:
        params = SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logprobs=logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            priority=body.priority,
        )
    except ValueError as e:
        raise from_value_error(e) from e
    return params


def _options(body: _Sampling, logprobs: bool, top_logprobs: int = 0, echo: bool = False) -> ResponseOptions:
    return ResponseOptions(
        echo=echo,
        prompt_logprobs=body.prompt_logprobs is not None,
        stream=body.stream,
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        return_token_ids=body.return_token_ids,
    )


# -- structured outputs ------------------------------------------------------------------------------------
def _structured_outputs(body: _Sampling) -> StructuredOutput | None:
    """vLLM's `structured_outputs` field: exactly one of json, regex, choice, grammar (or json_object)."""
    so = body.structured_outputs
    if so is None:
        return None
    given = [
        k
        for k, v in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
        )
        if v is not None
    ]
    if len(given) != 1:
        raise bad_request(
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object"
            + (f" (got {', '.join(given)})" if given else ""),
            param="structured_outputs",
        )
    try:
        if so.json_ is not None:
            return StructuredOutput.json_schema(so.json_)
        if so.regex is not None:
            return StructuredOutput.regex(so.regex)
        if so.choice is not None:
            return StructuredOutput.choice(so.choice)
        if so.grammar is not None:
            return StructuredOutput.grammar(so.grammar)
        return StructuredOutput.json_object()
    except ValueError as e:
        raise bad_request(str(e), param="structured_outputs") from e


def _check_structured(engine: AsyncEngine, spec: StructuredOutput, param: str) -> None:
    """Compile `spec` now (the engine caches it) so that a bad one is a 400 naming `param`."""
    try:
        engine.structured.check(spec)
    except ValueError as e:
        raise bad_request(str(e), param=param) from e


def _constrained(params: SamplingParams, spec: StructuredOutput | None) -> SamplingParams:
    return params if spec is None else dataclasses.replace(params, structured=spec)


# -- completions -------------------------------------------------------------------------------------------
def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: a string, a list of token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    # The request model admits no list mixing ids with strings or lists.
    batch: list[str | list[int]] = list(prompt)  # type: ignore[arg-type]
    if any(not p for p in batch):
        raise bad_request("a prompt in the batch is empty", param="prompt")
    if len(batch) > MAX_BATCH_PROMPTS:
        raise bad_request(
            f"a batch of {len(batch)} prompts is more than {MAX_BATCH_PROMPTS}; send several requests",
            param="prompt",
        )
    return batch


def _completion(body: CompletionRequest, engine: AsyncEngine) -> Generation:
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        # best_of > n would generate candidates and rank them; vLLM's engine no longer does either.
        raise bad_request(f"best_of must equal n ({body.n}) when given", param="best_of")
    prompts = _prompts(body.prompt)
    # Echo with logprobs shows the prompt's tokens' log-probs too, with as many alternatives.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
    vocab_size = engine.model_info.vocab_size
    params = _sampling_params(body, body.max_tokens, body.logprobs, vocab_size, prompt_logprobs)
    spec = _structured_outputs(body)
    if spec is not None:
        _check_structured(engine, spec, "structured_outputs")
    params = _constrained(params, spec)
    return Generation(prompts, params, _options(body, logprobs=body.logprobs is not None, echo=body.echo))


# -- chat --------------------------------------------------------------------------------------------------
def _chat_message(m: Any) -> ChatMessage:
    extra = m.model_extra or {}
    tool_calls = extra.get("tool_calls")
    call_id = extra.get("tool_call_id")
    return ChatMessage(
        m.role,
        message_text(m.content),
        tool_calls=tool_calls if isinstance(tool_calls, list) else None,
        tool_call_id=call_id if isinstance(call_id, str) else None,
        name=m.name,
    )


def chat_prompt_ids(engine: AsyncEngine, body: ChatCompletionRequest) -> list[int]:
    tok = engine.tokenizer
    try:
        messages = [_chat_message(m) for m in body.messages]
        bos = "" if tok.bos_token_id is None else tok.decode([tok.bos_token_id], skip_special_tokens=False)
        eos = "" if not tok.eos_token_ids else tok.decode([tok.eos_token_ids[0]], skip_special_tokens=False)
        text = render_chat(
            messages,
            tok.chat_template,
            add_generation_prompt=body.add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from e
    # A template that writes the BOS itself must not get a second one from the tokenizer.
    return tok.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def _response_format(body: ChatCompletionRequest) -> StructuredOutput | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput.json_object()
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema (a JSON schema object)",
            param="response_format",
        )
    return StructuredOutput.json_schema(rf.json_schema.schema_)


def _tool_calls(
    body: ChatCompletionRequest, engine: AsyncEngine
) -> tuple[ToolParsing | None, StructuredOutput | None]:
    """What `tools` and `tool_choice` ask for: how to read the answer, and its constraint (named, required)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None, None
    tools: list[tuple[str, dict[str, Any]]] = []
    for t in body.tools:
        params = t.function.parameters
        schema: dict[str, Any] = params if params is not None else {"type": "object", "properties": {}}
        if any(t.function.name == name for name, _ in tools):
            raise bad_request(f"tools: the function name {t.function.name!r} is used twice", param="tools")
        if schema.get("type", "object") != "object":
            raise bad_request(
                f"tools: the parameters of {t.function.name!r} must be a JSON schema of an object",
                param="tools",
            )
        try:
            engine.structured.check(StructuredOutput.json_schema(schema))
        except ValueError as e:
            raise bad_request(f"tools: {t.function.name!r}: {e}", param="tools") from e
        tools.append((t.function.name, schema))
    names = frozenset(name for name, _ in tools)
    if choice == "none":
        return None, None
    if choice is None or choice == "auto":
        return ToolParsing("auto", names), None
    if choice == "required":
        spec = required_spec(tools)
        _check_structured(engine, spec, "tools")
        return ToolParsing("required", names), spec
    named = choice.function.name
    named_schema = dict(tools).get(named)
    if named_schema is None:
        raise bad_request(f"tool_choice names {named!r}, which is not one of the tools", param="tool_choice")
    return ToolParsing("named", names, named), StructuredOutput.json_schema(named_schema)


def _chat(body: ChatCompletionRequest, engine: AsyncEngine) -> Generation:
    try:
        formatted = _response_format(body)
    except ValueError as e:
        raise bad_request(str(e), param="response_format") from e
    spec = _structured_outputs(body)
    if formatted is not None and spec is not None:
        raise bad_request("give response_format or structured_outputs, not both", param="structured_outputs")
    if formatted is not None:
        _check_structured(engine, formatted, "response_format")
        spec = formatted
    elif spec is not None:
        _check_structured(engine, spec, "structured_outputs")
    tool_parsing, tool_spec = _tool_calls(body, engine)
    if tool_spec is not None:
        if spec is not None:
            raise bad_request(
                "a named or required tool_choice constrains the output itself: it cannot be combined with "
                "response_format or structured_outputs",
                param="tool_choice",
            )
        spec = tool_spec
    elif formatted is not None:
        tool_parsing = None  # the answer follows the requested response_format: it is content
    # (structured_outputs with tool_choice "auto" keeps the parsing, as vLLM's tool parsers run on whatever
    # the constraint let through.)
    top_n = 0
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        top_n = body.top_logprobs
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _sampling_params(
        body, max_tokens, top_n if body.logprobs else None, engine.model_info.vocab_size
    )
    params = _constrained(params, spec)
    # Rendered after the parameters are checked, so a bad parameter is reported before a bad message.
    ids = chat_prompt_ids(engine, body)
    options = _options(body, logprobs=body.logprobs, top_logprobs=top_n)
    if tool_parsing is not None:
        options = ChatOptions(**vars(options), tools=tool_parsing)
    return Generation([ids], params, options)


COMPLETIONS = Endpoint(
    route="completions",
    id_prefix="cmpl",
    prompt_param="prompt",
    formatter=CompletionFormatter,
    build=_completion,
)
CHAT = Endpoint(
    route="chat", id_prefix="chatcmpl", prompt_param="messages", formatter=ChatFormatter, build=_chat
)
