"""Batched sampler: every parameter is a per-row tensor, so one request's settings never reach another row.

The order per row is the usual one (vLLM, Hugging Face): penalties on the raw logits, then greedy rows take
the argmax; sampled rows are divided by their temperature, cut by top-k then top-p, and sampled with the
exponential race (argmax of probs / q, q ~ Exp(1)), which needs no cumulative sum and no host round trip.

Seeded rows draw their q from their own generator, one full-vocabulary row per step, so a seeded request's
tokens depend only on its own logits and its own generator: not on its companions or its row index. Every
other row operation here is row-local (row-wise reductions, a row-wise sort), for the same reason.

Structured outputs: the rows with a grammar get its token mask (a GrammarMask, filled on the host by
llguidance and copied once) before anything else, so a disallowed token is -inf for greedy and sampled rows
alike; the other rows are not touched (one index_copy of the masked rows, out of place).

Nothing here reads a tensor back to the host; the caller's `.tolist()` of the token ids is the one sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.kernels import argmax, exponential_race, exponential_race_available


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator a seeded request owns for its whole life (it must persist across steps)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class RequestGenerators:
    """The seeded requests' generators, one per request for its whole life, made on its first sampled row.
    One owner for the sampler's rows and the draft verifier's alike (a callback into the runner would tie
    the runner into a reference cycle, freed only by the garbage collector)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def get(self, req_id: str, params: SamplingParams) -> torch.Generator | None:
        """The request's generator; None for a greedy or unseeded one (it draws from the step's own)."""
        if params.seed is None or params.greedy:
            return None
        gen = self._generators.get(req_id)
        if gen is None:
            gen = self._generators[req_id] = make_generator(params.seed, self.device)
        return gen

    def forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)


def _to_device_array(values: np.ndarray, dtype: torch.dtype, device: torch.device) -> Tensor:
    t = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _to_device(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> Tensor:
    # Through pinned memory with non_blocking, a host-to-GPU copy does not wait for queued kernels.
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


@dataclass
class SamplingBatch:
    """One row per request that samples this step, in the logits' row order."""

    temperature: Tensor  # [n] float32; 0 = greedy
    top_k: Tensor  # [n] int64; 0 = disabled
    top_p: Tensor  # [n] float32; 1 = disabled
    presence_penalty: Tensor  # [n] float32
    frequency_penalty: Tensor  # [n] float32
    # Generated tokens per row, only built when some row has a penalty (rows without one get []).
    output_token_ids: list[list[int]] | None
    # Per-row generator for seeded sampled rows; None rows draw from the default generator.
    generators: list[torch.Generator | None]
    max_num_logprobs: int  # the most top log-probs any row asked for; 0 = none
    all_greedy: bool
    any_penalty: bool
    any_top_k_or_p: bool  # some sampled (non-greedy) row has top-k or top-p enabled
    # Some row asked for log-probs, possibly only the sampled token's (logprobs=0).
    any_logprobs: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
    ) -> SamplingBatch:
        if not len(params) == len(output_token_ids) == len(generators):
            raise ValueError(
                f"params ({len(params)}), output_token_ids ({len(output_token_ids)}) and generators "
                f"({len(generators)}) must have one entry per row"
            )
        device = torch.device(device)
        row_generators: list[torch.Generator | None] = []
        all_greedy = True
        any_penalty = any_top_k_or_p = any_logprobs = False
        max_num_logprobs = 0
        for p, g in zip(params, generators):
            greedy = p.greedy
            if greedy:
                # A greedy row never draws, so its generator's state cannot depend on its companions.
                row_generators.append(None)
            else:
                if p.seed is not None and g is None:
                    # Silently falling back to the shared generator would make a seeded request irreproducible.
                    raise ValueError(f"a row with seed={p.seed} needs its generator (see make_generator)")
                row_generators.append(g)
                all_greedy = False
                if p.top_k > 0 or p.top_p < 1.0:
                    any_top_k_or_p = True
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                any_penalty = True
            if p.logprobs is not None:
                any_logprobs = True
                max_num_logprobs = max(max_num_logprobs, p.logprobs)
        penalty_outputs = (
            [list(ids) if p.has_penalty else [] for p, ids in zip(params, output_token_ids)]
            if any_penalty
            else None
        )
        if all_greedy and not any_penalty:
            # The argmax needs no per-row parameter: the common serving case builds no tensor at all.
            none = torch.empty(0, device=device)
            return cls(
                none,
                none,
                none,
                none,
                none,
                None,
                row_generators,
                max_num_logprobs,
                True,
                False,
                False,
                any_logprobs,
            )
        # A huge temperature becomes inf in float32, as torch.tensor would make it: no warning for that.
        with np.errstate(over="ignore"):
            table = np.array(
                [(p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty, p.top_k) for p in params],
                dtype=np.float32,
            )
        floats = _to_device_array(table[:, :4], torch.float32, device)
        return cls(
            temperature=floats[:, 0],
            top_k=_to_device_array(table[:, 4].astype(np.int64), torch.int64, device),
            top_p=floats[:, 1],
            presence_penalty=floats[:, 2],
            frequency_penalty=floats[:, 3],
            output_token_ids=penalty_outputs,
            generators=row_generators,
            max_num_logprobs=max_num_logprobs,
            all_greedy=all_greedy,
            any_penalty=any_penalty,
            any_top_k_or_p=any_top_k_or_p,
            any_logprobs=any_logprobs,
        )


