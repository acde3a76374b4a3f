"""The offline API: `LLM(model="tiny", **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.datatypes.lora import LoRARequest
from chunkwise.engine.datatypes.outputs import RequestOutput
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.loop.core import EngineCore
from chunkwise.engine.tokenizer import Tokenizer


def _merge(acc: RequestOutput, delta: RequestOutput) -> None:
    # One delta per choice that progressed (n > 1: any of them, by index); acc holds each choice seen so far.
    outputs = acc.outputs
    for d in delta.outputs:
        a = outputs[0] if len(outputs) == 1 and outputs[0].index == d.index else None
        if a is None:
            a = next((c for c in outputs if c.index == d.index), None)
            if a is None:
                outputs.append(d)
                continue
        a.text += d.text
        a.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            a.logprobs = (a.logprobs or []) + d.logprobs
        a.finish_reason, a.stop_reason = d.finish_reason, d.stop_reason
    acc.finished = delta.finished
    if acc.first_token_time is None:  # n > 1: the first choice's first token
        acc.first_token_time = delta.first_token_time
    acc.finished_time = delta.finished_time


class LLM:
    """The offline API: `LLM(model="tiny", **engine_args).generate(prompts, sampling_params)`."""

    def __init__(self, model: str = "tiny", **engine_args: object) -> None:
        self.engine = EngineCore(engine_config_from_kwargs(model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's: one output per prompt. `lora_request` is one adapter for every prompt, or one per prompt
        (None: the base model); it needs enable_lora. `priority`, one per prompt, sets each request's
        SamplingParams.priority (lower first; it needs scheduling_policy="priority")."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompt_list: list[str | Sequence[int]] = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(params)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(loras)} LoRA requests")
        if priority is not None:
            if len(priority) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(priority)} priorities")
            params = [dataclasses.replace(sp, priority=p) for sp, p in zip(params, priority)]
        # Validate everything before queueing anything, so one bad prompt leaves no half-run batch.
        reqs = [
            self.engine.make_request(f"offline-{next(self._ids)}", p, sp, lora_request=lora)
            for p, sp, lora in zip(prompt_list, params, loras)
        ]
        results: dict[str, RequestOutput] = {}
        for req, text in reqs:
            self.engine.add(req, text)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id in results:
                    _merge(results[out.request_id], out)
                else:
                    results[out.request_id] = out
        for out in results.values():
            out.outputs.sort(key=lambda c: c.index)
        return [results[req.request_id] for req, _ in reqs]
