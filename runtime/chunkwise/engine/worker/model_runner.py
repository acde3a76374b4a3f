"""SchedulerOutput -> tensors -> forward -> sample, as a pipeline of named stages (ModelRunner.execute).
Knows nothing of policies; the KV tensors are its KVTensors' (worker/kv_tensors.py)."""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from itertools import accumulate

import torch

from chunkwise.engine.attention.backend import AttentionBackend
from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.lora.rows import LoRAStep
from chunkwise.engine.lora.slots import LoRASlots
from chunkwise.engine.model.llama import LlamaForCausalLM
from chunkwise.engine.sampling.sampler import (
    GrammarMask,
    RequestGenerators,
    Sampler,
    SamplerOutput,
    SamplingBatch,
)
from chunkwise.engine.sampling.structured.compiler import GrammarCompiler
from chunkwise.engine.sampling.structured.state import GrammarRow, GrammarState
from chunkwise.engine.sched.output import ScheduledRequest, SchedulerOutput
from chunkwise.engine.worker.cuda_graphs import DecodeGraphRunner
from chunkwise.engine.worker.inputs import InputBatch, Row, RowLike
from chunkwise.engine.worker.kv_tensors import KVTensors
from chunkwise.engine.worker.prompt_scores import PromptScorer
from chunkwise.engine.worker.step import (
    DraftRequest,
    ModelRunnerOutput,
    PreparedStep,
    Proposer,
    emit_plain,
)
from chunkwise.engine.worker.tp_stage import RankDriver, StepMessage
from chunkwise.engine.worker.verifier import DraftVerifier, require_grammar

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        backend: AttentionBackend,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        proposer: Proposer | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.model = model
        self.proposer = proposer
        self.config = config
        self.backend = backend
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kv_tensors = KVTensors(
            config,
            num_blocks=num_blocks,
            block_size=block_size,
            num_host_blocks=num_host_blocks,
            dtype=dtype,
            device=device,
            tensor_parallel_size=model.tp.world_size,
            num_layers=len(model.pp.layers),
        )
        self.sampler = Sampler()
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphRunner | None = None
        # The adapters resident on the device, when the engine serves LoRA (loop/builder.py).
        self.lora: LoRASlots | None = None
        self.inputs = InputBatch(
            max_num_tokens=max_num_tokens,
            max_num_reqs=max_num_reqs,
            max_blocks_per_req=-(-max_model_len // block_size),
            block_size=block_size,
            device=device,
            sink_block=self.sink_block,
        )
        # Per-request sampling state that must persist across steps: a seeded request's generator.
        self.generators = RequestGenerators(device)
        self.prompt_scorer = PromptScorer(model)
        # The last decode-only step's rows, their sampling batch and grammar rows (see _decode_sampling_batch).
        self._decode_batch: tuple[list[ScheduledRequest], SamplingBatch, list[GrammarRow]] | None = None
        # Structured outputs: each constrained request's matcher (None: this runner refuses such rows).
        self.grammar = GrammarState(grammars, device) if grammars is not None else None
        self.verifier = DraftVerifier(model, self.grammar, self.generators)
        # Tensor parallel, on rank 0: the other ranks, driven from execute (None: world size 1).
        self.ranks: RankDriver | None = None

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.kv_tensors.kv_caches

    @property
    def host_caches(self) -> list[torch.Tensor]:
        return self.kv_tensors.host_caches

    @property
    def sink_block(self) -> int:
        return self.kv_tensors.sink_block

    def use_decode_graphs(self, sizes: Sequence[int], capture: bool) -> None:
        """Run decode-only steps of up to max(sizes) rows through padded static buffers, replayed from CUDA
        graphs when `capture` (on a GPU, with a backend that reads lengths from device memory)."""
        self.graphs = DecodeGraphRunner(
            self.model,
            self.config,
            self.backend,
            self.kv_caches,
            sizes=sizes,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            sink_block=self.sink_block,
            device=self.device,
            capture=capture,
        )
        if capture:
            self.graphs.capture_all()

    def measure_host_copy_bandwidth(self, num_blocks: int = 8, repeats: int = 3) -> float:
        return self.kv_tensors.measure_host_copy_bandwidth(num_blocks, repeats)

    # -- one step ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step: finished requests forgotten and KV blocks moved, then the stages: propose drafts,
        prepare inputs, forward, score prompts, sample, verify, and one device-to-host read for them all.
        Tensor parallel (rank 0): the step's message goes to the other ranks once the drafts are known; a
        step that fails stops them all (an error naming a rank that died)."""
        if self.ranks is None:
            return self._execute(so)
        self.ranks.check()
        try:
            return self._execute(so)
        except Exception as e:
            self.ranks.stop_after(e)
            raise

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._forget(so.finished_req_ids)
        self.kv_tensors.move(so.block_copies, so.swap_out, so.swap_in, so.offload)
        if not so.scheduled:
            if self.ranks is not None:
                self.ranks.send(StepMessage.of(so, {}))
            return ModelRunnerOutput()
        t0 = time.perf_counter()
        drafts = self._propose(so)
        if self.ranks is not None:
            self.ranks.send(StepMessage.of(so, drafts))
        step = self._prepare(so, drafts)
        t1 = time.perf_counter()
        out = ModelRunnerOutput(prepare_seconds=t1 - t0)
        hidden = self._forward(step)
        if step.score_prompts:
            self.prompt_scorer.score(step.scheduled, step.rows, hidden, out.prompt_logprobs)
        reads: list[torch.Tensor] = []
        result = self._sample(step, hidden, reads)
        verifying = self.verifier.verify(step, hidden, reads)
        host = self._read_back(reads)
        tokens = host[: len(step.plain)]
        if step.grammar_rows:
            self._advance_grammars(step.grammar_rows, tokens)
        t2 = time.perf_counter()
        if result is not None:
            emit_plain(so, step.plain, tokens, result, out)
        self.verifier.emit(verifying, host, len(step.plain), out)
        t3 = time.perf_counter()
        out.forward_seconds = t2 - t1
        out.sample_seconds = t3 - t2
        return out

    @torch.inference_mode()
    def follow(self, message: StepMessage) -> None:
        """A worker rank's step (tensor or pipeline parallel): rank 0's, run over this rank's shard and
        stage, up to the logits every rank of the last stage gathers (and its tensor-parallel rank 0 sends
        to rank 0: the same logits calls, in the same order, as rank 0's execute makes); nothing is sampled
        here. A stage before the last is done once its forward has sent its hidden states on."""
        so = message.so
        self._forget(so.finished_req_ids)
        self.kv_tensors.move(so.block_copies, so.swap_out, so.swap_in, so.offload)
        if not so.scheduled:
            return
        step = self._prepare(so, message.drafts)
        hidden = self._forward(step)
        if not self.model.pp.is_last:
            return
        if step.score_prompts:
            self.prompt_scorer.score(step.scheduled, step.rows, hidden, {})
        self._logits(step, hidden)
        for _, drafts, start in self.verifier.rows(step):
            self.model.compute_logits(hidden[start : start + 1 + len(drafts)])

    # -- the stages -------------------------------------------------------------------------------------
    def _forget(self, finished: set[str]) -> None:
        """Per-request state of the requests that finished since the last step."""
        if not finished:
            return
        for rid in finished:
            self.generators.forget(rid)
        self.prompt_scorer.forget(finished)
        if self.grammar is not None:
            self.grammar.forget(finished)
        self.inputs.forget(finished)
        if self.proposer is not None:
            self.proposer.forget(finished)

    def _propose(self, so: SchedulerOutput) -> dict[str, list[int]]:
        """Draft tokens per speculating row, cut where a grammar rejects them (none without a proposer)."""
        drafts: dict[str, list[int]] = {}
        if self.proposer is None:
            return drafts
        wanted = [
            DraftRequest(sr.req_id, sr.all_token_ids, sr.block_table, sr.num_spec_tokens)
            for sr in so.scheduled
            if sr.num_spec_tokens and sr.all_token_ids is not None
        ]
        if wanted:
            drafts = {rid: d for rid, d in self.proposer.propose(wanted).items() if d}
        if drafts:
            self.verifier.check_drafts(so.scheduled, drafts)
        return drafts

    def _prepare(self, so: SchedulerOutput, drafts: dict[str, list[int]]) -> PreparedStep:
        """Prepare inputs: the rows into the device buffers, which rows sample and their sampling batch, the
        token rows kept past the last attention, and the attention plan (none for a graph's replay)."""
        rows: list[RowLike] = so.scheduled  # type: ignore[assignment]
        if drafts:
            # A speculating row computes its drafts' KV too: its tokens, then the drafts to verify.
            rows = [
                Row(sr.token_ids + drafts[sr.req_id], sr.start_pos, sr.block_table, sr.req_id)
                if sr.req_id in drafts
                else sr
                for sr in so.scheduled
            ]
        # Static batching's padding rows go after the real ones: decode rows into the sink block, computed
        # through the logits like any decode row, and then dropped.
        num_pad = len(so.padding_positions)
        inputs = self.inputs.fill(rows, so.padding_positions, decode=so.decode)
        meta = inputs.meta
        scheduled = so.scheduled
        num_rows = len(scheduled)
        decode_only = so.decode_only or (
            meta.num_tokens == num_rows + num_pad and all(sr.samples for sr in scheduled)
        )
        if decode_only:
            sample_rows = plain = list(range(num_rows))
        else:
            sample_rows = [i for i, sr in enumerate(scheduled) if sr.samples]
            plain = [i for i in sample_rows if scheduled[i].req_id not in drafts]
        step = PreparedStep(
            scheduled, rows, drafts, inputs, num_pad, so.score_prompts, decode_only, sample_rows, plain
        )
        if decode_only:
            step.batch, step.grammar_rows = self._decode_sampling_batch(scheduled)
        elif plain:
            step.batch, step.grammar_rows = self._sampling_batch(scheduled, plain)
        if not decode_only:
            self._keep_rows(step)
        if self.lora is not None:
            step.lora = self._lora_rows(step)
        # A graph replays the model without adapters: a step with adapter rows runs it eagerly.
        step.graphed = (
            decode_only
            and step.lora is None
            and self.graphs is not None
            and self.graphs.bucket(meta.num_reqs) is not None
        )
        if not step.graphed:
            heads = self.model.layout  # this rank's heads (all of them at world size 1)
            step.plan = self.backend.plan(meta, heads.num_heads, heads.num_kv_heads, self.config.head_dim)
        return step

    def _lora_rows(self, step: PreparedStep) -> LoRAStep | None:
        """Each token row's adapter slot (the scheduler admits no more adapters than there are slots)."""
        assert self.lora is not None
        names = [sr.lora for sr in step.scheduled]
        slot = self.lora.activate(n for n in names if n is not None)
        token_slots: list[int] = []
        for name, n in zip(names, step.meta.query_lens_host):
            token_slots += [slot[name] if name is not None else -1] * n
        token_slots += [-1] * (step.meta.num_tokens - len(token_slots))  # static batching's padding rows
        triton = self.lora.kernel == "triton"
        return LoRAStep.of(token_slots, step.kept_rows, self.lora.max_loras, self.device, triton)

    def _keep_rows(self, step: PreparedStep) -> None:
        """Past a mixed step's last attention only the rows that sample go on (the logits' rows, then each
        speculating row's verify rows); a step scoring its prompts needs them all. The token-row indices
        are worked out on the host, from the lengths the fill has there (reading query_start_loc back
        would be a sync per row), and go to the device in one pinned copy."""
        meta, num_pad, drafts = step.meta, step.num_pad, step.drafts
        row_starts = step.row_starts = list(accumulate(meta.query_lens_host, initial=0))
        # The logits' rows: each sampled row's last token, then the padding rows' (the last num_pad).
        logit_rows = [row_starts[i + 1] - 1 for i in step.plain] if step.plain else []
        logit_rows += range(meta.num_tokens - num_pad, meta.num_tokens)
        if step.score_prompts:
            if step.plain:
                step.last = self.inputs.index(logit_rows)
            return
        kept = logit_rows
        for i in step.sample_rows:
            rid = step.scheduled[i].req_id
            if rid in drafts:
                step.verify_at[rid] = len(kept)
                start = row_starts[i]
                kept += range(start, start + 1 + len(drafts[rid]))
        step.keep = self.inputs.index(kept)
        step.kept_rows = kept

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        """The model over the step's tokens: a captured graph's replay, or the model itself."""
        if step.graphed:
            assert self.graphs is not None
            graph_hidden = self.graphs.forward(step.inputs.input_ids, step.inputs.positions, step.meta)
            assert graph_hidden is not None  # bucket() said one holds it
            return graph_hidden
        assert step.plan is not None
        return self.model(
            step.inputs.input_ids,
            step.inputs.positions,
            self.kv_caches,
            step.meta,
            step.plan,
            step.keep,
            step.lora,
        )

    def _logits(self, step: PreparedStep, hidden: torch.Tensor) -> torch.Tensor | None:
        """The plain rows' logits, the padding rows' after them (None when no real row samples)."""
        num_pad = step.num_pad
        if not step.plain:
            if num_pad:
                # No real row samples this step (prefill chunks mid-prompt); the padding rows' decode still
                # computes its logits, as a held slot's would.
                self.model.compute_logits(
                    hidden[:num_pad] if step.keep is not None else hidden[step.meta.num_tokens - num_pad :]
                )
            return None
        # A decode-only step's hidden rows are its last tokens, in row order (the padding rows last);
        # a kept step's start with them.
        if step.decode_only:
            sampled_hidden = hidden
        elif step.keep is not None:
            sampled_hidden = hidden[: len(step.plain) + num_pad]
        else:
            assert step.last is not None
            sampled_hidden = hidden[step.last]
        return self.model.compute_logits(sampled_hidden)

    def _sample(
        self, step: PreparedStep, hidden: torch.Tensor, reads: list[torch.Tensor]
    ) -> SamplerOutput | None:
        """The plain rows' logits, sampled on the device; their ids queued for the step's one read."""
        if not step.plain:
            self._logits(step, hidden)
            return None
        assert step.batch is not None
        # Filled on the host while a GPU runs the forward queued above.
        grammar_mask = self._grammar_mask(step.grammar_rows) if step.grammar_rows else None
        logits = self._logits(step, hidden)
        assert logits is not None
        # Padding rows' logits are computed and discarded: only the real rows sample.
        result = self.sampler(logits[: len(step.plain)] if step.num_pad else logits, step.batch, grammar_mask)
        reads.append(result.token_ids)
        return result

    def _decode_sampling_batch(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[SamplingBatch, list[GrammarRow]]:
        """A decode-only step's batch: the last one's again when the rows are the same requests in the same
        order (the scheduler's steady state keeps each request's row object) and nothing reads the outputs."""
        cached = self._decode_batch
        if (
            cached is not None
            and len(cached[0]) == len(scheduled)
            and all(map(operator.is_, cached[0], scheduled))
        ):
            return cached[1], cached[2]
        batch, grammar_rows = self._sampling_batch(scheduled, range(len(scheduled)))
        # Penalties read each step's outputs; every other field is fixed for a request's life (a grammar's
        # rows too: their masks are made each step from the matchers, not kept here).
        self._decode_batch = None if batch.any_penalty else (scheduled, batch, grammar_rows)
        return batch, grammar_rows

    def _sampling_batch(
        self, scheduled: list[ScheduledRequest], rows: Sequence[int]
    ) -> tuple[SamplingBatch, list[GrammarRow]]:
        params = []
        outputs = []
        generators = []
        grammar_rows = []
        for j, i in enumerate(rows):
            sr = scheduled[i]
            p = sr.sampling_params
            params.append(p)
            outputs.append(sr.output_token_ids or ())
            generators.append(self.generators.get(sr.req_id, p))
            if p.structured is not None:
                grammar_rows.append(GrammarRow(j, sr.req_id, p.structured))
        return SamplingBatch.build(params, outputs, generators, self.device), grammar_rows

    # -- structured outputs -----------------------------------------------------------------------------
    def _grammars(self) -> GrammarState:
        return require_grammar(self.grammar)

    def _grammar_mask(self, rows: list[GrammarRow]) -> GrammarMask:
        return self._grammars().mask(rows)

    def _advance_grammars(self, rows: list[GrammarRow], tokens: list[int]) -> None:
        grammar = self._grammars()
        for r in rows:
            grammar.accept(r.req_id, r.spec, (tokens[r.row],))

    @staticmethod
    def _read_back(tensors: list[torch.Tensor]) -> list[int]:
        """The step's one device-to-host read (and so its one sync): every id it samples, in order."""
        if not tensors:
            return []
        return (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).tolist()
