"""The first GPU run: everything 15 minutes on one H200 should produce, in order of value.

    PYTHONPATH=runtime python bench/gpu/first_run.py --out "$OUT"              # on the GPU, < 9 minutes
    PYTHONPATH=runtime python bench/gpu/first_run.py --dry-run --out DIR      # every section, tiny, on CPU

Sections, each a child process with its own time box (killed when the box is spent, so one hung or slow
section cannot cost the ones after it) and its own output directory under --out, written as it goes; a
summary (first_run.json, first_run.md) is rewritten after every section, so a run cut off by the machine's
lease still leaves everything that finished:

  correctness  greedy tokens of a random Llama-3-8B-shaped model in float32: Triton eager and Triton with CUDA
               graphs against the torch reference, compared by log-prob tolerance (token_gate.py), and the
               pinned-input race check (a prompt of several chunks alone, with and without a sync per step)
  tp           tensor_parallel_size 2 over gloo, both ranks on the one GPU, against 1 (tp_check.py)
  throughput   decode at batch 1/64/256 (tok/s, p50/p99 step time, HBM bandwidth as a fraction of peak,
               and the host's share of each step: eager against graphs) and prefill tok/s at full chunks
  attention    the decode attention kernel's HBM bandwidth as % of 4.8 TB/s, against torch's SDPA
  convoy       32 decoding streams while 8k-token prompts prefill: the streams' p99 ITL, the prompts' TTFT

Needs only what the GPU machine has (torch, triton, numpy) and this repository: no network, no download;
tests/bench/gpu/test_gpu_first_run.py runs the dry run with every other dependency made unimportable.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclass(frozen=True)
class Section:
    name: str
    box_s: float  # the child is killed after this long
    script: str
    argv: tuple[str, ...]
    dry_argv: tuple[str, ...]  # replaces argv in a dry run (the CPU's configurations)
    what: str


# The boxes add up to 510 s (8.5 minutes): the rest of a 15-minute lease is the machine's start. Each child
# is also told to start nothing new a little before its box ends (--budget-s), so it usually writes its
# own report rather than being killed.
SECTIONS = (
    Section(
        "correctness",
        120,
        "run_engine_bench.py",
        # float32: the check is then strict (1e-3 nats). In bf16 the rounding of the torch reference's fp32
        # softmax against Triton's bf16 probabilities, through the random model's 32 layers, moved the first
        # H200 run's log-probs by up to 0.6 nats, which no tolerance separates from a wrong input.
        ("--dtype", "float32", "--measure", "tokens,race"),
        ("--dtype", "float32", "--measure", "tokens,race"),
        "float32 token check (eager, graphs, torch reference) and the race check",
    ),
    Section(
        "tp",
        60,
        "tp_check.py",
        (),
        (),
        "tensor_parallel_size 2 over gloo on the one GPU against 1 (float32 tokens), KV sized on every rank",
    ),
    Section(
        "throughput",
        150,
        "run_engine_bench.py",
        # The KV cache sized as a user's engine sizes it (gpu_memory_utilization, a profiled peak): the one
        # section that exercises that path, so a failure there costs only this section.
        (
            "--configs",
            "triton-eager,triton-graphs",
            "--measure",
            "decode,prefill",
            "--kv-cache-memory-bytes",
            "0",
        ),
        ("--configs", "cpu-eager,cpu-buckets", "--measure", "decode,prefill", "--kv-cache-memory-bytes", "0"),
        "decode at batch 1/64/256 and prefill, eager and graphs, with the host's share of a step",
    ),
    Section(
        "attention",
        90,
        "run_attention_bench.py",
        ("--sections", "correctness,decode"),
        ("--sections", "correctness,decode"),
        "decode attention's HBM bandwidth against SDPA",
    ),
    Section(
        "convoy",
        90,
        "run_engine_bench.py",
        ("--configs", "triton-graphs", "--measure", "convoy"),
        ("--configs", "cpu-buckets", "--measure", "convoy"),
        "p99 ITL of decoding streams while 8k-token prompts prefill",
    ),
)
# How long before its box a child stops starting new measurements.
MARGIN_S = 25.0


@dataclass
class Outcome:
    name: str
    status: str  # "ok" | "failed" | "timed out" | "not run"
    seconds: float = 0.0
    returncode: int | None = None
    report: dict[str, Any] = field(default_factory=dict)


def command(section: Section, out: Path, dry_run: bool) -> list[str]:
    argv = [sys.executable, str(HERE / section.script), "--out", str(out)]
    argv += [*section.dry_argv, "--smoke"] if dry_run else [*section.argv]
    argv += ["--budget-s", f"{max(5.0, section.box_s - MARGIN_S):g}"]
    return argv


def run_section(section: Section, out: Path, dry_run: bool) -> Outcome:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "runtime"), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    with open(out / "log.txt", "wb") as log:
        # A session of its own, so a kill at the end of the box takes its compiler children with it.
        proc = subprocess.Popen(
            command(section, out, dry_run),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=section.box_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, status = None, "timed out"
    outcome = Outcome(section.name, status, round(time.monotonic() - t0, 1), rc)
    for name in ("engine_bench.json", "attention_bench.json", "tp_check.json"):
        if (out / name).is_file():
            outcome.report = json.loads((out / name).read_text())
    return outcome


def host_table(throughput: dict[str, Any]) -> list[str]:
    """(e) of the brief: the host's time per decode step, eager against graphs, from the throughput section."""
    rows = []
    for name, entry in throughput.get("configs", {}).items():
        for batch, d in entry.get("decode", {}).items():
            rows.append(
                f"| {name} | {batch} | {d['step_ms']:.2f} | {d['forward_ms']:.2f} | {d['host_ms']:.2f} "
                f"| {d['prepare_ms']:.2f} | {d['sample_ms']:.2f} | {d['output_ms']:.2f} |"
            )
    if not rows:
        return []
    return [
        "## Host time per decode step, eager and graphs",
        "",
        "| config | batch | step ms | forward ms | host ms | prepare | sample | output |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def render(outcomes: list[Outcome], out: Path, dry_run: bool) -> str:
    lines = [
        "# First GPU run" + (" (dry run on CPU: the figures mean nothing)" if dry_run else ""),
        "",
        "| section | status | seconds | box s |",
        "|---|---|---|---|",
    ]
    boxes = {s.name: s.box_s for s in SECTIONS}
    for o in outcomes:
        lines.append(f"| {o.name} | {o.status} | {o.seconds:g} | {boxes[o.name]:g} |")
    lines.append("")
    for o in outcomes:
        md = next(
            (
                out / o.name / n
                for n in ("engine_bench.md", "attention_bench.md", "tp_check.md")
                if (out / o.name / n).is_file()
            ),
            None,
        )
        if md is not None:
            # The section's own report, its headings one level below this one's.
            body = [("##" + line if line.startswith("#") else line) for line in md.read_text().splitlines()]
            lines += [f"## {o.name}", "", *body, ""]
    throughput = next((o.report for o in outcomes if o.name == "throughput"), {})
    lines += host_table(throughput)
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for every section's output and the summary")
    p.add_argument("--dry-run", action="store_true", help="every section at tiny shapes on CPU")
    p.add_argument(
        "--sections",
        type=lambda v: [x for x in v.split(",") if x],
        default=[s.name for s in SECTIONS],
        help=f"comma-separated, in this order: {','.join(s.name for s in SECTIONS)} (default: all)",
    )
    args = p.parse_args(argv)
    unknown = set(args.sections) - {s.name for s in SECTIONS}
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print(
                "no CUDA device: the first run needs a GPU (--dry-run checks the plumbing on CPU)",
                file=sys.stderr,
            )
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    outcomes = [Outcome(s.name, "not run") for s in SECTIONS if s.name in args.sections]
    for i, section in enumerate(s for s in SECTIONS if s.name in args.sections):
        print(f"== {section.name} ({section.what}; box {section.box_s:g} s)", flush=True)
        outcomes[i] = run_section(section, out / section.name, args.dry_run)
        print(f"   {outcomes[i].status} in {outcomes[i].seconds:g} s", flush=True)
        (out / "first_run.json").write_text(
            json.dumps({"dry_run": args.dry_run, "sections": [asdict(o) for o in outcomes]}, indent=2)
        )
        (out / "first_run.md").write_text(render(outcomes, out, args.dry_run))
    print((out / "first_run.md").read_text())
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
