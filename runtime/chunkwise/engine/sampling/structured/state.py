"""The model runner's per-request grammar state: one llguidance matcher per sequence id, made lazily from
the request's spec, advanced by the tokens the runner samples for it, dropped when the request leaves.

A matcher follows its sequence's generated tokens, which is all it needs to survive preemption (a recompute
keeps the output tokens, and the matcher stays at their end) and forking (a new sequence id starts a new
matcher from the same spec). Each step's masks are filled on the host into one buffer and copied once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from chunkwise.engine.datatypes.structured_output import StructuredOutput
from chunkwise.engine.sampling.sampler import GrammarMask
from chunkwise.engine.sampling.structured.compiler import GrammarCompiler, llg

if TYPE_CHECKING:
    import llguidance
    from llguidance import LLMatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GrammarRow:
    """A row of the step's logits whose request has a grammar."""

    row: int
    req_id: str
    spec: StructuredOutput


class GrammarState:
    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler = compiler
        self.device = device
        self.words = (compiler.vocab_size + 31) // 32
        self._matchers: dict[str, LLMatcher] = {}
        self._host: torch.Tensor | None = None
        self._executor: llguidance.LLExecutor | None = None
        # A matcher that failed (it should not: the masks only allow what it accepts) gets EOS-only masks.
        eos = np.zeros(self.words, dtype=np.uint32)
        for t in compiler.eos_token_ids:
            if t < 32 * self.words:
                eos[t // 32] |= np.uint32(1 << (t % 32))
        self._eos_only = torch.from_numpy(eos.view(np.int32))

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._matchers

    def matcher(self, req_id: str, spec: StructuredOutput) -> LLMatcher:
        m = self._matchers.get(req_id)
        if m is None:
            m = self._matchers[req_id] = self.compiler.matcher(spec)
        return m

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self._matchers.pop(rid, None)

    # -- masks ------------------------------------------------------------------------------------------
    def _buffer(self, num_ints: int) -> torch.Tensor:
        host = self._host
        if host is None or host.numel() < num_ints:
            pin = self.device.type == "cuda"
            # Reused from step to step: the step's one sync (the sampled ids) comes after the copy is consumed.
            host = self._host = torch.empty(
                max(num_ints, 2 * (host.numel() if host is not None else 0)),
                dtype=torch.int32,
                pin_memory=pin,
            )
        return host[:num_ints]

    def _fill(self, matchers: Sequence[LLMatcher], bits: torch.Tensor) -> None:
        """Row j of `bits` ([len(matchers), words], contiguous, on the host) <- matcher j's next-token mask."""
        nbytes = self.words * 4
        if len(matchers) > 1:
            if self._executor is None:
                self._executor = llg().LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m, j) for j, m in enumerate(matchers)], bits.data_ptr(), nbytes, len(matchers)
            )
        else:
            for j, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(bits[j].data_ptr(), nbytes)
        for j, m in enumerate(matchers):
            if m.is_error():
                log.warning("grammar matcher in error (%s): only EOS is allowed", m.get_error())
                bits[j].copy_(self._eos_only)

    def mask(self, rows: Sequence[GrammarRow]) -> GrammarMask:
        """The masks of these rows for this step, on the device (one host-to-device copy)."""
        n, w = len(rows), self.words
        buf = self._buffer(n * w + n)
        bits = buf[: n * w].view(n, w)
        self._fill([self.matcher(r.req_id, r.spec) for r in rows], bits)
        buf.numpy()[n * w :] = [r.row for r in rows]
        return GrammarMask(self._to_device(buf), n, w)

    def draft_masks(self, req_id: str, spec: StructuredOutput, drafts: Sequence[int]) -> GrammarMask:
        """Masks for a speculative verify: row j is the grammar's state after drafts[:j] (rows 0..k), for
        drafts the grammar accepts (see valid_prefix). The matcher is left where it was."""
        m = self.matcher(req_id, spec)
        n, w = len(drafts) + 1, self.words
        # Its own (pageable) buffer: a verify runs per request, and the shared pinned one may still be
        # in flight to the device for another row; a copy from pageable memory is done when .to() returns.
        buf = torch.empty(n * w + n, dtype=torch.int32)
        bits = buf[: n * w].view(n, w)
        consumed = 0
        for j in range(n):
            self._fill([m], bits[j : j + 1])
            if j < len(drafts):
                if not m.consume_token(drafts[j]):
                    raise RuntimeError(f"draft token {drafts[j]} was not accepted by the grammar")
                consumed += 1
        if consumed:
            m.rollback(consumed)
        buf.numpy()[n * w :] = np.arange(n, dtype=np.int32)
        return GrammarMask(buf if self.device.type == "cpu" else buf.to(self.device), n, w)

    def _to_device(self, buf: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return buf
        return buf.to(self.device, non_blocking=True)

    # -- advancing --------------------------------------------------------------------------------------
    def valid_prefix(self, req_id: str, spec: StructuredOutput, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts from the request's current state."""
        n = self.matcher(req_id, spec).validate_tokens(drafts)
        return drafts if n >= len(drafts) else drafts[:n]

    def accept(self, req_id: str, spec: StructuredOutput, tokens: Sequence[int]) -> None:
        m = self.matcher(req_id, spec)
        for t in tokens:
            if not m.consume_token(t):
                log.warning("request %s: grammar refused token %d (%s)", req_id, t, m.get_error())
                return
