"""SchedulerOutput -> tensors -> forward -> sample. Knows nothing of policies; owns the KV tensors."""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import torch

from chunkwise.attention.backend import AttentionBackend, kv_cache_shape
from chunkwise.config import ModelConfig
from chunkwise.kernels import argmax
from chunkwise.model.llama import LlamaForCausalLM
from chunkwise.outputs import TokenLogprob
from chunkwise.sampler import (
    GrammarMask,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_grammar_mask,
    apply_top_k_top_p,
    make_generator,
)
from chunkwise.sampling_params import SamplingParams
from chunkwise.sched.output import ScheduledRequest, SchedulerOutput
from chunkwise.speculative.verify import finish_sampled, sampled_decisions, verify_greedy
from chunkwise.structured.compiler import GrammarCompiler
from chunkwise.structured.state import GrammarRow, GrammarState
from chunkwise.worker.cuda_graphs import DecodeGraphRunner
from chunkwise.worker.inputs import InputBatch, Row, RowLike


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # A decode-only step's tokens in row order, one a row, instead of `sampled` (no per-row dict to build
    # and look up at hundreds of rows).
    row_tokens: list[int] | None = None
    # Per sampled request, per token: (chosen logprob, [(id, logprob) of the top alternatives]).
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)
    # Per request whose prompt is now all scored: its prompt tokens' log-probs (SamplingParams.prompt_logprobs).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Draft tokens proposed per speculating request (the accepted ones are in `sampled`, before its last).
    drafted: dict[str, int] = field(default_factory=dict)
    # Host work before the forward: drafts, inputs, the attention plan, the sampling parameters.
    prepare_seconds: float = 0.0
    # The model, the logits and the sampler's tensor work, up to the sampled ids back on the host.
    forward_seconds: float = 0.0
    # Turning sampled ids (and log-probs) into per-request lists.
    sample_seconds: float = 0.0


