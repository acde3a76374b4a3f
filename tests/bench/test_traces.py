"""Public LLM traces as workloads: the Azure LLM inference CSV and Mooncake's JSONL (chunkwise.bench.traces),
and the `--workload trace` flags that read them."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkwise.bench import traces, workload_args
from chunkwise.bench.traces import (
    guess_format,
    load_azure,
    load_chunkwise,
    load_mooncake,
    load_trace,
    parse_timestamp,
)
from chunkwise.bench.workload_args import add_workload_args, build_workload
from chunkwise.bench.workloads import WorkItem, save_jsonl

REPO = Path(__file__).resolve().parents[2]
B = traces.MOONCAKE_BLOCK_TOKENS

# Unsorted on purpose; 7 fractional digits, as the Azure files have them.
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:47.1805900,300,20
2023-11-16 18:15:46.6805900,1200,5
2023-11-16 18:15:48.0000001,40,64
2023-11-17 00:00:00.0000000,7,1
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def mooncake_lines(rows: list[dict[str, object]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def common_prefix(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> int:
    assert a is not None and b is not None
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parse(argv: list[str], **defaults: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p, **defaults)
    return p.parse_args(argv)


# -- Azure ----------------------------------------------------------------------------------------------


def test_parse_timestamp_keeps_all_seven_fractional_digits() -> None:
    whole, frac = parse_timestamp("2023-11-16 18:15:46.6805901")
    assert whole == 1700158546  # 2023-11-16T18:15:46Z
    assert frac == pytest.approx(0.6805901, abs=1e-12)
    # Naive is UTC; an offset moves the instant; ISO's T and plain seconds are accepted too.
    assert parse_timestamp("2023-11-16T19:15:46.5+01:00") == (1700158546, 0.5)
    assert parse_timestamp("2024-05-10 00:00:00.009930+00:00") == (1715299200, pytest.approx(0.00993))
    assert parse_timestamp(" 12.25 ") == (12, 0.25)
    for bad in ("2023-13-01 00:00:00", "2023-11-16 25:00:00", "yesterday", "nan"):
        with pytest.raises(ValueError, match="not a"):
            parse_timestamp(bad)


def test_azure_sorts_by_time_and_measures_arrivals_from_the_first(tmp_path: Path) -> None:
    items = load_azure(write(tmp_path / "code.csv", AZURE), vocab_size=258, seed=1)
    assert [len(it.prompt_token_ids or ()) for it in items] == [1200, 300, 40, 7]
    assert [it.max_tokens for it in items] == [5, 20, 64, 1]
    assert [it.arrival_s for it in items[:3]] == pytest.approx([0.0, 0.5, 1.3194101], abs=1e-9)
    assert all(it.target_len is None for it in items)


def test_azure_arrival_is_exact_across_days(tmp_path: Path) -> None:
    items = load_azure(write(tmp_path / "t.csv", AZURE))
    # From 2023-11-16 18:15:46.68059 to 2023-11-17 00:00:00: 5 h 44 min 13.31941 s.
    assert items[-1].arrival_s == pytest.approx(5 * 3600 + 44 * 60 + 13.31941, abs=1e-9)


def test_azure_prompts_are_random_unshared_and_within_the_vocabulary(tmp_path: Path) -> None:
    rows = "".join(f"{i}.0,{64 + i},2\n" for i in range(40))
    path = write(tmp_path / "conv.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    for vocab, top in ((258, 255), (50000, 255), (40, 39)):
        items = load_azure(path, vocab_size=vocab)
        tokens = [t for it in items for t in it.prompt_token_ids or ()]
        assert min(tokens) == 3 and max(tokens) == top
    items = load_azure(path)
    assert (
        max(common_prefix(a.prompt_token_ids, b.prompt_token_ids) for a in items for b in items if a is not b)
        < 4
    )
    assert [it.arrival_s for it in items] == [float(i) for i in range(40)]
    assert load_azure(path, seed=0) == items
    assert load_azure(path, seed=1) != items


def test_azure_reads_extra_columns_any_order_and_case(tmp_path: Path) -> None:
    text = "generatedtokens,NumImages, timestamp ,ContextTokens\n3,0,2024-05-10 00:00:01+00:00,10\n4,1,2024-05-10 00:00:00+00:00,11.0\n"
    items = load_azure(write(tmp_path / "mm.csv", text))
    assert [(len(it.prompt_token_ids or ()), it.max_tokens, it.arrival_s) for it in items] == [
        (11, 4, 0.0),
        (10, 3, 1.0),
    ]


# -- Mooncake -------------------------------------------------------------------------------------------


def test_mooncake_shared_hash_ids_share_exactly_their_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 3 * B - 5, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 3 * B, "output_length": 7, "hash_ids": [0, 1, 7]},
        {"timestamp": 2000, "input_length": B, "output_length": 1, "hash_ids": [5]},
        {"timestamp": 2001, "input_length": 3 * B, "output_length": 2, "hash_ids": [0, 1, 2]},
    ]
    a, b, c, d = load_mooncake(write(tmp_path / "mooncake_trace.jsonl", mooncake_lines(rows)))
    assert [len(x.prompt_token_ids or ()) for x in (a, b, c, d)] == [3 * B - 5, 3 * B, B, 3 * B]
    assert [x.max_tokens for x in (a, b, c, d)] == [10, 7, 1, 2]
    assert [x.arrival_s for x in (a, b, c, d)] == [0.0, 1.5, 2.0, 2.001]
    # Two shared hash ids: exactly the first 2 * 512 tokens in common, then different blocks.
    assert a.prompt_token_ids[: 2 * B] == b.prompt_token_ids[: 2 * B]  # type: ignore[index]
    assert common_prefix(a.prompt_token_ids, b.prompt_token_ids) < 2 * B + 4
    assert a.prompt_token_ids[2 * B :] != b.prompt_token_ids[2 * B : 3 * B - 5]  # type: ignore[index]
    # No shared id: nothing shared. The same ids: the same tokens, the last block cut to the length.
    assert common_prefix(a.prompt_token_ids, c.prompt_token_ids) < 4
    assert d.prompt_token_ids[: 3 * B - 5] == a.prompt_token_ids  # type: ignore[index]
    tokens = [t for x in (a, b, c, d) for t in x.prompt_token_ids or ()]
    assert min(tokens) == 3 and max(tokens) == 255


def test_mooncake_block_of_a_hash_id_does_not_depend_on_the_request(tmp_path: Path) -> None:
    # Hash id 4 at position 0 in one request and the block the other requests hold differ only by id.
    rows = [
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [4, 9]},
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [9, 4]},
    ]
    x, y = load_mooncake(write(tmp_path / "t.jsonl", mooncake_lines(rows)), block_tokens=4, seed=3)
    assert x.prompt_token_ids[:4] == y.prompt_token_ids[4:]  # type: ignore[index]
    assert x.prompt_token_ids[4:] == y.prompt_token_ids[:4]  # type: ignore[index]
    assert x.prompt_token_ids[:4] != x.prompt_token_ids[4:]  # type: ignore[index]
    other = load_mooncake(write(tmp_path / "t.jsonl", mooncake_lines(rows)), block_tokens=4, seed=4)
    assert other[0].prompt_token_ids != x.prompt_token_ids


def test_mooncake_prompt_longer_than_its_blocks_gets_its_own_tokens(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 16 + 50, "output_length": 3, "hash_ids": [0]},
        {"timestamp": 0, "input_length": 16 + 50, "output_length": 3, "hash_ids": [0]},
        {"timestamp": 0, "input_length": 30, "output_length": 3, "hash_ids": []},
    ]
    e, f, g = load_mooncake(write(tmp_path / "t.jsonl", mooncake_lines(rows)), block_tokens=16)
    assert len(e.prompt_token_ids or ()) == len(f.prompt_token_ids or ()) == 66
    assert e.prompt_token_ids[:16] == f.prompt_token_ids[:16]  # type: ignore[index]
    assert common_prefix(e.prompt_token_ids, f.prompt_token_ids) < 20
    assert len(g.prompt_token_ids or ()) == 30


def test_mooncake_sorts_unsorted_lines(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 900, "input_length": 3, "output_length": 9, "hash_ids": [1]},
        {"timestamp": 100, "input_length": 2, "output_length": 1, "hash_ids": [2]},
    ]
    items = load_mooncake(write(tmp_path / "t.jsonl", mooncake_lines(rows)))
    assert [(it.arrival_s, it.max_tokens) for it in items] == [(0.1, 1), (0.9, 9)]


# -- both: time scale, cap, hidden lengths, format guessing ---------------------------------------------


@pytest.fixture
def three_formats(tmp_path: Path) -> dict[str, Path]:
    moon = [
        {"timestamp": t, "input_length": 20, "output_length": 2, "hash_ids": [i]}
        for i, t in enumerate([0, 1000, 3000, 7000])
    ]
    own = [WorkItem((5, 6, 7), 2, t) for t in (0.0, 1.0, 3.0, 7.0)]
    save_jsonl(own, tmp_path / "own.jsonl")
    return {
        "azure": write(
            tmp_path / "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,20,2\n1,20,2\n3,20,2\n7,20,2\n"
        ),
        "mooncake": write(tmp_path / "mc.jsonl", mooncake_lines(moon)),
        "chunkwise": tmp_path / "own.jsonl",
    }


@pytest.mark.parametrize("fmt", ["azure", "mooncake", "chunkwise"])
def test_time_scale_divides_arrivals(three_formats: dict[str, Path], fmt: str) -> None:
    path = three_formats[fmt]
    assert [it.arrival_s for it in load_trace(path)] == [0.0, 1.0, 3.0, 7.0]
    assert [it.arrival_s for it in load_trace(path, time_scale=4)] == [0.0, 0.25, 0.75, 1.75]
    assert [it.arrival_s for it in load_trace(path, time_scale=math.inf)] == [0.0] * 4
    ns = parse(["--workload", "trace", "--trace", str(path), "--trace-time-scale", "0.5"])
    assert [it.arrival_s for it in build_workload(ns)] == [0.0, 2.0, 6.0, 14.0]
    with pytest.raises(ValueError, match="time scale"):
        load_trace(path, time_scale=0)


@pytest.mark.parametrize("fmt", ["azure", "mooncake", "chunkwise"])
def test_num_requests_caps_only_when_given(three_formats: dict[str, Path], fmt: str) -> None:
    path = str(three_formats[fmt])
    whole = build_workload(parse(["--workload", "trace", "--trace", path]))
    assert len(whole) == 4
    # A command's own default (bench compare's 8, say) is not a cap either: below the trace's length here.
    assert build_workload(parse(["--workload", "trace", "--trace", path], num_requests=2)) == whole
    capped = build_workload(parse(["--workload", "trace", "--trace", path, "--num-requests", "2"]))
    assert capped == whole[:2]  # the earliest two, with the same prompts
    # A copied namespace (bench compare vllm, replay compare) keeps the cap.
    ns = parse(["--workload", "trace", "--trace", path, "--num-requests", "3"])
    assert len(build_workload(argparse.Namespace(**vars(ns)))) == 3
    with pytest.raises(SystemExit, match="at least 1"):
        build_workload(parse(["--workload", "trace", "--trace", path, "--num-requests", "0"]))


def test_hide_lengths_moves_the_trace_lengths_to_target_len(three_formats: dict[str, Path]) -> None:
    for path in three_formats.values():
        items = build_workload(parse(["--workload", "trace", "--trace", str(path), "--hide-lengths"]))
        assert [(it.max_tokens, it.target_len) for it in items] == [(None, 2)] * 4


def test_format_guessing(three_formats: dict[str, Path], tmp_path: Path) -> None:
    assert {fmt: guess_format(p) for fmt, p in three_formats.items()} == {
        "azure": "azure",
        "mooncake": "mooncake",
        "chunkwise": "chunkwise",
    }
    # A Mooncake trace under another suffix, after a blank line, is still recognized by its content.
    moon = write(tmp_path / "trace.txt", "\n" + three_formats["mooncake"].read_text())
    assert guess_format(moon) == "mooncake"
    unknown = write(tmp_path / "other.jsonl", '{"ts": 1, "len": 3}\n')
    with pytest.raises(ValueError, match=r"other\.jsonl:1: cannot tell the trace format.*\['len', 'ts'\]"):
        guess_format(unknown)
    with pytest.raises(SystemExit, match="cannot tell the trace format"):
        build_workload(parse(["--workload", "trace", "--trace", str(unknown)]))
    # --trace-format overrides the guess: an Azure CSV that is not named .csv.
    azure_txt = write(tmp_path / "azure.txt", three_formats["azure"].read_text())
    with pytest.raises(SystemExit, match="cannot tell"):
        build_workload(parse(["--workload", "trace", "--trace", str(azure_txt)]))
    items = build_workload(
        parse(["--workload", "trace", "--trace", str(azure_txt), "--trace-format", "azure"])
    )
    assert [it.arrival_s for it in items] == [0.0, 1.0, 3.0, 7.0]
    assert workload_args.TRACE_FORMATS == traces.TRACE_FORMATS


def test_block_tokens_flag_reaches_the_mooncake_reader(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [0, 2]},
    ]
    path = str(write(tmp_path / "t.jsonl", mooncake_lines(rows)))
    x, y = build_workload(parse(["--workload", "trace", "--trace", path, "--trace-block-tokens", "4"]))
    assert common_prefix(x.prompt_token_ids, y.prompt_token_ids) in range(4, 8)
    # At 512 tokens a block, both 8-token prompts are the first block's first 8 tokens.
    x, y = build_workload(parse(["--workload", "trace", "--trace", path]))
    assert x.prompt_token_ids == y.prompt_token_ids


# -- errors ---------------------------------------------------------------------------------------------

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("TIMESTAMP,ContextTokens\n0,1\n", r"t\.csv:1: .*missing \['GeneratedTokens'\]"),
        (HEADER + "0,1,1\nnoon,1,1\n", r"t\.csv:3: TIMESTAMP not a date-time.*'noon'"),
        (HEADER + "0,1,1\n1,1,0\n", r"t\.csv:3: GeneratedTokens is 0.*--trace-skip-empty"),
        (HEADER + "0,0,4\n", r"t\.csv:2: ContextTokens is 0"),
        (HEADER + "0,1,-2\n", r"t\.csv:2: GeneratedTokens must be >= 0"),
        (HEADER + "0,1.5,2\n", r"t\.csv:2: ContextTokens must be an integer"),
        (HEADER + "0,1\n", r"t\.csv:2: 2 fields"),
        ("", r"t\.csv: empty trace"),
    ],
)
def test_azure_errors_name_the_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "t.csv", text)
    with pytest.raises(ValueError, match=message):
        load_azure(path)
    with pytest.raises(SystemExit, match=message):
        build_workload(parse(["--workload", "trace", "--trace", str(path)]))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 0, "input_length": 3, "hash_ids": []}', r"t\.jsonl:2: .*missing \['output_length'\]"),
        (
            '{"timestamp": 0, "input_length": 3, "output_length": 0, "hash_ids": []}',
            r"t\.jsonl:2: output_length is 0",
        ),
        (
            '{"timestamp": -1, "input_length": 3, "output_length": 1, "hash_ids": []}',
            r"t\.jsonl:2: timestamp",
        ),
        (
            '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1, -2]}',
            r"t\.jsonl:2: hash_ids",
        ),
        (
            '{"timestamp": 0, "input_length": "3", "output_length": 1, "hash_ids": []}',
            r"t\.jsonl:2: input_length",
        ),
        ("[1, 2]", r"t\.jsonl:2: each line must be a JSON object"),
        ('{"timestamp": 0,', r"t\.jsonl:2: not JSON"),
    ],
)
def test_mooncake_errors_name_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]}'
    path = write(tmp_path / "t.jsonl", good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_mooncake(path)
    with pytest.raises(SystemExit, match=message):
        build_workload(parse(["--workload", "trace", "--trace", str(path), "--trace-format", "mooncake"]))


def test_skip_empty_drops_the_rows_it_would_refuse(tmp_path: Path) -> None:
    path = write(tmp_path / "t.csv", HEADER + "0,5,0\n1,5,2\n2,0,3\n3,4,1\n")
    items = build_workload(parse(["--workload", "trace", "--trace", str(path), "--trace-skip-empty"]))
    assert [(it.arrival_s, it.max_tokens) for it in items] == [(0.0, 2), (2.0, 1)]
    moon = write(
        tmp_path / "t.jsonl", '{"timestamp": 5, "input_length": 3, "output_length": 0, "hash_ids": []}\n'
    )
    assert load_mooncake(moon, skip_empty=True) == []
    with pytest.raises(SystemExit, match="no requests"):
        build_workload(parse(["--workload", "trace", "--trace", str(moon), "--trace-skip-empty"]))


def test_missing_file_and_missing_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"not found: .*nope\.csv"):
        build_workload(parse(["--workload", "trace", "--trace", str(tmp_path / "nope.csv")]))
    with pytest.raises(SystemExit, match="needs --trace"):
        build_workload(parse(["--workload", "trace"]))
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "nope.jsonl")


def test_chunkwise_errors_keep_their_line(tmp_path: Path) -> None:
    path = write(tmp_path / "own.jsonl", '{"prompt_token_ids": [5], "max_tokens": 1}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"own\.jsonl:2: prompt must be a string"):
        load_chunkwise(path)


# -- the real CLI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["azure", "mooncake"])
def test_replay_run_replays_a_trace_end_to_end(tmp_path: Path, fmt: str) -> None:
    if fmt == "azure":
        # Newest first: the reader sorts them.
        rows = [
            f"2023-11-16 18:15:{46 + i // 4:02d}.{i * 1234567:07d},{100 + 37 * i},{1 + i}\n" for i in range(8)
        ]
        path = write(tmp_path / "AzureLLMInferenceTrace_code.csv", HEADER + "".join(reversed(rows)))
    else:
        moon = [
            {
                "timestamp": 200 * i,
                "input_length": 600 + 50 * i,
                "output_length": 1 + i,
                "hash_ids": [0, 100 + i],
            }
            for i in range(8)
        ]
        path = write(tmp_path / "mooncake_trace.jsonl", mooncake_lines(moon))
    out = tmp_path / "report.json"
    cmd = [
        *(sys.executable, "-m", "chunkwise.cli", "replay", "run", "--profile", "llama3-8b-h100"),
        *("--workload", "trace", "--trace", str(path), "--num-requests", "6", "--trace-time-scale", "2"),
        *("--json", str(out)),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator")])}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 6
    assert report["total_output_tokens"] == sum(range(1, 7))
    assert "workload: 6 requests" in done.stderr
