"""The runner's persistent InputBatch against a fresh fill of the same rows, step after step."""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from chunkwise.engine.sched.output import DecodeStep
from chunkwise.engine.worker.inputs import PADDING_TOKEN, InputBatch, Row, RowLike, build_batch


def decode_step(rows: Sequence[RowLike], grown: list[int]) -> DecodeStep:
    return DecodeStep([r.token_ids[0] for r in rows], [r.start_pos for r in rows], grown)


def assert_same_step(
    batch: InputBatch, rows: Sequence[RowLike], block_size: int, decode: DecodeStep | None = None
) -> None:
    got = batch.fill(rows, decode=decode)
    ids, pos, meta = build_batch(rows, block_size, torch.device("cpu"))
    assert torch.equal(got.input_ids, ids)
    assert torch.equal(got.positions, pos)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(got.meta, name), getattr(meta, name)), name
    assert got.meta.query_lens_host == meta.query_lens_host
    assert got.meta.seq_lens_host == meta.seq_lens_host
    assert (got.meta.max_query_len, got.meta.max_seq_len) == (meta.max_query_len, meta.max_seq_len)


def test_slots_and_positions_of_a_mixed_step():
    rows = [Row([5, 6, 7], 2, [9, 4], "a"), Row([1], 6, [3, 8], "b"), Row([2, 3], 0, [7], "c")]
    step = InputBatch(
        max_num_tokens=8, max_num_reqs=4, max_blocks_per_req=4, block_size=4, device=torch.device("cpu")
    ).fill(rows)
    assert step.positions.tolist() == [2, 3, 4, 6, 0, 1]
    # a: positions 2, 3 in block 9, position 4 in block 4; b: position 6 in block 8; c: block 7.
    assert step.meta.slot_mapping.tolist() == [38, 39, 16, 34, 28, 29]
    assert step.meta.block_tables.tolist() == [[9, 4], [3, 8], [7, 0]]
    assert step.meta.seq_lens.tolist() == [5, 7, 2]


@pytest.mark.parametrize("keyed", [True, False])
def test_padding_rows_decode_into_the_sink_block_after_the_real_rows(keyed: bool):
    rows = [Row([5, 6, 7], 2, [9, 4], "a" if keyed else None), Row([1], 6, [3, 8], "b" if keyed else None)]
    batch = InputBatch(
        max_num_tokens=4,
        max_num_reqs=2,
        max_blocks_per_req=4,
        block_size=4,
        device=torch.device("cpu"),
        sink_block=11,
    )
    step = batch.fill(rows, (9, 1))  # two padding rows, at positions 9 and 1: the buffers grow to hold them
    assert step.input_ids.tolist() == [5, 6, 7, 1, PADDING_TOKEN, PADDING_TOKEN]
    assert step.positions.tolist() == [2, 3, 4, 6, 9, 1]
    # The real rows' slots as without padding; a padding row's only ever in the sink block (11 * 4 + p % 4).
    assert step.meta.slot_mapping.tolist() == [38, 39, 16, 34, 45, 45]
    assert step.meta.block_tables.tolist() == [[9, 4, 0], [3, 8, 0], [11, 11, 11], [11, 11, 11]]
    assert step.meta.seq_lens.tolist() == [5, 7, 10, 2]
    assert step.meta.query_lens_host == [3, 1, 1, 1]
    # The next step without padding is exactly the plain fill of its rows.
    assert_same_step(batch, rows, 4)
    with pytest.raises(ValueError, match="sink block"):
        InputBatch(
            max_num_tokens=4, max_num_reqs=2, max_blocks_per_req=4, block_size=4, device=torch.device("cpu")
        ).fill(rows, (3,))


def test_persistent_tables_follow_growth_replacement_and_departures():
    rng = random.Random(0)
    bs = 4
    # Deliberately small: requests and tokens outgrow the start-up sizes and the buffers must grow.
    batch = InputBatch(
        max_num_tokens=4, max_num_reqs=2, max_blocks_per_req=64, block_size=bs, device=torch.device("cpu")
    )
    tables: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    next_block = iter(range(10_000))
    for step in range(60):
        # Requests arrive, decode, occasionally lose their blocks (a new list: preemption), and leave.
        if len(tables) < 6 and rng.random() < 0.5:
            rid = f"r{step}"
            tables[rid], computed[rid] = [], 0
        rows = []
        for rid, table in tables.items():
            n = rng.choice([1, 1, 1, 3]) if computed[rid] else rng.randint(1, 9)
            while len(table) * bs < computed[rid] + n:
                table.append(next(next_block))
            rows.append(Row([rng.randrange(100) for _ in range(n)], computed[rid], table, rid))
            computed[rid] += n
        if rows:
            assert_same_step(batch, rows, bs)
        for rid in list(tables):
            if rng.random() < 0.1:
                del tables[rid], computed[rid]
                batch.forget([rid])
            elif rng.random() < 0.05:
                tables[rid] = [next(next_block) for _ in tables[rid]]  # reallocated elsewhere
    assert batch.max_num_reqs >= 6 and batch.max_num_tokens > 4


