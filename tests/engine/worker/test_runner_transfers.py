"""The model runner's host-device traffic in a step: what a GPU would wait on or copy from pageable memory.

On a CPU nothing blocks, so the tests watch the seams instead: host tensors reach the device only through
InputBatch's copies from its pinned buffers (`_to_device`), nothing reads a single value back (a `.item()`,
`int(t)` or `float(t)` dispatches aten.item or aten._local_scalar_dense, which on CUDA is a sync each), and a step's
tokens come back in one `.tolist()`. The swap path's copies go through the runner's `_swap_copy` seam.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chunkwise.engine.attention import get_attention_backend
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.model.loader import load_model
from chunkwise.engine.sched.output import ScheduledRequest, SchedulerOutput
from chunkwise.engine.worker.inputs import Row, build_batch
from chunkwise.engine.worker.model_runner import ModelRunner
from chunkwise.engine.worker.rejection import verify_greedy
from chunkwise.engine.worker.step import DraftRequest

BLOCK = 4
# What reading one value back dispatches (aten.item under inference mode); on CUDA each is a sync.
SCALAR_READS = ("aten.item", "aten._local_scalar_dense")


class FixedDrafts:
    """A proposer that proposes the same drafts for the requests it is given (a test stand-in)."""

    def __init__(self, drafts: dict[str, list[int]]) -> None:
        self.drafts = drafts

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        return {r.req_id: self.drafts[r.req_id][: r.k] for r in requests if r.req_id in self.drafts}

    def forget(self, req_ids: set[str]) -> None:
        pass


def make_runner(proposer: Any = None, num_host_blocks: int = 0) -> ModelRunner:
    backend = get_attention_backend("torch", "cpu")
    loaded = load_model("tiny", dtype=torch.float32, device="cpu", backend=backend)
    return ModelRunner(
        loaded.model,
        loaded.config,
        backend,
        num_blocks=32,
        block_size=BLOCK,
        num_host_blocks=num_host_blocks,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_num_tokens=64,
        max_num_reqs=8,
        max_model_len=64,
        proposer=proposer,
    )


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def req(
    rid: str, tokens: list[int], start: int, blocks: list[int], k: int = 0, temperature: float = 0.0
) -> ScheduledRequest:
    history = list(range(1, start + 1)) + tokens
    return ScheduledRequest(
        rid,
        tokens,
        start,
        blocks,
        samples=True,
        sampling_params=SamplingParams(temperature=temperature, max_tokens=16),
        num_spec_tokens=k,
        all_token_ids=history,
    )


def test_a_mixed_step_with_speculating_rows_copies_once_from_pinned_buffers_and_reads_back_once(
    monkeypatch: pytest.MonkeyPatch,
):
    runner = make_runner(FixedDrafts({"b": [7, 8], "c": [9, 10, 11], "d": [12, 13]}))
    sources: list[torch.Tensor] = []
    returned: list[torch.Tensor] = []

    def to_device(t: torch.Tensor) -> torch.Tensor:
        sources.append(t)
        returned.append(t)
        return t

    monkeypatch.setattr(runner.inputs, "_to_device", to_device)
    kept: list[torch.Tensor | None] = []
    forward = runner.model.forward

    def recording_forward(*args: Any) -> torch.Tensor:
        kept.append(args[5])  # input_ids, positions, kv_caches, meta, plan, keep, lora
        return forward(*args)

    monkeypatch.setattr(runner.model, "forward", recording_forward)
    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counting_tolist(t: torch.Tensor) -> Any:
        reads.append(t.numel())
        return tolist(t)

    so = SchedulerOutput(
        scheduled=[
            req("a", [3, 4, 5, 6, 7], 0, [1, 2]),  # a prompt's last chunk: samples one token
            req("b", [5], 6, [3, 4, 5], k=2),  # decodes and verifies two drafts
            req("c", [6], 9, [6, 7, 8, 9], k=3),  # three
            req("d", [8], 3, [10, 11], k=2, temperature=0.8),  # two, by rejection sampling
        ],
        num_batched_tokens=5 + 3 + 4 + 3,
    )
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    with Ops() as ops:
        out = runner.execute(so)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert set(out.sampled) == {"a", "b", "c", "d"} and out.drafted == {"b": 2, "c": 3, "d": 2}
    # The rows kept past the last attention: a's last token, then b's, c's and d's verify rows.
    (keep,) = kept
    assert keep is not None and keep.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    # ... came to the device as one of InputBatch's copies, from its buffers (pinned on CUDA), contiguous.
    assert any(keep is t for t in returned)
    assert all(t.is_contiguous() for t in sources)
    assert len(sources) == 7  # the fill's six tensors and the kept rows (d's drafts: see verify.py)
    # No single value read back (a row's start in query_start_loc was one per speculating row) ...
    assert [n for n in ops.names if n.startswith(SCALAR_READS)] == []
    # ... and one read of every id the step produced: a's token, b's and c's verify argmaxes (3 + 4), d's
    # acceptance tests, replacements and bonus token (2 + 2 + 1).
    assert reads == [1 + 3 + 4 + 5]


def test_each_speculating_row_gets_its_own_verify_rows_from_the_one_read():
    """The batched read-back splits one list over the rows: each row's tokens are verify_greedy of the
    target's argmax over its own verify rows, as the model computes them over the same step."""
    rows = [
        req("a", [3, 4, 5, 6, 7], 0, [1, 2]),
        req("b", [5], 6, [3, 4, 5], k=2),
        req("c", [6], 9, [6, 7, 8, 9], k=3),
    ]
    ref = make_runner()

    def argmaxes(drafts: dict[str, list[int]]) -> list[int]:
        """The target's argmax at every position of the step, the drafts fed as plain tokens."""
        full = [Row(r.token_ids + drafts.get(r.req_id, []), r.start_pos, r.block_table) for r in rows]
        ids, pos, meta = build_batch(full, BLOCK, torch.device("cpu"))
        with torch.inference_mode():
            return ref.model.compute_logits(ref.model(ids, pos, ref.kv_caches, meta)).argmax(dim=-1).tolist()

    # Drafts the target agrees with up to the last (three passes: each fixes one more position), so that
    # every verify row counts, and a wrong split of the read shows.
    drafts = {"b": [0, 0], "c": [0, 0, 0]}
    for _ in range(3):
        target = argmaxes(drafts)
        drafts = {"b": target[5:7], "c": target[8:11]}
    drafts["c"][2] = (drafts["c"][2] + 1) % 256  # c's last draft is wrong
    target = argmaxes(drafts)
    out = make_runner(FixedDrafts(drafts)).execute(SchedulerOutput(scheduled=rows, num_batched_tokens=12))
    assert len(out.sampled["b"]) == 3 and len(out.sampled["c"]) == 3
    assert out.sampled["a"] == [target[4]]
    assert out.sampled["b"] == verify_greedy(target[5:8], drafts["b"])
    assert out.sampled["c"] == verify_greedy(target[8:12], drafts["c"])


