"""The baseline a user would otherwise pick: Hugging Face `transformers` `generate` on padded static batches.

Requests are taken in arrival order in batches of `batch_size` (the same concurrency chunkwise gets), prompts
left-padded to the batch's longest, and each batch generates greedily up to its longest max_tokens with EOS
ignored (every row runs to the end, as `generate` does for a batch); each request keeps its own first
max_tokens tokens, the useful work. A streamer timestamps every decoding step, so TTFT and ITL mean what
they mean for chunkwise; a request's latency ends when `generate` returns its batch.

The weights are chunkwise's own: a preset's ModelConfig becomes a LlamaConfig and its state dict (under
Hugging Face's names, chunkwise.engine.model.presets.preset_state_dict) loads unchanged; an HF directory is loaded by both sides from disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from chunkwise.bench.clock import ClockName, Recorder, RunClock
from chunkwise.bench.results import RunResult
from chunkwise.bench.workloads import WorkItem

if TYPE_CHECKING:
    import torch

    from chunkwise.engine.datatypes.config import ModelConfig

# Left padding uses this id; attention masks hide it, so any valid id does.
_PAD_ID = 0


def hf_config(cfg: ModelConfig) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids) or None,
    )


def load_hf_model(model: str, dtype: str = "float32") -> Any:
    """The same weights as `chunkwise` loads for `model` (a preset or an HF directory), as an HF model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    from chunkwise.engine.model.bundled import resolve_model_path

    hf: Any
    if resolve_model_path(model).is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(model)), dtype=torch_dtype)
    else:
        from chunkwise.engine.model.presets import PRESETS, preset_state_dict

        built: Any = LlamaForCausalLM(hf_config(PRESETS[model]))
        missing, unexpected = built.load_state_dict(preset_state_dict(model), strict=False)
        # Only buffers HF recomputes itself may be missing (the rotary table).
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise RuntimeError(
                f"weights do not map onto transformers: missing {missing}, unexpected {unexpected}"
            )
        hf = built.to(torch_dtype)
    hf.eval()
    # Run every row to max_new_tokens: the padded static batch, EOS ignored as in chunkwise's runs.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = _PAD_ID
    return hf


class _StepClock:
    """A transformers streamer that only timestamps (both clocks): put() is called once with the prompt,
    then once per generated step."""

    def __init__(self, clock: RunClock, between_steps: Callable[[], None] | None = None) -> None:
        self.clock = clock
        self.times: list[dict[ClockName, float]] = []
        self._prompt_seen = False
        self.between_steps = between_steps

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(self.clock.snapshot())
        self._prompt_seen = True
        if self.between_steps is not None:
            # Another configuration's step runs here, off this run's clocks (see compare_hf).
            self.clock.pause()
            self.between_steps()
            self.clock.resume()

    def end(self) -> None:
        pass


def _batch_inputs(batch: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), _PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def run_hf(
    hf: Any,
    items: Sequence[WorkItem],
    batch_size: int,
    name: str = "transformers",
    progress: bool = False,
    clock: ClockName = "wall",
    between_steps: Callable[[], None] | None = None,
) -> tuple[RunResult, list[list[int]]]:
    """Serve items in padded static batches; returns the run (on `clock`, the other reading in `.other`)
    and each request's useful output tokens. Arrival offsets are ignored: every batch is full at once.
    `between_steps`, if given, is called after every decoding step with this run's clocks stopped."""
    import torch

    from chunkwise.bench.offline import two_readings
    from chunkwise.bench.progress import Progress

    if any(it.max_tokens is None for it in items):
        raise ValueError("the transformers baseline needs each request's max_tokens")
    outputs: list[list[int]] = []
    bar = Progress(len(items), name) if progress else None
    rc = RunClock()
    rec = Recorder(len(items), rc)
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        prompts = [it.token_ids() for it in batch]
        lens = [it.output_len for it in batch]
        ids, mask = _batch_inputs(prompts)
        steps = _StepClock(rc, between_steps)
        sent = rc.snapshot()
        for k, p in enumerate(prompts):
            rec.start(start + k, sent, len(p))
        with torch.inference_mode():
            gen = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                streamer=steps,
            )
        done = rc.snapshot()
        new = gen[:, ids.shape[1] :].tolist()
        for k, n in enumerate(lens):
            # A request's tokens stream with the batch's steps; generate() returns when the longest ends.
            for at in steps.times[:n]:
                rec.emit(start + k, 1, False, at)
            rec.emit(start + k, 0, True, done)
            outputs.append(new[k][:n])
            if bar:
                bar.update()
    if bar:
        bar.close()
    return two_readings(name, rec, clock, [], {}), outputs


def greedy_agreement(
    hf: Any, engine: Any, prompts: Sequence[list[int]], max_tokens: int
) -> list[tuple[int, int]]:
    """For each prompt, (tokens equal before the first difference, max_tokens): transformers alone (batch of
    one, no padding) against chunkwise's engine, both greedy."""
    import torch

    from chunkwise.bench.offline import run_engine_outputs

    ours = run_engine_outputs(engine, [WorkItem(tuple(p), max_tokens) for p in prompts], "agree")
    out = []
    for p, mine in zip(prompts, ours):
        with torch.inference_mode():
            gen = hf.generate(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
        theirs = gen[0, len(p) :].tolist()
        same = 0
        for a, b in zip(mine, theirs):
            if a != b:
                break
            same += 1
        out.append((same, max_tokens))
    return out
