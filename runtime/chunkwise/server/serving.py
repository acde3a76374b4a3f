"""The completion and chat handlers: request -> SamplingParams -> engine stream -> JSON or SSE.

Every request gets its own `RequestStream`, and every path out of a handler closes it: a finished request is
left alone, anything else (client disconnect, cancellation, error) is aborted so its KV blocks are freed
within a step. Disconnects are watched for explicitly: a streaming response races its sender against the
ASGI `http.disconnect` message; a non-streaming one races collection against it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from chunkwise.metrics import EngineMetrics
from chunkwise.outputs import RequestOutput, TokenLogprob
from chunkwise.sampling_params import MAX_LOGPROBS, SamplingParams
from chunkwise.sched.shedding import Overloaded, SheddingPolicy
from chunkwise.server.chat import ChatMessage, ChatTemplateError, message_text, render_chat
from chunkwise.server.errors import APIError, bad_request, from_value_error
from chunkwise.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling

if TYPE_CHECKING:
    from chunkwise.engine import AsyncEngine, RequestStream

# What a refused client is told while the server loads or drains (another replica may take it sooner).
UNAVAILABLE_RETRY_AFTER_S = 5
# JSON has no infinities: a -inf logprob (a token the sampler could never pick) is reported as this.
MIN_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


class ServerState:
    """Everything one app holds: no module globals, so a process can build several apps."""

    def __init__(
        self,
        engine: AsyncEngine | None,
        served_model_name: str,
        shedding: SheddingPolicy,
        metrics: EngineMetrics,
    ) -> None:
        self.engine: AsyncEngine | None = None
        self.served_model_name = served_model_name
        self.shedding = shedding
        self.metrics = metrics
        self.draining = False
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: AsyncEngine) -> None:
        """Serve `engine` from now on (the server starts answering /health 200 once it runs)."""
        engine.add_observer(self.metrics.on_step)
        info = engine.model_info
        self.metrics.set_cache_config(info.block_size, info.num_blocks, info.enable_prefix_caching)
        self.metrics.set_stats_source(engine.scheduler_stats)
        self.engine = engine

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.engine is None:
            return "loading"
        if not self.engine.is_running:
            return "error"
        return "ok"

    def require_engine(self) -> AsyncEngine:
        status = self.status
        if status == "ok":
            assert self.engine is not None
            return self.engine
        messages = {
            "draining": "the server is shutting down; retry on another replica",
            "loading": "the model is still loading; retry shortly",
            "error": "the engine is not running",
        }
        raise APIError(
            503, messages[status], code=status, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}
        )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                400,
                f"the model {model!r} does not exist; this server serves {self.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    def add(
        self,
        engine: AsyncEngine,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        endpoint: str,
        prompt_param: str,
    ) -> RequestStream:
        try:
            return engine.add_request(
                prompt,
                params,
                request_id=request_id,
                route=f"{self.served_model_name}:{endpoint}",
                shedding=self.shedding,
            )
        except Overloaded as e:
            d = e.decision
            assert d.reason is not None
            self.metrics.record_rejection(d.reason)
            raise APIError(
                429, d.message, code=d.reason, headers={"Retry-After": str(d.retry_after_s)}
            ) from e
        except ValueError as e:
            raise from_value_error(e, prompt_param) from e
        except RuntimeError as e:
            raise APIError(503, str(e), code="error") from e

    def token_text(self, engine: AsyncEngine, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


# -- requests -> SamplingParams -----------------------------------------------------------------------------
def _reject_unsupported_common(body: _Sampling) -> None:
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")


def _sampling_params(
    body: _Sampling, max_tokens: int | None, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    top_k = 0 if body.top_k is None else body.top_k
    # A top_k past the vocabulary filters nothing; clamped so an absurd value never reaches the sampler.
    top_k = min(top_k, vocab_size)
    try:
        return SamplingParams(
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
        )
    except ValueError as e:
        raise from_value_error(e) from e


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    batch: list[str | list[int]] = []
    ids: list[int] = []
    for p in prompt:
        if isinstance(p, str | list):
            batch.append(p)
        else:
            ids.append(p)
    if not batch:
        return ids
    if len(batch) > 1:
        raise bad_request(
            f"a batch of {len(batch)} prompts is not supported; send one prompt per request", param="prompt"
        )
    return batch[0]


def _usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _aborted_error() -> APIError:
    return APIError(503, "the request was aborted: the server is shutting down", code="aborted")


def _stream_error(e: Exception) -> APIError:
    if isinstance(e, ValueError):
        return from_value_error(e)
    return APIError(500, f"engine error: {e}")


# -- log-probs ---------------------------------------------------------------------------------------------
@dataclass
class _CompletionLogprobs:
    """The legacy completions log-prob object, grown delta by delta."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0

    def add(self, state: ServerState, engine: AsyncEngine, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        start = len(self.tokens)
        for lp in lps:
            text = state.token_text(engine, lp.token_id)
            top = {text: _finite(lp.logprob)}
            for tid, v in lp.top:
                top.setdefault(state.token_text(engine, tid), _finite(v))
            self.tokens.append(text)
            self.token_logprobs.append(_finite(lp.logprob))
            self.top_logprobs.append(top)
            self.text_offset.append(self.offset)
            self.offset += len(text)
        return self.as_dict(start)

    def as_dict(self, start: int = 0) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }


