"""OpenAI request models (pydantic, strict: a wrong type is a 400, never a silent coercion).

Unknown fields are ignored, as OpenAI-compatible servers commonly do; fields we cannot honour (best_of
other than n, suffix, logit_bias) are refused with a clear 400 rather than ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# SamplingParams validates the numbers (ranges, NaN); the models check only shapes and types.


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of these constrains the generated text."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    # Extensions (vLLM's names).
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: each choice (and each streamed chunk) also carries its token ids, and the prompt's.
    return_token_ids: bool = False
    # vLLM's: the log-probs of the prompt's tokens (and this many alternatives each).
    prompt_logprobs: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's: under --scheduling-policy priority, lower is served first; elsewhere only 0 is accepted.
    priority: int = 0
    structured_outputs: StructuredOutputsParams | None = None


class CompletionRequest(_Sampling):
    # A string, a list of token ids, or a batch of either (one engine request per prompt).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessageModel(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    # With type "json_schema" (OpenAI's structured outputs).
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # A JSON schema for the arguments (an object); none means a call takes no arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageModel] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1)