@dataclass(frozen=True)
class DraftRequest:
    req_id: str
    token_ids: list[int]  # the request's known tokens (live reference: do not modify)
    block_table: list[int]  # slots are allocated up to len(token_ids) + k
    k: int


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Up to k draft tokens per request (fewer, or none, when it has no good guess)."""
        ...

    def forget(self, req_ids: set[str]) -> None: ...


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
        # One block more than the pool hands out: the sink that padding rows write into, those of a bucketed
        # decode step (worker/cuda_graphs.py) and static batching's held slots (SchedulerOutput).
        self.sink_block = num_blocks
        shape = kv_cache_shape(num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        ]
        host_shape = kv_cache_shape(num_host_blocks, block_size, config.num_key_value_heads, config.head_dim)
        pin = device.type == "cuda"
        # Host slots are always written (swap-out) before they are read (swap-in): leave them untouched, so
        # a large swap space costs no start-up time and no resident memory until used.
        self.host_caches = [
            torch.empty(host_shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_hidden_layers)
        ]
        self.sampler = Sampler()
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphRunner | None = None
        self.inputs = InputBatch(
            max_num_tokens=max_num_tokens,
            max_num_reqs=max_num_reqs,
            max_blocks_per_req=-(-max_model_len // block_size),
            block_size=block_size,
            device=device,
            sink_block=self.sink_block,
        )
        # Per-request sampling state that must persist across steps: a seeded request's generator.
        self._generators: dict[str, torch.Generator] = {}
        # Prompt log-probs scored so far per request, and the requests already handed theirs over.
        self._prompt_scores: dict[str, list[TokenLogprob]] = {}
        self._prompt_scored: set[str] = set()
        # The last decode-only step's rows, their sampling batch and grammar rows (see _decode_sampling_batch).
        self._decode_batch: tuple[list[ScheduledRequest], SamplingBatch, list[GrammarRow]] | None = None
        # Structured outputs: each constrained request's matcher (None: this runner refuses such rows).
        self.grammar = GrammarState(grammars, device) if grammars is not None else None

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

    # -- KV movement ------------------------------------------------------------------------------------
    def _index(self, values: list[int]) -> torch.Tensor:
        """Block ids on the device, copied from pinned memory without blocking (torch.tensor(..., device=)
        copies from pageable memory, which waits)."""
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=pin)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write within the device cache: (source block, new block) pairs."""
        if not pairs:
            return
        s = self._index([p[0] for p in pairs])
        d = self._index([p[1] for p in pairs])
        for layer in self.kv_caches:
            # index_copy_, not `dst[:, d] = ...`: the indexed assignment goes through index_put_, which on
            # a 2-thread CPU took ~8 ms per layer for a few blocks against ~10 us here.
            layer.index_copy_(1, d, layer.index_select(1, s))

    def _swap_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One transfer between a host slot run and the device: both sides contiguous, the host side a view
        of the pinned host cache itself, so on a GPU it is a DMA that the host does not wait for."""
        dst.copy_(src, non_blocking=True)

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host slot) pairs: each layer's blocks gathered on the device, then copied run by
        run of consecutive host slots straight into the host cache.

        Nothing waits: the host never reads the host cache itself, and every later use of these device
        blocks (a new owner's writes) or host slots (a swap-in's reads) is queued behind these copies on the
        same stream. The old path's `.to(cpu)` of each layer was a blocking copy into pageable memory:
        a sync per layer."""
        if not pairs:
            return
        pairs = sorted(pairs, key=operator.itemgetter(1))
        blocks = self._index([b for b, _ in pairs])
        runs = _runs([slot for _, slot in pairs])
        for device_layer, host_layer in zip(self.kv_caches, self.host_caches):
            staged = device_layer.index_select(1, blocks)  # [2, n, ...]: contiguous, in slot order
            for j, first, n in runs:
                for plane in range(2):  # keys, values: each run of a plane is one contiguous range
                    self._swap_copy(host_layer[plane, first : first + n], staged[plane, j : j + n])

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host slot, device block) pairs: runs of consecutive host slots copied into a device staging
        tensor, then scattered into the blocks on the device (see _swap_out for why nothing waits)."""
        if not pairs:
            return
        pairs = sorted(pairs, key=operator.itemgetter(0))
        blocks = self._index([b for _, b in pairs])
        runs = _runs([slot for slot, _ in pairs])
        for device_layer, host_layer in zip(self.kv_caches, self.host_caches):
            staged = torch.empty(
                (2, len(pairs), *device_layer.shape[2:]), dtype=device_layer.dtype, device=device_layer.device
            )
            for j, first, n in runs:
                for plane in range(2):
                    self._swap_copy(staged[plane, j : j + n], host_layer[plane, first : first + n])
            device_layer.index_copy_(1, blocks, staged)

    def measure_host_copy_bandwidth(self, num_blocks: int = 8, repeats: int = 3) -> float:
        """Bytes/s of a device->host->device round trip of `num_blocks` blocks, as swap would move them."""
        n = min(num_blocks, self.kv_caches[0].shape[1], self.host_caches[0].shape[1])
        if n == 0:
            return 1.0
        pairs = [(i, i) for i in range(n)]
        moved = sum(t[:, :n].numel() * t.element_size() for t in self.kv_caches) * 2
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self._swap_out(pairs)
            self._swap_in(pairs)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return moved / max(best, 1e-9)

    # -- one step ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self._generators.pop(rid, None)
            self._prompt_scores.pop(rid, None)
            self._prompt_scored.discard(rid)
        if self.grammar is not None and so.finished_req_ids:
            self.grammar.forget(so.finished_req_ids)
        if so.finished_req_ids:
            self.inputs.forget(so.finished_req_ids)
            if self.proposer is not None:
                self.proposer.forget(so.finished_req_ids)
        if so.block_copies:
            # Copy-on-write (a forked request's partial block), first: a swap-out this step may take the copy.
            self._copy_blocks(list(so.block_copies))
        # A step swaps out (it preempted) or in (it admitted), never both: the scheduler admits nothing in a
        # step that preempts (tests/runtime/test_scheduler_stress.py checks it), so their order is moot.
        self._swap_out(so.swap_out)
        self._swap_in(so.swap_in)
        if not so.scheduled:
            return ModelRunnerOutput()

        t0 = time.perf_counter()
        drafts: dict[str, list[int]] = {}
        if self.proposer is not None:
            wanted = [
                DraftRequest(sr.req_id, sr.all_token_ids, sr.block_table, sr.num_spec_tokens)
                for sr in so.scheduled
                if sr.num_spec_tokens and sr.all_token_ids is not None
            ]
            if wanted:
                drafts = {rid: d for rid, d in self.proposer.propose(wanted).items() if d}
            if drafts:
                self._check_drafts(so.scheduled, drafts)
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
        step = self.inputs.fill(rows, so.padding_positions, decode=so.decode)
        meta = step.meta
        scheduled = so.scheduled
        num_rows = len(scheduled)
        # Every row one token that samples (a one-token chunk mid-prompt does not), none speculating.
        decode_only = so.decode_only or (
            meta.num_tokens == num_rows + num_pad and all(sr.samples for sr in scheduled)
        )
        if decode_only:
            sample_rows = plain = list(range(num_rows))
        else:
            sample_rows = [i for i, sr in enumerate(scheduled) if sr.samples]
            plain = [i for i in sample_rows if scheduled[i].req_id not in drafts]
        batch = None
        grammar_rows: list[GrammarRow] = []
        if decode_only:
            batch, grammar_rows = self._decode_sampling_batch(scheduled)
        elif plain:
            batch, grammar_rows = self._sampling_batch(scheduled, plain)
        # Past a mixed step's last attention only the rows that sample go on (the logits' rows, then each
        # speculating row's verify rows); a step scoring its prompts needs them all. The token-row indices
        # are worked out on the host, from the lengths the fill has there (reading query_start_loc back
        # would be a sync per row), and go to the device in one pinned copy.
        keep = last = None
        verify_at: dict[str, int] = {}
        row_starts: list[int] = []
        if not decode_only:
            row_starts = list(accumulate(meta.query_lens_host, initial=0))
            # The logits' rows: each sampled row's last token, then the padding rows' (the last num_pad).
            logit_rows = [row_starts[i + 1] - 1 for i in plain] if plain else []
            logit_rows += range(meta.num_tokens - num_pad, meta.num_tokens)
            if so.score_prompts:
                if plain:
                    last = self.inputs.index(logit_rows)
            else:
                kept = logit_rows
                for i in sample_rows:
                    rid = scheduled[i].req_id
                    if rid in drafts:
                        verify_at[rid] = len(kept)
                        start = row_starts[i]
                        kept += range(start, start + 1 + len(drafts[rid]))
                keep = self.inputs.index(kept)
        graphed = decode_only and self.graphs is not None and self.graphs.bucket(meta.num_reqs) is not None
        if not graphed:
            cfg = self.config
            plan = self.backend.plan(meta, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        t1 = time.perf_counter()

        out = ModelRunnerOutput(prepare_seconds=t1 - t0)
        if graphed:
            assert self.graphs is not None
            graph_hidden = self.graphs.forward(step.input_ids, step.positions, meta)
            assert graph_hidden is not None  # bucket() said one holds it
            hidden = graph_hidden
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta, plan, keep)
        if so.score_prompts:
            self._score_prompts(scheduled, rows, hidden, out)
        result = None
        reads: list[torch.Tensor] = []
        if plain:
            assert batch is not None
            # Filled on the host while a GPU runs the forward queued above.
            grammar_mask = self._grammar_mask(grammar_rows) if grammar_rows else None
            # A decode-only step's hidden rows are its last tokens, in row order (the padding rows last);
            # a kept step's start with them.
            if decode_only:
                sampled_hidden = hidden
            elif keep is not None:
                sampled_hidden = hidden[: len(plain) + num_pad]
            else:
                assert last is not None
                sampled_hidden = hidden[last]
            logits = self.model.compute_logits(sampled_hidden)
            # Padding rows' logits are computed and discarded: only the real rows sample.
            result = self.sampler(logits[: len(plain)] if num_pad else logits, batch, grammar_mask)
            reads.append(result.token_ids)
        elif num_pad:
            # No real row samples this step (prefill chunks mid-prompt); the padding rows' decode still
            # computes its logits, as a held slot's would.
            self.model.compute_logits(
                hidden[:num_pad] if keep is not None else hidden[meta.num_tokens - num_pad :]
            )
        # Speculating rows: each one's verify queued on the device (a greedy row's argmax, a sampled row's
        # rejection-sampling decisions) and read back with the sampled tokens: a read per row, or per draft,
        # would be a sync each.
        verifying: list[tuple[ScheduledRequest, list[int], int]] = []
        for i in sample_rows:
            sr = scheduled[i]
            if sr.req_id in drafts:
                row_drafts = drafts[sr.req_id]
                start = verify_at[sr.req_id] if keep is not None else row_starts[i]
                logits = self._verify_logits(sr, row_drafts, hidden, start)
                params = sr.sampling_params
                if params.greedy:
                    reads.append(argmax(logits))
                else:
                    probs = _target_probs(logits, params)
                    reads.append(sampled_decisions(probs, row_drafts, None, self._generator(sr)))
                verifying.append((sr, row_drafts, len(reads[-1])))
        host = self._read_back(reads)
        tokens = host[: len(plain)]
        if grammar_rows:
            self._advance_grammars(grammar_rows, tokens)
        t2 = time.perf_counter()
        if plain:
            assert result is not None
            self._emit_plain(so, plain, tokens, result, out)
        offset = len(plain)
        for sr, row_drafts, n in verifying:
            values = host[offset : offset + n]
            offset += n
            greedy = sr.sampling_params.greedy
            accepted = verify_greedy(values, row_drafts) if greedy else finish_sampled(values, row_drafts)
            self._accept(sr, row_drafts, accepted, out)
        t3 = time.perf_counter()
        out.forward_seconds = t2 - t1
        out.sample_seconds = t3 - t2
        return out

    def _score_prompts(
        self,
        scheduled: list[ScheduledRequest],
        rows: Sequence[RowLike],
        hidden: torch.Tensor,
        out: ModelRunnerOutput,
    ) -> None:
        """Prompt log-probs: each position of a prompt chunk scored against the prompt's next token, kept
        per request until the whole prompt is scored, then handed over once. A rare, costly request (logits
        for every prompt position, a host sync per chunk), kept out of every other row's way."""
        offset = 0
        for sr, row in zip(scheduled, rows):
            start, n = offset, len(row.token_ids)
            offset += n
            prompt = sr.prompt_token_ids
            if prompt is None or sr.req_id in self._prompt_scored:
                continue
            if sr.start_pos == 0:
                self._prompt_scores[sr.req_id] = []  # (re)started from the first token: a recompute restarts
            scores = self._prompt_scores.get(sr.req_id)
            if scores is None or len(scores) != sr.start_pos:
                continue  # resumed past positions it never scored (a forked sequence): not its to report
            # Positions start_pos .. start_pos + m - 1 predict prompt tokens start_pos + 1 .. start_pos + m.
            m = min(n, len(prompt) - 1 - sr.start_pos)
            if m > 0:
                logprobs = self.model.compute_logits(hidden[start : start + m]).float().log_softmax(dim=-1)
                targets = prompt[sr.start_pos + 1 : sr.start_pos + 1 + m]
                target_t = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
                chosen = logprobs.gather(1, target_t)
                ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
                k = sr.sampling_params.prompt_logprobs or 0
                top_ids: list[list[int]] = [[] for _ in range(m)]
                top_vals: list[list[float]] = [[] for _ in range(m)]
                if k:
                    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
                    top_ids, top_vals = ids.tolist(), values.tolist()
                for t, v, r, ti, tv in zip(targets, chosen.squeeze(1).tolist(), ranks, top_ids, top_vals):
                    scores.append(TokenLogprob(t, v, list(zip(ti, tv)), rank=r))
            if sr.start_pos + n >= len(prompt) - 1:
                out.prompt_logprobs[sr.req_id] = self._prompt_scores.pop(sr.req_id)
                self._prompt_scored.add(sr.req_id)

    def _generator(self, sr: ScheduledRequest) -> torch.Generator | None:
        seed = sr.sampling_params.seed
        if seed is None or sr.sampling_params.greedy:
            return None
        gen = self._generators.get(sr.req_id)
        if gen is None:
            gen = self._generators[sr.req_id] = make_generator(seed, self.device)
        return gen

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
            generators.append(None if p.seed is None or p.greedy else self._generator(sr))
            if p.structured is not None:
                grammar_rows.append(GrammarRow(j, sr.req_id, p.structured))
        return SamplingBatch.build(params, outputs, generators, self.device), grammar_rows

    # -- structured outputs -----------------------------------------------------------------------------
    def _grammars(self) -> GrammarState:
        if self.grammar is None:
            raise RuntimeError("a request has structured outputs, but this runner has no grammar compiler")
        return self.grammar

    def _grammar_mask(self, rows: list[GrammarRow]) -> GrammarMask:
        return self._grammars().mask(rows)

    def _advance_grammars(self, rows: list[GrammarRow], tokens: list[int]) -> None:
        grammar = self._grammars()
        for r in rows:
            grammar.accept(r.req_id, r.spec, (tokens[r.row],))

    def _check_drafts(self, scheduled: list[ScheduledRequest], drafts: dict[str, list[int]]) -> None:
        """Cut each constrained request's draft at the first token its grammar rejects (none left: no draft)."""
        for sr in scheduled:
            spec = sr.sampling_params.structured
            if spec is None or sr.req_id not in drafts:
                continue
            kept = self._grammars().valid_prefix(sr.req_id, spec, drafts[sr.req_id])
            if kept:
                drafts[sr.req_id] = kept
            else:
                del drafts[sr.req_id]

    def _emit_plain(
        self,
        so: SchedulerOutput,
        rows: list[int],
        tokens: list[int],
        result: SamplerOutput,
        out: ModelRunnerOutput,
    ) -> None:
        if so.decode_only:
            out.row_tokens = tokens
        else:
            sampled = out.sampled
            for i, tok in zip(rows, tokens):
                sampled[so.scheduled[i].req_id] = [tok]
        if result.logprobs is None:
            return
        chosen = result.logprobs.tolist()
        top_ids = top_vals = None
        if result.top_logprobs is not None:
            top_ids, top_vals = (t.tolist() for t in result.top_logprobs)
        for row, i in enumerate(rows):
            sr = so.scheduled[i]
            k = sr.sampling_params.logprobs
            if k is not None:
                top = list(zip(top_ids[row][:k], top_vals[row][:k])) if k and top_ids and top_vals else []
                out.logprobs[sr.req_id] = [(chosen[row], top)]

    @staticmethod
    def _read_back(tensors: list[torch.Tensor]) -> list[int]:
        """The step's one device-to-host read (and so its one sync): every id it samples, in order."""
        if not tensors:
            return []
        return (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).tolist()

    def _verify_logits(
        self, sr: ScheduledRequest, drafts: list[int], hidden: torch.Tensor, start: int
    ) -> torch.Tensor:
        """One forward scored the last known token and every draft: their logits, grammar-masked."""
        # Row j predicts the token after position start_pos + j: rows 0..k-1 judge the drafts, row k is the bonus.
        logits = self.model.compute_logits(hidden[start : start + 1 + len(drafts)])
        spec = sr.sampling_params.structured
        if spec is not None:
            # Position j is masked with the grammar's state after drafts[:j] (all of which it accepts).
            logits = apply_grammar_mask(logits.float(), self._grammars().draft_masks(sr.req_id, spec, drafts))
        return logits

    def _accept(
        self, sr: ScheduledRequest, drafts: list[int], tokens: list[int], out: ModelRunnerOutput
    ) -> None:
        """The drafts the target agreed with and its own next token: the request's tokens this step."""
        spec = sr.sampling_params.structured
        if spec is not None:
            self._grammars().accept(sr.req_id, spec, tokens)
        out.sampled[sr.req_id] = tokens
        out.drafted[sr.req_id] = len(drafts)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive values in ascending `slots`: (index of the run's first, its value, its length)."""
    runs: list[tuple[int, int, int]] = []
    for j, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((j, slot, 1))
    return runs


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, then top-k and top-p, as the sampler does."""
    scaled = (logits.float() - logits.float().amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        n = scaled.shape[0]
        top_k = torch.full((n,), params.top_k, dtype=torch.long, device=scaled.device)
        top_p = torch.full((n,), params.top_p, dtype=torch.float32, device=scaled.device)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)