def _chat_logprob_entry(
    state: ServerState, engine: AsyncEngine, token_id: int, logprob: float
) -> dict[str, Any]:
    text = state.token_text(engine, token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(
    state: ServerState, engine: AsyncEngine, lps: Sequence[TokenLogprob], top_n: int
) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        entry = _chat_logprob_entry(state, engine, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_logprob_entry(state, engine, t, v) for t, v in lp.top[:top_n]]
        out.append(entry)
    return out


# -- disconnects -------------------------------------------------------------------------------------------
async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class _Collected:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = c.finish_reason


async def _collect(request: Request, stream: RequestStream) -> _Collected | None:
    """All of one request's output, or None when the client went away first (the request is aborted)."""
    result = _Collected()

    async def consume() -> None:
        async for out in stream:
            result.add(out)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            return None  # disconnected
        consumer.result()  # re-raise the engine's error, if any
        return result
    finally:
        watcher.cancel()
        consumer.cancel()
        stream.close()


class EngineStreamResponse(Response):
    """Server-sent events from an engine stream. Races the sender against the client's disconnect, and
    closes (aborts) the engine request however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], stream: RequestStream) -> None:
        self.body_iterator = body
        self.stream = stream
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            sender.cancel()
            self.stream.close()
            try:
                await sender
            except (asyncio.CancelledError, OSError):
                pass  # the client went away
            finally:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()


# -- completions -------------------------------------------------------------------------------------------
async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    engine = state.require_engine()
    state.check_model(body.model)
    _reject_unsupported_common(body)
    if body.echo:
        raise bad_request("echo is not supported", param="echo")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != 1:
        raise bad_request("best_of must be 1 (one completion per request)", param="best_of")
    prompt = _single_prompt(body.prompt)
    params = _sampling_params(body, body.max_tokens, body.logprobs, engine.model_info.vocab_size)
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream = state.add(engine, prompt, params, rid, "completions", "prompt")
    created = int(time.time())
    model = state.served_model_name
    want_logprobs = body.logprobs is not None

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EngineStreamResponse(
            _completion_events(
                state,
                engine,
                stream,
                rid,
                created,
                model,
                want_logprobs,
                include_usage,
                body.return_token_ids,
            ),
            stream,
        )

    result = await _collect(request, stream)
    if result is None:
        return Response(status_code=499)
    if result.finish_reason == "abort":
        raise _aborted_error()
    logprobs = None
    if want_logprobs:
        logprobs = _CompletionLogprobs().add(state, engine, result.logprobs)
    choice: dict[str, Any] = {
        "index": 0,
        "text": result.text,
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
    }
    if body.return_token_ids:
        choice["prompt_token_ids"] = stream.prompt_token_ids
        choice["token_ids"] = result.token_ids
    return _json(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(stream.num_prompt_tokens, len(result.token_ids), result.num_cached_tokens),
        }
    )


async def _completion_events(
    state: ServerState,
    engine: AsyncEngine,
    stream: RequestStream,
    rid: str,
    created: int,
    model: str,
    want_logprobs: bool,
    include_usage: bool,
    return_token_ids: bool,
) -> AsyncIterator[bytes]:
    num_tokens = num_cached = 0
    lp_state = _CompletionLogprobs()
    first = True
    try:
        async for out in stream:
            c = out.outputs[0]
            num_tokens += len(c.token_ids)
            num_cached = out.num_cached_tokens
            if c.finish_reason == "abort":
                yield _sse(_aborted_error().body())
                yield SSE_DONE
                return
            finish = c.finish_reason if out.finished else None
            if not c.token_ids and not c.text and finish is None:
                continue
            # A chunk for every step with new tokens, text or not (held back for a stop string, an
            # incomplete character, a model without a tokenizer): a client times every token, as with vLLM.
            lp = lp_state.add(state, engine, c.logprobs or []) if want_logprobs else None
            choice: dict[str, Any] = {"index": 0, "text": c.text, "logprobs": lp, "finish_reason": finish}
            if return_token_ids:
                if first:
                    choice["prompt_token_ids"] = stream.prompt_token_ids
                choice["token_ids"] = c.token_ids
            first = False
            chunk: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
    except Exception as e:
        yield _sse(_stream_error(e).body())
        yield SSE_DONE
        return
    if include_usage:
        yield _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(stream.num_prompt_tokens, num_tokens, num_cached),
            }
        )
    yield SSE_DONE


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


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    engine = state.require_engine()
    state.check_model(body.model)
    _reject_unsupported_common(body)
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
    ids = chat_prompt_ids(engine, body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.add(engine, ids, params, rid, "chat", "messages")
    created = int(time.time())
    model = state.served_model_name

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EngineStreamResponse(
            _chat_events(
                state,
                engine,
                stream,
                rid,
                created,
                model,
                body.logprobs,
                top_n,
                include_usage,
                body.return_token_ids,
            ),
            stream,
        )

    result = await _collect(request, stream)
    if result is None:
        return Response(status_code=499)
    if result.finish_reason == "abort":
        raise _aborted_error()
    logprobs = {"content": _chat_logprobs(state, engine, result.logprobs, top_n)} if body.logprobs else None
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": result.text},
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
    }
    response: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(stream.num_prompt_tokens, len(result.token_ids), result.num_cached_tokens),
    }
    if body.return_token_ids:
        choice["token_ids"] = result.token_ids
        response["prompt_token_ids"] = stream.prompt_token_ids
    return _json(response)


async def _chat_events(
    state: ServerState,
    engine: AsyncEngine,
    stream: RequestStream,
    rid: str,
    created: int,
    model: str,
    want_logprobs: bool,
    top_n: int,
    include_usage: bool,
    return_token_ids: bool,
) -> AsyncIterator[bytes]:
    def chunk(
        delta: dict[str, Any], finish: str | None, logprobs: Any = None, token_ids: list[int] | None = None
    ) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        data: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if return_token_ids:
            if token_ids is None:
                data["prompt_token_ids"] = stream.prompt_token_ids
            else:
                choice["token_ids"] = token_ids
        if include_usage:
            data["usage"] = None
        return _sse(data)

    num_tokens = num_cached = 0
    try:
        yield chunk({"role": "assistant", "content": ""}, None)
        async for out in stream:
            c = out.outputs[0]
            num_tokens += len(c.token_ids)
            num_cached = out.num_cached_tokens
            if c.finish_reason == "abort":
                yield _sse(_aborted_error().body())
                yield SSE_DONE
                return
            finish = c.finish_reason if out.finished else None
            if not c.token_ids and not c.text and finish is None:
                continue  # one chunk per step with new tokens, as for completions
            lp = (
                {"content": _chat_logprobs(state, engine, c.logprobs or [], top_n)} if want_logprobs else None
            )
            yield chunk({"content": c.text} if c.text else {}, finish, lp, c.token_ids)
    except Exception as e:
        yield _sse(_stream_error(e).body())
        yield SSE_DONE
        return
    if include_usage:
        yield _sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(stream.num_prompt_tokens, num_tokens, num_cached),
            }
        )
    yield SSE_DONE


def _json(data: dict[str, Any], status_code: int = 200) -> Response:
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return Response(body, status_code=status_code, media_type="application/json")