@dataclass(frozen=True)
class GrammarMask:
    """The step's token masks for the rows that have a grammar, in one int32 tensor on the logits' device:
    `num_rows` bitmasks of `words` int32 each (bit t of word t // 32 set = token t allowed, llguidance's
    layout), then the `num_rows` row indices they apply to."""

    packed: Tensor  # [num_rows * words + num_rows] int32
    num_rows: int
    words: int

    @property
    def bits(self) -> Tensor:
        return self.packed[: self.num_rows * self.words].view(self.num_rows, self.words)

    @property
    def rows(self) -> Tensor:
        return self.packed[self.num_rows * self.words :].long()


def unpack_bitmask(bits: Tensor, vocab_size: int) -> Tensor:
    """[m, words] int32 bitmasks -> [m, vocab_size] bool (True = allowed); tokens past the mask's width are
    not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(bits.shape[0], -1)
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bits.shape[0], vocab_size - width, dtype=torch.bool, device=bits.device)
    return torch.cat([allowed, pad], dim=1)


def apply_grammar_mask(logits: Tensor, mask: GrammarMask) -> Tensor:
    """`logits` with every token its row's grammar disallows set to -inf, in a new tensor; the rows
    without a grammar come back bit-exact."""
    rows = mask.rows
    allowed = unpack_bitmask(mask.bits, logits.shape[-1])
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [n] int64
    # [n] float32: log-prob of the chosen token under the raw model distribution (log_softmax of the logits
    # before penalties, temperature and truncation), as OpenAI reports it. None when no row asked.
    logprobs: Tensor | None
    # ([n, max_num_logprobs] int64 ids, float32 values) of the raw distribution, best first.
    top_logprobs: tuple[Tensor, Tensor] | None


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """OpenAI's penalties: logits[t] -= presence * (count[t] > 0) + frequency * count[t], where count is
    over the row's generated tokens. Returns a new tensor; rows with zero penalties come back bit-exact."""
    if not batch.any_penalty or batch.output_token_ids is None:
        return logits
    num_rows, vocab_size = logits.shape
    max_len = max((len(ids) for ids in batch.output_token_ids), default=0)
    if max_len == 0:
        return logits
    # Pad with an extra column past the vocabulary that the counts then drop, so ragged rows scatter at once.
    padded = [ids + [vocab_size] * (max_len - len(ids)) for ids in batch.output_token_ids]
    index = _to_device(padded, torch.int64, logits.device)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=logits.dtype))
    counts = counts[:, :vocab_size]
    penalty = (
        batch.presence_penalty.unsqueeze(1) * (counts > 0) + batch.frequency_penalty.unsqueeze(1) * counts
    )
    return logits - penalty


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) what falls outside each row's top k, then outside its nucleus of mass top_p.

    One sort for the whole batch; the cut-offs are per-row tensors. top_k counts positions, so exactly k
    tokens survive even among ties. A row with top_k = 0 and top_p = 1 comes back unchanged.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
    positions = torch.arange(vocab_size, device=logits.device)
    mask = positions.unsqueeze(0) < (vocab_size - k).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))

    probs = sorted_logits.softmax(dim=-1)
    # Ascending order: a token is outside the nucleus when everything above it already holds mass >= p,
    # i.e. when the mass at or below it is <= 1 - p. The top token always stays. Rows with p = 1 are
    # exempt (their underflowed zeros would match) so that they come back bit-exact.
    outside = probs.cumsum(dim=-1) <= (1.0 - top_p).unsqueeze(1)
    outside[:, -1] = False
    outside &= (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


class Sampler:
    def __call__(
        self, logits: Tensor, batch: SamplingBatch, grammar: GrammarMask | None = None
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [{batch.num_rows}, vocab], got {tuple(logits.shape)}")
        raw = logits.float()
        penalised = apply_penalties(raw, batch)
        if grammar is not None and grammar.num_rows:
            # Log-probs stay those of the raw distribution (`raw` is left as it is).
            penalised = apply_grammar_mask(penalised, grammar)

        if batch.all_greedy:
            token_ids = argmax(penalised)
        else:
            token_ids = self._sample(penalised, batch)

        chosen_logprobs: Tensor | None = None
        top_logprobs: tuple[Tensor, Tensor] | None = None
        if batch.any_logprobs or batch.max_num_logprobs > 0:
            raw_logprobs = raw.log_softmax(dim=-1)
            chosen_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            if batch.max_num_logprobs > 0:
                k = min(batch.max_num_logprobs, raw_logprobs.shape[-1])
                values, ids = raw_logprobs.topk(k, dim=-1)
                top_logprobs = (ids, values)
        return SamplerOutput(token_ids=token_ids, logprobs=chosen_logprobs, top_logprobs=top_logprobs)

    @staticmethod
    def _sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
        greedy = (batch.temperature == 0.0) | (batch.top_k == 1)
        # Greedy rows take the argmax below; a stand-in temperature keeps their throwaway sample finite.
        temperature = torch.where(greedy, 1.0, batch.temperature).unsqueeze(1)
        if exponential_race_available(logits):
            sampled = Sampler._race_on_cpu(logits, temperature, batch)
            return torch.where(greedy, argmax(logits), sampled)
        # Shifting by the row max first keeps a tiny temperature from overflowing to inf (inf - inf = nan).
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
        if batch.any_top_k_or_p:
            scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
        probs = scaled.softmax(dim=-1)

        q = torch.empty_like(probs)
        q.exponential_()
        for row, generator in enumerate(batch.generators):
            if generator is not None:
                q[row].exponential_(generator=generator)
        # exponential_ may return exactly 0, and 0 / 0 would let a masked token win the race.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        sampled = argmax(probs / q)
        return torch.where(greedy, argmax(logits), sampled)

    @staticmethod
    def _race_on_cpu(logits: Tensor, temperature: Tensor, batch: SamplingBatch) -> Tensor:
        """The same race in one kernel pass (kernels.exponential_race): its uniforms come from a seed per
        row, drawn from the row's own generator when it has one, else from torch's global one."""
        seeds = torch.randint(0, 1 << 62, (logits.shape[0],), dtype=torch.int64)
        for row, generator in enumerate(batch.generators):
            if generator is not None:
                seeds[row] = int(torch.randint(0, 1 << 62, (1,), generator=generator))
        if batch.any_top_k_or_p:
            scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
            scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
            return exponential_race(scaled, torch.ones(logits.shape[0]), seeds)
        return exponential_race(logits, temperature.squeeze(1).reciprocal(), seeds)
