"""Flat-batch inputs: token rows at their positions over a paged cache -> ids, positions, attention metadata.

`InputBatch` is the runner's: buffers sized at start-up and filled in place each step (pinned on CUDA, so the
copy to the device is one asynchronous transfer per tensor), with each request's block table kept in a
persistent row that a step only extends by the blocks added since the last one. Positions and slots are
computed for the whole step with numpy, not per token in Python. `build_batch` is the same fill into fresh
buffers, for callers that run a batch once (the draft proposer, tests).

The copies are asynchronous and only a sampling step synchronises, so consecutive prompt-only steps can leave
the device behind the host: a step's buffers must not be rewritten before the device has read them. There are
two sets of buffers, used by alternate fills, and a fence (`CopyFence`) recorded after a fill's copies; a fill
waits on its set's fence before writing into it (or regrowing it), so the host runs up to one step ahead.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from chunkwise.engine.attention.backend import AttentionMetadata
from chunkwise.engine.sched.output import DecodeStep
from chunkwise.engine.worker.fences import CopyFence, default_fence

# The token a padding row decodes (any valid id would do: its output is discarded).
PADDING_TOKEN = 0


class RowLike(Protocol):
    """What a step needs of one request (the scheduler's ScheduledRequest is one)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def start_pos(self) -> int: ...

    @property
    def block_table(self) -> Sequence[int]: ...

    @property
    def req_id(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Row:
    """One request's slice of a step: tokens at positions start_pos.. over its block table."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    # Keyed rows keep their block table in a persistent row of InputBatch across steps.
    req_id: str | None = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] on the device
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata


def _host(shape: tuple[int, ...], pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    t = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
    return t, t.numpy()


class _Buffers:
    """One set of the host buffers a step is written into and copied to the device from, and the fence of
    its last copies. Sizes are the set's own: each grows when a step it serves outgrows it."""

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, pin: bool, fence: CopyFence
    ) -> None:
        self.pin = pin
        self.max_blocks_per_req = max_blocks_per_req
        self.fence = fence
        self.alloc_tokens(max_num_tokens)
        self.alloc_reqs(max_num_reqs)

    # Called only after fence.wait(): the buffers dropped here are no copy's source any more.
    def alloc_tokens(self, n: int) -> None:
        self.view_cache: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self.max_num_tokens = n
        self.ids_t, self.ids = _host((n,), self.pin)
        self.pos_t, self.pos = _host((n,), self.pin)
        self.slots_t, self.slots = _host((n,), self.pin)
        # Token-row indices the runner derives from the step (the rows kept past the last attention): at
        # most one per token.
        self.idx_t, self.idx = _host((n,), self.pin)

    def alloc_reqs(self, n: int) -> None:
        self.view_cache = {}
        self.max_num_reqs = n
        self.qsl_t, self.qsl = _host((n + 1,), self.pin)
        self.seq_t, self.seq = _host((n,), self.pin)
        # Flat, not [n, max_blocks]: a step's [rows, width] table is its leading rows * width entries, one
        # contiguous run. A 2-D buffer's [:rows, :width] slice is strided for rows > 1, and torch copies a
        # strided source into a pageable temporary first (a blocking copy from unpinned memory).
        self.bt_t, self.bt = _host((n * self.max_blocks_per_req,), self.pin)

    def tables(self, n: int, width: int) -> np.ndarray:
        return self.bt[: n * width].reshape(n, width)

    def views(self, n: int, total: int, width: int) -> tuple[torch.Tensor, ...]:
        # A step's tensors are views of the buffers at its sizes; the steady state repeats the same sizes,
        # and six slicings a step cost more than the lookup.
        key = (n, total, width)
        views = self.view_cache.get(key)
        if views is None:
            if len(self.view_cache) >= 64:
                self.view_cache.clear()
            views = self.view_cache[key] = (
                self.qsl_t[: n + 1],
                self.seq_t[:n],
                self.bt_t[: n * width].view(n, width),
                self.slots_t[:total],
                self.ids_t[:total],
                self.pos_t[:total],
            )
        return views


class InputBatch:
    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        sink_block: int | None = None,
        fence: Callable[[], CopyFence] | None = None,
    ) -> None:
        self.block_size = block_size
        self.device = device
        # The cache block that padding rows write into: one no request owns (the runner's sink).
        self.sink_block = sink_block
        self.max_blocks_per_req = max_blocks_per_req
        self._pin = device.type == "cuda"
        # A new fence per set of buffers (the seam the tests fake): by default an event on CUDA, none on CPU.
        self._new_fence = fence if fence is not None else default_fence(device)
        # The two sets alternate between fills; the second is made on the first fill that needs it (a
        # build_batch fills once).
        self._sets: list[_Buffers] = [
            _Buffers(max_num_tokens, max_num_reqs, max_blocks_per_req, self._pin, self._new_fence())
        ]
        self._cur = 0  # the set the last fill wrote into
        self._filled = False
        # Persistent block tables: one row per live request, extended as its table grows. Per request:
        # [its row, the live list the KV manager grows, how many of its entries the row holds].
        self._tables = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self._table_state: dict[str, list] = {}
        self._free_table_rows = list(range(max_num_reqs - 1, -1, -1))
        # The last decode step's rows and their table rows: the next decode step over the same row objects
        # reuses the index and updates only the tables that grew (DecodeStep.grown).
        self._last_decode: tuple[list[RowLike], np.ndarray] | None = None

    @property
    def max_num_tokens(self) -> int:
        """The last filled set's size (each set grows on its own)."""
        return self._sets[self._cur].max_num_tokens

    @property
    def max_num_reqs(self) -> int:
        return self._sets[self._cur].max_num_reqs

    def _next_buffers(self) -> _Buffers:
        """The set this fill writes into: not the last fill's, whose copies may still be queued, and this
        one's own last copies waited for before anything is written into it or it is regrown."""
        if self._filled:
            self._cur = 1 - self._cur
        self._filled = True
        if self._cur == len(self._sets):
            last = self._sets[0]
            fresh = _Buffers(
                last.max_num_tokens, last.max_num_reqs, self.max_blocks_per_req, self._pin, self._new_fence()
            )
            self._sets.append(fresh)
        buf = self._sets[self._cur]
        buf.fence.wait()
        return buf

    # -- persistent block tables ------------------------------------------------------------------------

    def forget(self, req_ids: Sequence[str] | set[str]) -> None:
        """Release the table rows of requests that left (finished, aborted or preempted)."""
        self._last_decode = None
        for rid in req_ids:
            state = self._table_state.pop(rid, None)
            if state is not None:
                self._free_table_rows.append(state[0])

    def _table_rows(self, rows: Sequence[RowLike]) -> list[int]:
        """Each row's persistent table row, brought up to date. Unchanged tables (most, in a decode step)
        cost a dict lookup and two comparisons."""
        states = self._table_state
        index: list[int] = []
        for r in rows:
            table = r.block_table
            state = states.get(r.req_id)  # type: ignore[arg-type]
            if state is not None and state[1] is table and state[2] == len(table):
                index.append(state[0])
            else:
                index.append(self._update_table(r.req_id, table, state))
        return index

    def _decode_table_rows(self, rows: Sequence[RowLike], grown: Sequence[int]) -> np.ndarray:
        """_table_rows for a decode step: when its rows are the last decode step's row objects (the steady
        state), only the rows whose tables grew are visited."""
        last = self._last_decode
        if last is not None and len(last[0]) == len(rows) and all(map(operator.is_, last[0], rows)):
            states = self._table_state
            for i in grown:
                r = rows[i]
                self._update_table(r.req_id, r.block_table, states.get(r.req_id))  # type: ignore[arg-type]
            return last[1]
        # Kept as an array: converting hundreds of ints each step would visit each one.
        index = np.array(self._table_rows(rows), dtype=np.int64)
        self._last_decode = (list(rows), index)
        return index

    def _update_table(self, rid: str | None, table: Sequence[int], state: list | None) -> int:
        # The KV manager grows a table in place and replaces the list on free or swap: a new list (or a
        # shorter one) is rewritten from the start.
        if state is None:
            if rid is None:
                raise ValueError("a step's rows are all keyed or all unkeyed; this one has no req_id")
            if not self._free_table_rows:
                self._grow_tables()
            state = [self._free_table_rows.pop(), table, 0]
            self._table_state[rid] = state
            # A row another request used: its old entries would show as padding (the contract is zeros).
            self._tables[state[0]] = 0
        elif state[1] is not table or len(table) < state[2]:
            self._tables[state[0]] = 0
            state[1], state[2] = table, 0
        n = len(table)
        if n > self.max_blocks_per_req:
            raise ValueError(f"a block table of {n} blocks exceeds the batch's {self.max_blocks_per_req}")
        done = state[2]
        if n > done:
            self._tables[state[0], done:n] = table[done:n]
        state[2] = n
        return int(state[0])

    def _grow_tables(self) -> None:
        old = self._tables.shape[0]
        self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
        self._free_table_rows.extend(range(2 * old - 1, old - 1, -1))

    # -- one step ---------------------------------------------------------------------------------------

    def fill(
        self, rows: Sequence[RowLike], padding: Sequence[int] = (), decode: DecodeStep | None = None
    ) -> StepInputs:
        """The step's inputs. Rows are all keyed (a req_id each: their tables persist here) or all not.
        `decode`: a decode-only step's summary (keyed rows, one token each), read instead of the rows.

        `padding`: positions of padding rows to append after the real ones (static batching's held slots):
        each one token (PADDING_TOKEN) at its position over a block table of nothing but the sink block, so
        its key and value land in the sink and it attends over the sink's slots only."""
        num_real = len(rows)
        if num_real == 0:
            raise ValueError("a step needs at least one row")
        num_pad = len(padding)
        if num_pad and self.sink_block is None:
            raise ValueError("padding rows need a sink block")
        n = num_real + num_pad
        # What only Python can read: tokens, lengths, start positions. Comprehensions, not an append loop:
        # at hundreds of rows this pass is most of the fill.
        if decode is not None:
            starts_l, flat, lens = decode.positions, decode.token_ids, [1] * n
            if num_pad:  # the scheduler's lists are its own: extended in copies
                starts_l, flat = [*starts_l, *padding], [*flat, *[PADDING_TOKEN] * num_pad]
        else:
            starts_l = [r.start_pos for r in rows]
            lens = [len(r.token_ids) for r in rows]
            if num_pad:
                starts_l.extend(padding)
                lens.extend([1] * num_pad)
        total = sum(lens)
        decode_only = total == n
        if decode is None:
            flat = [r.token_ids[0] for r in rows] if decode_only else [t for r in rows for t in r.token_ids]
            if num_pad:
                flat.extend([PADDING_TOKEN] * num_pad)
        # Nothing is written into the buffers before this.
        buf = self._next_buffers()
        if n > buf.max_num_reqs:
            buf.alloc_reqs(max(n, 2 * buf.max_num_reqs))
        if total > buf.max_num_tokens:
            buf.alloc_tokens(max(total, 2 * buf.max_num_tokens))
        bs = self.block_size
        ids, pos, slots, qsl, seq = buf.ids, buf.pos, buf.slots, buf.qsl, buf.seq
        ids[:total] = flat
        starts = np.array(starts_l, dtype=np.int64)
        qsl[0] = 0
        if decode_only:
            qsl[1 : n + 1] = np.arange(1, n + 1)
            np.add(starts, 1, out=seq[:n])
        else:
            lens_a = np.array(lens, dtype=np.int64)
            np.cumsum(lens_a, out=qsl[1 : n + 1])
            np.add(starts, lens_a, out=seq[:n])
        seq_lens_host = seq[:n].tolist()
        max_seq = max(seq_lens_host)
        width = -(-max_seq // bs)
        if width > self.max_blocks_per_req:
            raise ValueError(
                f"a context of {max_seq} tokens needs {width} blocks; the batch holds {self.max_blocks_per_req}"
            )
        tables = buf.tables(n, width)
        if rows[0].req_id is not None:
            # First: either may grow the persistent tables.
            if decode is not None:
                index: Sequence[int] | np.ndarray = self._decode_table_rows(rows, decode.grown)
            else:
                self._last_decode = None  # a general step may grow any table: the next decode visits all
                index = self._table_rows(rows)
            np.take(self._tables[:, :width], index, axis=0, out=tables[:num_real])
        else:
            tables[:num_real] = 0
            for i, r in enumerate(rows):
                need = -(-seq_lens_host[i] // bs)
                tables[i, :need] = r.block_table[:need]
        if num_pad:
            tables[num_real:] = self.sink_block
        # Every token's position and cache slot, for the whole step at once.
        if decode_only:
            np.copyto(pos[:n], starts)
            token_row = np.arange(n)
        else:
            token_row = np.repeat(np.arange(n), lens_a)
            np.subtract(np.arange(total), np.repeat(qsl[:n] - starts, lens_a), out=pos[:total])
        p = pos[:total]
        np.add(tables[token_row, p // bs] * bs, p % bs, out=slots[:total])

        qsl_t, seq_t, bt_t, slots_t, ids_t, pos_t = buf.views(n, total, width)
        meta = AttentionMetadata(
            query_start_loc=self._to_device(qsl_t),
            seq_lens=self._to_device(seq_t),
            block_tables=self._to_device(bt_t),
            slot_mapping=self._to_device(slots_t),
            query_lens_host=lens,
            seq_lens_host=seq_lens_host,
            max_query_len=1 if decode_only else max(lens),
            max_seq_len=max_seq,
            block_size=bs,
        )
        step = StepInputs(self._to_device(ids_t), self._to_device(pos_t), meta)
        # After every copy from this set: the next fill into it waits until the device has read them.
        buf.fence.record()
        return step

    def index(self, values: Sequence[int]) -> torch.Tensor:
        """Token-row indices of the last filled step, on the device: written into that fill's set of pinned
        buffers and copied behind its other copies, the set's fence recorded again to cover this copy too.
        Called between a fill and the next; a mixed step's one transfer beyond the fill's, where a
        `torch.tensor(..., device=...)` from a Python list would be a blocking copy from pageable memory."""
        buf = self._sets[self._cur]
        n = len(values)
        if n > buf.max_num_tokens:
            raise ValueError(f"{n} token-row indices for a step of at most {buf.max_num_tokens} tokens")
        buf.idx[:n] = values
        t = self._to_device(buf.idx_t[:n])
        buf.fence.record()
        return t

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        # From pinned memory: queued behind nothing, overlapping the host's next work.
        return t.to(self.device, non_blocking=True)


def build_batch(
    rows: Sequence[Row], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Inputs for one batch in buffers of its own (nothing is kept)."""
    seq_max = max(r.start_pos + len(r.token_ids) for r in rows)
    batch = InputBatch(
        max_num_tokens=sum(len(r.token_ids) for r in rows),
        max_num_reqs=len(rows),
        max_blocks_per_req=-(-seq_max // block_size),
        block_size=block_size,
        device=device,
    )
    step = batch.fill([Row(r.token_ids, r.start_pos, r.block_table) for r in rows])
    return step.input_ids, step.positions, step.meta
