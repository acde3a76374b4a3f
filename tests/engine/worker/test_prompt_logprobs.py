"""Prompt log-probs (SamplingParams.prompt_logprobs) against transformers' own log-softmax over the prompt,
however the prefill is chunked, and whole even when the prompt's blocks sit in the prefix cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from chunkwise import SamplingParams
from chunkwise.engine import EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.datatypes.outputs import RequestOutput
from tests.hf_models import save_random_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("hf"), "gqa")


def _hf_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(dim=-1)


def _run(
    engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    first: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, out)
            if out.request_id in first and out is not first[out.request_id]:
                # Only the first output of a request carries its prompt's log-probs.
                assert out.prompt_logprobs is None
    assert engine.kv.num_free_blocks == engine.num_blocks
    return first


def test_prompt_logprobs_match_transformers_through_chunked_prefill(model_dir: Path) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(45)]
    reference = _hf_logprobs(model_dir, prompt)
    # A 16-token budget splits the prompt into three chunks, each scored on its own.
    engine = EngineCore(
        engine_config_from_kwargs(str(model_dir), dtype="float32", max_num_batched_tokens=16, block_size=4)
    )
    scored = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = _run(engine, {"a": (prompt, scored), "other": ([5, 6, 7, 8, 9], plain)})
    assert outs["other"].prompt_logprobs is None
    lps = outs["a"].prompt_logprobs
    assert lps is not None and [lp.token_id for lp in lps] == prompt[1:]
    for pos, lp in enumerate(lps):
        row = reference[pos]
        assert lp.logprob == pytest.approx(row[prompt[pos + 1]].item(), abs=1e-4)
        assert lp.rank == int((row > row[prompt[pos + 1]]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()


def test_prompt_logprobs_are_whole_when_the_prefix_is_cached(model_dir: Path) -> None:
    prompt = list(range(10, 50))
    engine = EngineCore(engine_config_from_kwargs(str(model_dir), dtype="float32", block_size=4))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _run(engine, {"warm": (prompt, params)})
    # The same prompt again: a plain request hits the cache, one asking for prompt log-probs does not.
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = _run(engine, {"hit": (prompt, params), "scored": (prompt, scored)})
    assert outs["hit"].num_cached_tokens > 0
    lps = outs["scored"].prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) - 1 and all(lp.top == [] for lp in lps)
    reference = _hf_logprobs(model_dir, prompt)
    assert [lp.logprob for lp in lps] == pytest.approx(
        [reference[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)], abs=1e-4
    )


def test_prompt_logprobs_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
