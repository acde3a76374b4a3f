"""Speculative decoding, side by side: batch-1 speedup and the cost of speculation under saturation.

    python -m chunkwise.bench.spec --model small

Two measurements in one process. The configurations run the same requests step by step in turn (the order
rotating each round), each timed over its own steps only: run by run, a shared machine's slow spells fall on
whichever configuration ran then, and two runs of one engine differ by up to 20% here; step by step they fall
on all alike. Each figure is the median over repeats of the ratio within a repeat; the saturation run carries
a control, a second engine without speculation, whose ratio to the first is the measurement's own noise.

1. Batch 1. Tokens/s with speculation over tokens/s without, for the n-gram proposer on a repetitive prompt
   (fixed k, and the adaptive k a user gets by default) and for an oracle proposer that drafts the true
   greedy continuation (acceptance 1, no drafting cost): the mechanism's ceiling on this machine. The
   built-in models have random weights, which do not repeat their context, so n-gram acceptance here says
   little about a trained model; the oracle row says what verification costs and gains.
2. Saturation. Many concurrent decodes; no speculation vs adaptive k vs fixed k, n-gram proposer (every
   engine warmed alike first, so that they start with the same prefix cache).

`--workload repetitive` (the default) prompts with repeated English phrases; `--workload stdlib` with excerpts
of the Python standard-library files that the bundled `pylm` checkpoint held out of its training (the model's
own kind of text: `python -m chunkwise.bench.spec --model pylm --workload stdlib`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from chunkwise.engine import EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.worker.step import DraftRequest


class OracleProposer:
    """Drafts the known greedy continuation: a bench-only upper bound, never used in serving."""

    def __init__(self, prompt_len: int, continuation: list[int]) -> None:
        self.prompt_len = prompt_len
        self.continuation = continuation

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        out = {}
        for r in requests:
            done = len(r.token_ids) - self.prompt_len
            out[r.req_id] = self.continuation[done : done + r.k]
        return out

    def forget(self, req_ids: set[str]) -> None:
        """Stateless."""


def _run(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"r{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, sp)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(t) for t in tokens.values()), [tokens[r] for r in ids]


def _run_interleaved(
    engines: dict[str, EngineCore],
    prompts: list[list[int]],
    max_tokens: int,
) -> dict[str, tuple[float, int, list[list[int]]]]:
    """_run for every engine at once: each runs the same requests, one step each in turn, the order rotating
    every round. An engine's seconds are its own steps' alone (as if it ran by itself), and a slow spell of
    the machine (another process, a neighbour on the host) falls on every engine alike."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"r{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    tokens: dict[str, dict[str, list[int]]] = {name: {rid: [] for rid in ids} for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    for eng in engines.values():
        for rid, p in zip(ids, prompts):
            eng.add_request(rid, p, sp)
    turn = 0
    while live := [name for name, eng in engines.items() if eng.has_unfinished()]:
        shift = turn % len(live)
        turn += 1
        for name in live[shift:] + live[:shift]:
            got = tokens[name]
            t0 = time.perf_counter()
            for out in engines[name].step():
                got[out.request_id].extend(out.outputs[0].token_ids)
            seconds[name] += time.perf_counter() - t0
    return {
        name: (seconds[name], sum(len(t) for t in tokens[name].values()), [tokens[name][r] for r in ids])
        for name in engines
    }


def _ratios(rates: dict[str, list[float]], base: str) -> dict[str, float]:
    """Each configuration over `base`: the median over repeats of the ratio within a repeat."""
    return {
        name: statistics.median(r / b for r, b in zip(v, rates[base]))
        for name, v in rates.items()
        if name != base
    }


def _engine(model: str, **kw: object) -> EngineCore:
    return EngineCore(engine_config_from_kwargs(model, max_model_len=2048, **kw))


def _dtype(dtype: str | None) -> dict[str, object]:
    return {} if dtype is None else {"dtype": dtype}


def stdlib_excerpts(n: int, chars: int = 900) -> list[str]:
    """`n` excerpts of about `chars` characters, whole lines, from the files pylm's training held out (the
    same selection rule as chunkwise.engine.model.bundled.pylm_corpus), taken in turn from each file at growing offsets."""
    from chunkwise.engine.model.bundled.pylm_corpus import split_corpus, stdlib_dir

    _, held = split_corpus(stdlib_dir())
    files = [held[k].splitlines(keepends=True) for k in sorted(held)]
    out = []
    for i in range(n):
        lines = files[i % len(files)]
        start = (i // len(files)) * 60 % max(len(lines) - 1, 1)
        text = ""
        for line in lines[start:]:
            text += line
            if len(text) >= chars:
                break
        out.append(text)
    return out


def workload_prompts(workload: str, n: int) -> list[str]:
    if workload == "stdlib":
        return stdlib_excerpts(n)
    return [f"request {i}: " + "lorem ipsum dolor sit amet " * 4 for i in range(n)]


def batch_one(
    model: str,
    max_tokens: int,
    repeats: int,
    k: int,
    workload: str = "repetitive",
    num_prompts: int = 4,
    dtype: str | None = None,
) -> dict[str, object]:
    kw = _dtype(dtype)
    base = _engine(model, **kw)
    ngram = _engine(
        model, speculative_method="ngram", num_speculative_tokens=k, adaptive_speculation=False, **kw
    )
    adaptive = _engine(model, speculative_method="ngram", num_speculative_tokens=k, **kw)
    oracle = _engine(
        model, speculative_method="ngram", num_speculative_tokens=k, adaptive_speculation=False, **kw
    )
    texts = ["the cat sat on the mat. " * 12] if workload == "repetitive" else stdlib_excerpts(num_prompts)
    prompts = [base.tokenizer.encode(t) for t in texts]
    truths = [_run(base, [p], max_tokens)[2][0] for p in prompts]  # warm-up and the oracle's script
    engines = {"none": base, "ngram": ngram, "adaptive": adaptive, "oracle": oracle}
    for name, eng in engines.items():
        if name != "none":  # the same warm-up for every engine (prefix cache, first calls)
            _check(name, eng, prompts, truths, max_tokens)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        total_s = dict.fromkeys(engines, 0.0)
        total_n = dict.fromkeys(engines, 0)
        # One request at a time: batch 1, the prompts in turn.
        for prompt, truth in zip(prompts, truths):
            oracle.runner.proposer = OracleProposer(len(prompt), truth)
            for name, (seconds, n, (toks,)) in _run_interleaved(engines, [prompt], max_tokens).items():
                assert toks == truth, f"{name}: speculation changed greedy output"
                total_s[name] += seconds
                total_n[name] += n
        for name in engines:
            rates[name].append(total_n[name] / total_s[name])
    ratios = _ratios(rates, "none")
    st = ngram.stats
    return {
        "tokens_per_s": {k_: statistics.median(v) for k_, v in rates.items()},
        "speedup_ngram": ratios["ngram"],
        "speedup_adaptive": ratios["adaptive"],
        "speedup_oracle": ratios["oracle"],
        "ngram_acceptance": st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1),
    }


def _check(
    name: str, eng: EngineCore, prompts: list[list[int]], truths: list[list[int]], max_tokens: int
) -> None:
    """A warm-up pass of every prompt through `eng`, checking its greedy output."""
    for i, (prompt, truth) in enumerate(zip(prompts, truths)):
        if name == "oracle":
            eng.runner.proposer = OracleProposer(len(prompt), truth)
        assert _run(eng, [prompt], max_tokens)[2][0] == truth, (
            f"{name}: speculation changed greedy output ({i})"
        )


def saturation(
    model: str,
    num_requests: int,
    max_tokens: int,
    repeats: int,
    k: int,
    workload: str = "repetitive",
    dtype: str | None = None,
) -> dict[str, object]:
    kw = _dtype(dtype)
    engines = {
        "none": _engine(model, max_num_seqs=num_requests, **kw),
        "adaptive": _engine(
            model, max_num_seqs=num_requests, speculative_method="ngram", num_speculative_tokens=k, **kw
        ),
        "fixed": _engine(
            model,
            max_num_seqs=num_requests,
            speculative_method="ngram",
            num_speculative_tokens=k,
            adaptive_speculation=False,
            **kw,
        ),
    }
    # The control: a second engine without speculation, its ratio to the first the measurement's own noise.
    engines["control"] = _engine(model, max_num_seqs=num_requests, **kw)
    tok = engines["none"].tokenizer
    prompts = [tok.encode(t) for t in workload_prompts(workload, num_requests)]
    for eng in engines.values():
        _run(eng, prompts[:2], 4)  # the same warm-up for every engine (prefix cache, first calls)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    k_seen: dict[str, list[int]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, (seconds, n, _) in _run_interleaved(engines, prompts, max_tokens).items():
            rates[name].append(n / seconds)
            k_seen[name].append(engines[name].stats.spec_draft_length)
    ratios = _ratios(rates, "none")
    return {
        "num_requests": num_requests,
        "tokens_per_s": {name: statistics.median(v) for name, v in rates.items()},
        "adaptive_vs_none": ratios["adaptive"],
        "fixed_vs_none": ratios["fixed"],
        "control_vs_none": ratios["control"],
        "last_k": {name: v[-1] for name, v in k_seen.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chunkwise.bench.spec", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", help="built-in preset or HF directory (default small)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument(
        "--num-requests", type=int, default=64, help="concurrent requests at saturation (default 64)"
    )
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each measurement (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--workload",
        choices=("repetitive", "stdlib"),
        default="repetitive",
        help="prompts: repeated English phrases, or excerpts of the stdlib files pylm held out (default repetitive)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=4,
        help="batch-1 prompts, run in turn, for --workload stdlib (default 4)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="the engines' dtype (default: the engine's auto). Greedy output is checked identical with "
        "and without speculation, which holds in float32; bf16 results depend on batch shape and "
        "prefix-cache hits",
    )
    p.add_argument("--json", dest="json_out", default=None, help="also write results to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}", file=sys.stderr)
    one = batch_one(
        args.model, args.max_tokens, args.repeats, args.k, args.workload, args.num_prompts, args.dtype
    )
    print(
        f"batch 1: speedup n-gram {one['speedup_ngram']:.2f}x (acceptance {one['ngram_acceptance']:.2f}), "
        f"adaptive {one['speedup_adaptive']:.2f}x, oracle drafts {one['speedup_oracle']:.2f}x"
    )
    sat = saturation(
        args.model, args.num_requests, args.max_tokens, args.repeats, args.k, args.workload, args.dtype
    )
    print(
        f"saturation ({args.num_requests} requests): adaptive/none {sat['adaptive_vs_none']:.3f}, "
        f"fixed k={args.k}/none {sat['fixed_vs_none']:.3f}, control (none again)/none "
        f"{sat['control_vs_none']:.3f}, last k {sat['last_k']}"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"batch_one": one, "saturation": sat}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