def test_rows_must_all_be_keyed_or_all_unkeyed():
    batch = InputBatch(
        max_num_tokens=8, max_num_reqs=4, max_blocks_per_req=4, block_size=4, device=torch.device("cpu")
    )
    with pytest.raises(ValueError, match="all keyed or all unkeyed"):
        batch.fill([Row([1], 0, [3], "a"), Row([2], 0, [5])])


@dataclass
class MutableRow:
    """A row object kept from step to step, as the scheduler keeps its decode rows."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    req_id: str


def test_steady_decode_steps_visit_only_the_tables_that_grew():
    """Decode steps over the same row objects (the scheduler's steady state) reuse the last step's table
    rows and rewrite only the rows named as grown: the inputs match freshly built ones at every step, and a
    general step in between makes the next decode step visit every row again."""
    rng = random.Random(1)
    bs = 4
    batch = InputBatch(
        max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=32, block_size=bs, device=torch.device("cpu")
    )
    next_block = iter(range(10_000))
    rows = [
        MutableRow([rng.randrange(100)], p, [next(next_block) for _ in range(p // bs + 1)], f"r{i}")
        for i, p in enumerate([0, 3, 5, 9, 14, 15])
    ]
    for step in range(40):
        grown = []
        for i, r in enumerate(rows):
            r.start_pos += 1
            r.token_ids[0] = rng.randrange(100)
            if r.start_pos >= len(r.block_table) * bs:
                r.block_table.append(next(next_block))  # grown in place, as the KV manager does
                grown.append(i)
        if step % 13 == 12:
            assert_same_step(batch, rows, bs)  # a general step: tables may change without being named
        else:
            assert_same_step(batch, rows, bs, decode_step(rows, grown))
    # A step that names no growth although a table grew reads stale blocks: the reuse is real.
    rows[0].start_pos = len(rows[0].block_table) * bs
    rows[0].block_table.append(next(next_block))
    stale = batch.fill(rows, decode=decode_step(rows, []))
    assert stale.meta.block_tables[0, len(rows[0].block_table) - 1].item() == 0


# -- the copies to the device: no buffer rewritten or dropped before the device has read it ------------------


@dataclass
class LateDevice:
    """A device that runs behind the host: a copy issued during a fill reads its source only when a fence
    recorded after it is waited on (or at drain), as a GPU does when no sampling step synchronises. A copy
    whose source was rewritten in between, or dropped, is an error: the device would have read the next
    step's values, or freed memory."""

    log: list[tuple[str, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    unmarked: list[tuple] = field(default_factory=list)  # copies issued since the last record
    fences: list[LateFence] = field(default_factory=list)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        # The source's base weakly (the batch's reference is what keeps it alive), and where the view lies.
        self.unmarked.append((weakref.ref(base), t.storage_offset(), t.size(), t.stride(), t.clone()))
        return t.clone()

    def run(self, copies: list[tuple]) -> None:
        for ref, offset, size, stride, issued in copies:
            base = ref()
            if base is None:
                self.errors.append("a copy's source was dropped before the copy ran")
            elif not torch.equal(base.as_strided(size, stride, offset), issued):
                self.errors.append("a copy's source was rewritten before the copy ran")

    def drain(self) -> None:
        for f in self.fences:
            self.run(f.pending)
            f.pending = []
        self.run(self.unmarked)
        self.unmarked = []


class LateFence:
    def __init__(self, device: LateDevice) -> None:
        self.device = device
        self.id = len(device.fences)
        self.pending: list[tuple] = []
        device.fences.append(self)

    def record(self) -> None:
        self.device.log.append(("record", self.id))
        self.pending += self.device.unmarked
        self.device.unmarked = []

    def wait(self) -> None:
        self.device.log.append(("wait", self.id))
        self.device.run(self.pending)
        self.pending = []


class LateBatch(InputBatch):
    def __init__(self, device: LateDevice, **sizes: int) -> None:
        self.late = device
        super().__init__(device=torch.device("cpu"), fence=lambda: LateFence(device), block_size=4, **sizes)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        self.late.log.append(("copy", len(self.late.fences)))
        return self.late.copy(t)


def test_prompt_only_steps_never_rewrite_a_buffer_the_device_has_not_read():
    """A long prompt's chunks, step after step with no sampling step to synchronise: each fill's copies still
    read that fill's values, and the host runs one step ahead (a fill waits on the fill before last only)."""
    device = LateDevice()
    batch = LateBatch(device, max_num_tokens=8, max_num_reqs=2, max_blocks_per_req=16)
    table = list(range(100, 116))
    for k in range(6):
        rows = [Row([k * 10 + i for i in range(8)], 8 * k, table, "a")]
        if k % 2:
            rows.append(Row([k], k, [7, 8], "b"))  # sizes change from step to step too
        got = batch.fill(rows)
        assert got.input_ids.tolist() == rows[0].token_ids + ([k] if k % 2 else [])
    device.drain()
    assert device.errors == []
    events = [e for e in device.log if e[0] != "copy"]
    # Fence 0 serves fills 0, 2, 4; fence 1 (made at fill 1) fills 1, 3, 5. Each fill waits on its set's
    # fence, never on the one the fill before it just recorded.
    assert events == [e for k in range(6) for e in (("wait", k % 2), ("record", k % 2))]
    copies = [i for i, e in enumerate(device.log) if e[0] == "copy"]
    records = [i for i, e in enumerate(device.log) if e[0] == "record"]
    assert len(copies) == 6 * 6 and all(max(copies[6 * k : 6 * k + 6]) < records[k] for k in range(6))


def test_a_buffer_regrown_while_its_copies_are_queued_is_dropped_only_after_they_ran():
    """A step with more tokens and rows than its set holds regrows it: the old buffers go only after the
    device has read them."""
    device = LateDevice()
    batch = LateBatch(device, max_num_tokens=4, max_num_reqs=1, max_blocks_per_req=16)
    batch.fill([Row([1, 2, 3], 0, [5], "a")])  # set 0
    batch.fill([Row([4], 3, [5], "a")])  # set 1
    rows = [Row(list(range(10, 22)), 4, [5, 6, 7, 8], "a"), Row([9, 9], 0, [3], "b")]
    assert batch.fill(rows).input_ids.tolist() == [*range(10, 22), 9, 9]  # set 0, regrown
    assert batch.max_num_tokens >= 14 and batch.max_num_reqs >= 2
    device.drain()
    assert device.errors == []


class CopySources(InputBatch):
    """Records every host tensor a fill hands to a host-to-device copy."""

    def __init__(self, **sizes: int) -> None:
        super().__init__(device=torch.device("cpu"), block_size=4, **sizes)
        self.sources: list[torch.Tensor] = []

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        self.sources.append(t)
        return t


def test_every_copy_source_is_one_contiguous_run_of_its_buffer():
    """torch copies a strided source into a pageable temporary before the transfer: from pinned buffers a
    copy is asynchronous only if the slice it reads is contiguous. The block table of a step of several rows
    narrower than the widest table the batch holds is the case that was not."""
    batch = CopySources(max_num_tokens=8, max_num_reqs=4, max_blocks_per_req=16)
    rows = [Row([1, 2, 3], 0, [9], "a"), Row([4], 5, [3, 8], "b"), Row([5], 0, [7], "c")]
    step = batch.fill(rows)
    assert step.meta.block_tables.tolist() == [[9, 0], [3, 8], [7, 0]]
    assert len(batch.sources) == 6
    for t in batch.sources:
        assert t.is_contiguous(), tuple(t.shape)
    # A decode step of the same rows: the same, through the persistent tables' path.
    batch.sources.clear()
    decode_rows = [Row([6], 3, [9], "a"), Row([7], 6, [3, 8], "b"), Row([8], 1, [7], "c")]
    step = batch.fill(decode_rows, decode=decode_step(decode_rows, []))
    assert step.meta.block_tables.tolist() == [[9, 0], [3, 8], [7, 0]]
    assert all(t.is_contiguous() for t in batch.sources)
