"""Each endpoint's request side: its body -> what to generate (prompt, SamplingParams) and what to show
(ResponseOptions), with the fields it cannot honour refused as 400s; and which formatter shapes its answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from chunkwise.sampling_params import MAX_LOGPROBS, SamplingParams
from chunkwise.server.chat import ChatMessage, ChatTemplateError, message_text, render_chat
from chunkwise.server.errors import bad_request, from_value_error
from chunkwise.server.formatters import ChatFormatter, CompletionFormatter, Formatter, ResponseOptions
from chunkwise.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling

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
    return Generation(prompts, params, _options(body, logprobs=body.logprobs is not None, echo=body.echo))


# -- chat --------------------------------------------------------------------------------------------------
def chat_prompt_ids(engine: AsyncEngine, body: ChatCompletionRequest) -> list[int]:
    tok = engine.tokenizer
    try:
        messages = [ChatMessage(m.role, message_text(m.content)) for m in body.messages]
        bos = "" if tok.bos_token_id is None else tok.decode([tok.bos_token_id], skip_special_tokens=False)
        eos = "" if not tok.eos_token_ids else tok.decode([tok.eos_token_ids[0]], skip_special_tokens=False)
        text = render_chat(
            messages,
            tok.chat_template,
            add_generation_prompt=body.add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from e
    # A template that writes the BOS itself must not get a second one from the tokenizer.
    return tok.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def _chat(body: ChatCompletionRequest, engine: AsyncEngine) -> Generation:
    if body.tools:
        raise bad_request("tools are not supported", param="tools")
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("only response_format {'type': 'text'} is supported", param="response_format")
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
    # Rendered after the parameters are checked, so a bad parameter is reported before a bad message.
    ids = chat_prompt_ids(engine, body)
    return Generation([ids], params, _options(body, logprobs=body.logprobs, top_logprobs=top_n))


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