def _within(view: torch.Tensor, base: torch.Tensor) -> bool:
    start = base.data_ptr()
    end = start + base.numel() * base.element_size()
    return start <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= end


def test_swap_copies_each_run_of_host_slots_straight_between_the_pinned_host_cache_and_the_device(
    monkeypatch: pytest.MonkeyPatch,
):
    """A swap moves each layer's blocks in a few contiguous copies per run of consecutive host slots,
    straight into (out of) the host cache, pinned on CUDA, so a GPU's copies are DMAs nobody waits for; the
    old path's `.to(cpu)` per layer was a blocking copy into pageable memory, then a host-side scatter."""
    runner = make_runner(num_host_blocks=8)
    gen = torch.Generator().manual_seed(0)
    for layer in runner.kv_caches:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    before = [layer.clone() for layer in runner.kv_caches]
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    swap_copy = runner.kv_tensors._swap_copy

    def recording(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append((dst, src))
        swap_copy(dst, src)

    monkeypatch.setattr(runner.kv_tensors, "_swap_copy", recording)
    layers = len(runner.kv_caches)
    # Scattered device blocks; host slots 2, 3, 4 and 7, given out of order: two runs.
    out = [(9, 3), (5, 2), (1, 4), (12, 7)]
    with Ops() as ops:
        runner.execute(SchedulerOutput(scheduled=[], num_batched_tokens=0, swap_out=out))
    assert [n for n in ops.names if n.startswith(SCALAR_READS)] == []
    assert len(calls) == layers * 2 * 2  # per layer: two runs, keys and values each
    for i, (dst, src) in enumerate(calls):
        host = runner.host_caches[i // 4]
        assert dst.is_contiguous() and src.is_contiguous()
        assert _within(dst, host), "a copy into a temporary, not into the host cache"
    for host, dev in zip(runner.host_caches, before):
        for block, slot in out:
            assert torch.equal(host[:, slot], dev[:, block])
    # Back into other blocks: each block gets its own slot's bytes, and the host cache is the source.
    calls.clear()
    back = [(7, 20), (2, 21), (4, 30), (3, 22)]
    for layer in runner.kv_caches:
        layer.zero_()
    with Ops() as ops:
        runner.execute(SchedulerOutput(scheduled=[], num_batched_tokens=0, swap_in=back))
    assert [n for n in ops.names if n.startswith(SCALAR_READS)] == []
    assert len(calls) == layers * 2 * 2
    for i, (dst, src) in enumerate(calls):
        assert dst.is_contiguous() and src.is_contiguous()
        assert _within(src, runner.host_caches[i // 4])
    slot_of = {slot: block for block, slot in out}
    for layer, dev in zip(runner.kv_caches, before):
        for slot, block in back:
            assert torch.equal(layer[:, block], dev[:, slot_of[slot]])


def test_a_step_offloads_evicted_blocks_before_anything_writes_them():
    """The host tier's offloads read the blocks a step's allocations evicted as they were: before its
    copy-on-write, swaps and forward write them; its restores read the slots after the offloads wrote them."""
    runner = make_runner(num_host_blocks=8)
    for layer in runner.kv_caches:
        layer.zero_()
        layer[:, 3] = 1.0  # evicted from the prefix cache this step, and handed out again ...
        layer[:, 5] = 2.0
    step = SchedulerOutput(
        scheduled=[],
        num_batched_tokens=0,
        offload=[(3, 6)],
        block_copies=[(5, 3)],  # ... as a fork's copy-on-write block
        swap_in=[(6, 7)],  # and the offloaded KV is restored in the same step
    )
    assert not step.is_empty
    runner.execute(step)
    for layer, host in zip(runner.kv_caches, runner.host_caches):
        assert torch.all(host[:, 6] == 1.0), "the offload read the block after it was rewritten"
        assert torch.all(layer[:, 3] == 2.0) and torch.all(layer[:, 7] == 1.0)
