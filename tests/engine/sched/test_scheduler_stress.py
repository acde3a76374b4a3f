"""The scheduler under random load — arrivals, aborts, n > 1 families, preemption by swap and by recompute on a
tiny pool, prefix-cache hits, speculative drafts — with every invariant checked at every step.

The forward is a stand-in that keeps a slot-level picture of the KV cache: each slot a step computes holds the
identity of the prefix its KV depends on (a rolling hash of the tokens up to and including its position), and
copy-on-write copies, swaps out and swaps in move those identities as the runner moves KV. Before a row is
computed, every slot of its context is read back through its block table and must hold its own prefix: a
wrong block table, a shared block overwritten, a swap-in into the wrong blocks or a prefix-cache hit on a
block that never got its KV all fail there. Its greedy "model" predicts the next token from the identity of
the prefix alone, so every finished request's output must equal its prompt's one true continuation, the
output it would have had running alone.

Checked every step: the token budget; the seats (running rows, and the rows unforked parents will add); every
block's reference count equals the tables holding it and the pool's own invariants; every slot the step
writes is in a block its row alone holds, written by one row only; never a swap-out and a swap-in in one step
(admission is skipped in a step that preempts); every request in exactly one of waiting, running, swapped.
At the end: every block and host slot free, every per-request map empty, the watchdog never fired.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from chunkwise.engine.cache.kv_cache_manager import KVCacheManager
from chunkwise.engine.datatypes.config import SchedulerConfig
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.sched.draft_length import AdaptiveDraftLength, StepCostModel
from chunkwise.engine.sched.output import SchedulerOutput
from chunkwise.engine.sched.preemption import PreemptionCostModel
from chunkwise.engine.sched.scheduler import Scheduler

BLOCK = 4
VOCAB = 61
MAX_MODEL_LEN = 64


def ident(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) % (1 << 61)


def predict(identity: int) -> int:
    """The stand-in model's greedy next token after a prefix (never 0, the tokens' own id space is 1..)."""
    return identity % (VOCAB - 1) + 1


def identities(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = ident(h, t)
        out.append(h)
    return out


def continuation(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    h = identities(prompt)[-1]
    for _ in range(n):
        t = predict(h)
        tokens.append(t)
        h = ident(h, t)
    return tokens[len(prompt) :]


@dataclass
class Oracle:
    num_blocks: int
    num_host_blocks: int
    rng: random.Random
    device: dict[tuple[int, int], int] = field(default_factory=dict)
    host: dict[tuple[int, int], int] = field(default_factory=dict)

    def copies(self, out: SchedulerOutput) -> None:
        # The runner's order: copy-on-write, then out, then in.
        for src, dst in out.block_copies:
            for i in range(BLOCK):
                self._move(self.device, (src, i), self.device, (dst, i))
        for block, slot in out.swap_out:
            for i in range(BLOCK):
                self._move(self.device, (block, i), self.host, (slot, i))
        for slot, block in out.swap_in:
            for i in range(BLOCK):
                self._move(self.host, (slot, i), self.device, (block, i))

    @staticmethod
    def _move(
        src: dict[tuple[int, int], int],
        a: tuple[int, int],
        dst: dict[tuple[int, int], int],
        b: tuple[int, int],
    ) -> None:
        if a in src:
            dst[b] = src[a]
        else:
            dst.pop(b, None)

    def forward(self, s: Scheduler, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Write every row's slots, then read every row's context back and sample: in a real forward each
        layer writes the step's KV before any query reads it, so a prefix-cache hit taken in this step on
        blocks another row computes in it reads them written."""
        rows = []
        written: dict[tuple[int, int], str] = {}
        for sr in out.scheduled:
            req = sr.req
            assert req is not None and req.status is RequestStatus.RUNNING, sr.req_id
            table = sr.block_table
            assert table is s.kv.block_tables[sr.req_id]
            start = sr.start_pos
            assert start == req.num_computed_tokens
            known = req.token_ids[: start + len(sr.token_ids)]
            assert sr.token_ids == known[start:]
            # Drafts: the true continuation most of the time, a wrong token sometimes (a partial accept).
            tokens, h = list(known), identities(known)[-1]
            for _ in range(sr.num_spec_tokens):
                t = predict(h) if self.rng.random() < 0.7 else (predict(h) % (VOCAB - 1)) + 1
                tokens.append(t)
                h = ident(h, t)
            ids = identities(tokens)
            assert len(table) * BLOCK >= len(tokens), f"{sr.req_id}: writes past its table"
            for p in range(start, len(tokens)):
                slot = (table[p // BLOCK], p % BLOCK)
                assert slot not in written, f"{sr.req_id} and {written.get(slot)} write slot {slot}"
                written[slot] = sr.req_id
                self.device[slot] = ids[p]
            rows.append((sr, known, tokens, ids))
        self._check_sharers(s, written)
        sampled: dict[str, list[int]] = {}
        drafted: dict[str, int] = {}
        for sr, known, tokens, ids in rows:
            table = sr.block_table
            for p in range(sr.start_pos):
                got = self.device.get((table[p // BLOCK], p % BLOCK))
                assert got == ids[p], f"{sr.req_id}: the KV at position {p} is not its own prefix's"
            if not sr.samples:
                continue
            # Greedy verification: accept drafts while each is the model's own next token.
            out_tokens = []
            for q in range(len(known) - 1, len(tokens)):
                t = predict(ids[q])
                out_tokens.append(t)
                if q + 1 >= len(tokens) or tokens[q + 1] != t:
                    break
            sampled[sr.req_id] = out_tokens
            if sr.num_spec_tokens:
                drafted[sr.req_id] = sr.num_spec_tokens
        return sampled, drafted

    @staticmethod
    def _check_sharers(s: Scheduler, written: dict[tuple[int, int], str]) -> None:
        """A block the step writes may be held by others only as computed context (a prefix-cache hit on a
        block registered at its allocation): never by one that still has to compute any of it."""
        blocks = {b for b, _ in written}
        for rid, table in s.kv.block_tables.items():
            computed = s.requests[rid].num_computed_tokens
            for j, b in enumerate(table):
                if b in blocks and all(w != rid for (bb, _), w in written.items() if bb == b):
                    assert (j + 1) * BLOCK <= computed, (
                        f"{rid} holds block {b}, written this step, uncomputed"
                    )


def check_step(s: Scheduler, out: SchedulerOutput, budget: int, max_seqs: int) -> None:
    assert out.num_batched_tokens <= budget
    assert out.num_batched_tokens == sum(len(sr.token_ids) + sr.num_spec_tokens for sr in out.scheduled)
    assert not (out.swap_out and out.swap_in), "a step that preempts admits no one"
    assert len(s.running) + s.forks.seats() <= max_seqs
    s.kv.pool.check_invariants()
    holders = [0] * s.kv.pool.num_blocks
    for table in s.kv.block_tables.values():
        for b in table:
            holders[b] += 1
    assert holders == s.kv.pool.ref_cnt
    waiting, running, swapped = set(map(id, s.waiting)), set(map(id, s.running)), set(map(id, s.swapped))
    assert not (waiting & running or waiting & swapped or running & swapped)
    assert {id(r) for r in s.requests.values()} == waiting | running | swapped


def run(seed: int, steps_of_arrivals: int = 120) -> dict[str, int]:
    rng = random.Random(seed)
    mode = rng.choice(["swap", "recompute", "auto"])
    num_blocks = rng.randrange(18, 40)
    host_blocks = rng.choice([0, 8, 64])
    budget = rng.choice([8, 16, 32])
    max_seqs = rng.choice([4, 6, 8])
    spec = rng.choice([None, 2, 3])
    # Its own stream, so the seeds above keep the loads they had before priorities and tenants existed.
    tenancy = random.Random(seed + 1_000_000)
    policy = tenancy.choice(["fcfs", "priority"])
    fairness = tenancy.choice(["none", "vtc"])
    kv = KVCacheManager(num_blocks, BLOCK, True, host_blocks)
    cost = PreemptionCostModel(64, 1e9 if mode != "auto" else 3e3, 1e4)
    draft = None if spec is None else AdaptiveDraftLength(spec, StepCostModel(1.0, 1e-6), adaptive=False)
    s = Scheduler.from_config(
        SchedulerConfig(
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            preemption_mode=mode,  # type: ignore[arg-type]
            scheduling_policy=policy,  # type: ignore[arg-type]
            fairness=fairness,  # type: ignore[arg-type]
        ),
        kv,
        cost,
        draft_length=draft,
    )
    oracle = Oracle(num_blocks, host_blocks, rng)
    shared = [[rng.randrange(1, VOCAB) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    seen: dict[str, Request] = {}
    aborted: set[str] = set()
    counts = {"refused": 0, "preempted": 0, "forked": 0, "drafted": 0, "steps": 0, "priority_preempted": 0}
    step = 0
    while step < steps_of_arrivals or s.has_unfinished():
        assert step < steps_of_arrivals + 4000, "requests still unfinished: no progress"
        if step < steps_of_arrivals and rng.random() < 0.35:
            prompt = rng.choice(shared)[: rng.randrange(1, 13)] + [
                rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 10))
            ]
            n = rng.choice([1, 1, 1, 2, 3])
            out_len = rng.randrange(1, 30)
            room = MAX_MODEL_LEN - len(prompt)
            given = rng.random() < 0.8
            priority = tenancy.choice([0, 1, 2]) if policy == "priority" else 0
            params = SamplingParams(
                n=n, max_tokens=out_len if given else None, temperature=0.0, priority=priority
            )
            req = Request(
                f"r{step}",
                prompt,
                params,
                float(step),
                min(out_len, room) if given else room,
                tenant=tenancy.choice(["a", "b", None]),
            )
            try:
                s.add_request(req)
            except ValueError:
                counts["refused"] += 1
            else:
                seen[req.request_id] = req
                if rng.random() < 0.5:
                    req.output_length_estimate = (
                        0  # under-reserve: memory runs out mid-decode, preemption follows
                    )
        if s.requests and rng.random() < 0.04:
            rid = rng.choice(sorted(s.requests))
            aborted.add(rid)
            s.abort([rid])
        out = s.schedule()
        for r in s.requests.values():  # a fork's children, before any of them can finish
            seen.setdefault(r.request_id, r)
        check_step(s, out, budget, max_seqs)
        oracle.copies(out)
        sampled, drafted = oracle.forward(s, out)
        s.update_from_output(out, sampled, drafted)
        counts["preempted"] += out.num_preempted
        counts["forked"] += len(out.block_copies)
        counts["drafted"] += sum(drafted.values())
        step += 1
    counts["steps"] = step
    counts["priority_preempted"] = s.stats.num_priority_preemptions

    assert s.stats.num_stalled_requests == 0
    forked = {r.parent_id for r in seen.values() if r.parent_id is not None}
    for rid, req in seen.items():
        if rid in forked:
            continue  # a parent its children replaced: they answer for it
        assert req.is_finished, rid
        if req.fork_hold:  # a parent that never forked: aborted before
            assert req.status is RequestStatus.FINISHED_ABORTED
            continue
        truth = continuation(req.prompt_token_ids, len(req.output_token_ids))
        assert req.output_token_ids == truth, f"{rid}: not the output it would have had alone"
        if req.status is not RequestStatus.FINISHED_ABORTED:
            assert req.status is RequestStatus.FINISHED_LENGTH
            assert len(req.token_ids) == req.length_limit
        else:
            assert rid in aborted or req.parent_id in aborted
    assert kv.num_free_blocks == num_blocks
    assert kv.swap_space.num_free == host_blocks
    s.schedule()  # hands the last finished ids to the runner
    maps = {
        "requests": s.requests,
        "families": s.forks.families,
        "parents": s.forks.parents,
        "finished_ids": s.composer.finished_ids,
        "block_tables": kv.block_tables,
        "hashes": kv._hashes,
        "registered": kv._num_registered,
        "host_slots": kv._host_slots,
    }
    assert {k: len(v) for k, v in maps.items()} == dict.fromkeys(maps, 0)
    return counts


@pytest.mark.parametrize("seed", range(12))
def test_random_load_keeps_every_invariant(seed: int) -> None:
    counts = run(seed)
    assert counts["steps"] > 120


def test_the_random_load_exercises_what_it_checks() -> None:
    """Across the seeds above, every mechanism the invariants guard actually ran."""
    total: dict[str, int] = {}
    for seed in range(12):
        for k, v in run(seed).items():
            total[k] = total.get(k, 0) + v
    assert total["preempted"] > 0 and total["forked"] > 0 and total["drafted"] > 0
    assert total["priority_preempted"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12, 412))
def test_random_load_keeps_every_invariant_long(seed: int) -> None:
    run(seed, steps_of_arrivals=400)
