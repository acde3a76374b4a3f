"""The grammar mask's cost: output tokens/s of one batch with and without a JSON-schema constraint.

    taskset -c 1 python -m chunkwise.bench.structured --model small,pylm --batch 32 --max-tokens 128

(several models, comma-separated, are measured one after the other, each on its own engine). On a GPU:
`--device cuda --dtype bfloat16 --model llama3-8b` (random weights, byte tokenizer, 128k vocabulary).

One engine; the same prompts, the same lengths, run alternately (plain, constrained, plain, ...; the first
of each pair alternates too). Every request generates exactly --max-tokens tokens: the plain ones ignore EOS,
the constrained ones follow a schema that cannot be complete so soon (a list of at least 100000 integers),
so its mask never allows EOS. The ratio (constrained / plain, median of the pairs) is what the mask costs:
llguidance filling each row's bitmask on the host, one copy, the masking in the sampler, and advancing each
matcher by its token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

from chunkwise.engine.datatypes.sampling_params import SamplingParams
from chunkwise.engine.datatypes.structured_output import StructuredOutput
from chunkwise.engine.loop.llm import LLM

# A list too long to finish within any --max-tokens here: every constrained request runs to its cap.
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999}, "minItems": 100000}


def _prompts(n: int) -> list[str]:
    # The same prompts in both modes, of one length in characters (in tokens too, with the byte tokenizer).
    return [f"Numbers for record {i:04d}: " for i in range(n)]


def _run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="presets or HF directories, comma-separated (small)")
    p.add_argument("--batch", type=int, default=32, help="requests in the batch (32)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each request generates (128)")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs (3)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1.0; 0 = greedy)")
    p.add_argument("--device", default="cpu", help="engine device (cpu)")
    p.add_argument("--dtype", default="auto", help="engine dtype (auto)")
    p.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [_measure(model, args) for model in args.model.split(",") if model]
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=2)
    return 0


def _measure(model: str, args: argparse.Namespace) -> dict[str, object]:
    llm = LLM(model, max_num_seqs=args.batch, max_model_len=512, seed=0, device=args.device, dtype=args.dtype)
    prompts = _prompts(args.batch)
    plain = [
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True, seed=i)
        for i in range(args.batch)
    ]
    spec = StructuredOutput.json_schema(SCHEMA)
    constrained = [replace(sp, structured=spec) for sp in plain]
    # Warm-up: the grammar is compiled and cached, the matmul primitives for these shapes are made.
    warm = [replace(sp, max_tokens=8) for sp in plain]
    _run(llm, prompts, warm)
    _run(llm, prompts, [replace(sp, structured=spec) for sp in warm])

    rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
    ratios = []
    for r in range(args.repeats):
        order = [("plain", plain), ("json_schema", constrained)]
        if r % 2:
            order.reverse()
        pair = {}
        for name, params in order:
            seconds, tokens = _run(llm, prompts, params)
            if tokens != args.batch * args.max_tokens:
                raise SystemExit(f"{name}: {tokens} tokens, expected {args.batch * args.max_tokens}")
            pair[name] = tokens / seconds
            rates[name].append(pair[name])
            print(f"run {r} {name:12s} {pair[name]:8.1f} output tok/s ({seconds:.2f} s)", file=sys.stderr)
        ratios.append(pair["json_schema"] / pair["plain"])
    result: dict[str, object] = {
        "model": model,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "threads": args.threads,
        "device": args.device,
        "plain_tok_s": statistics.median(rates["plain"]),
        "json_schema_tok_s": statistics.median(rates["json_schema"]),
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "runs": rates,
    }
    print(
        f"{model}, batch {args.batch} x {args.max_tokens} tokens: plain {result['plain_tok_s']:.1f} tok/s, "
        f"json_schema {result['json_schema_tok_s']:.1f} tok/s, ratio {result['ratio_median']:.3f} "
        f"(pairs: {', '.join(f'{x:.3f}' for x in ratios)})",
        flush=True,
    )
    return result


if __name__ == "__main__":
    raise SystemExit(main())
