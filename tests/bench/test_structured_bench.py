"""`python -m chunkwise.bench.structured` runs end to end on the tiny model and reports both rates and their
ratio (the figure itself is measured by hand, pinned to a core: docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

from chunkwise.bench.structured import main


def test_the_bench_runs_and_every_request_has_its_fixed_length(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["--model", "tiny", "--batch", "3", "--max-tokens", "6", "--repeats", "2", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["batch"] == 3 and len(result["ratios"]) == 2
    assert result["plain_tok_s"] > 0 and result["json_schema_tok_s"] > 0
