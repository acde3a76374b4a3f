"""tools/train_pylm.py, the trainer of the bundled checkpoint, kept outside the serving package: a two-step run
on a tiny corpus writes a Hugging Face directory that the engine's own loader serves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SOURCE = '''
def add(a, b):
    """Return the sum of two numbers."""
    return a + b


def scale(xs, k):
    """Multiply every item of a list by k."""
    return [x * k for x in xs]
'''


def test_two_steps_on_a_tiny_corpus_make_a_checkpoint_the_engine_loads(tmp_path: Path) -> None:
    corpus = tmp_path / "stdlib"
    corpus.mkdir()
    for i in range(60):  # enough files that the held-out split (1 in 50 by CRC) is not everything
        (corpus / f"mod{i}.py").write_text(SOURCE.replace("add", f"add{i}"))
    out = tmp_path / "pylm"
    argv = [sys.executable, str(ROOT / "tools" / "train_pylm.py"), "--out", str(out), "--stdlib", str(corpus)]
    shape = ["--max-steps", "2", "--seq-len", "32", "--batch-size", "2", "--hidden-size", "32"]
    shape += [
        "--intermediate-size",
        "64",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--vocab-size",
        "300",
    ]
    done = subprocess.run([*argv, *shape, "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] == 2
    from chunkwise import LLM, SamplingParams

    llm = LLM(model=str(out), max_model_len=64, dtype="float32")
    (result,) = llm.generate(["def add"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(result.outputs[0].token_ids) == 4
