"""The bundled trained checkpoint `pylm`: resolved by name, loaded through the HF-directory path, token for
token what transformers computes from the same files, and its tokenizer streams text as the full decode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from chunkwise import LLM, SamplingParams
from chunkwise.checkpoint_report import inspect_model
from chunkwise.engine import EngineCore
from chunkwise.engine.datatypes.config import engine_config_from_kwargs
from chunkwise.engine.model.bundled import bundled_path, resolve_model_path
from chunkwise.engine.model.bundled.pylm_corpus import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    chat_exchanges,
    corpus_files,
)
from chunkwise.engine.model.loader import read_checkpoint
from chunkwise.engine.tokenizer import HFTokenizer, IncrementalDetokenizer
from chunkwise.server.chat import ChatMessage, render_chat
from tests.engine.loop.test_engine_exact import run_staggered
from tests.hf_models import hf_greedy

PATH = bundled_path("pylm")
# Excerpts in the style of the held-out stdlib files (the benchmark's kind of text), and text it never saw.
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    'class Scheduler:\n    """A priority queue of events."""\n\n    def __init__(self, timefunc=time.monotonic):\n',
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, ",
    "for i, line in enumerate(lines):\n    if not line.strip():\n        continue\n",
]
CLASS_PROMPT = "class Queue:\n    def __init__(self"
TEXTS = [*PROMPTS, "Ünïcödé: naïve café, 中文字符, emoji 🙂🚀, Ελληνικά.", "\t\r\n  trailing spaces   \n"]


def test_the_checkpoint_ships_in_the_package_and_resolves_by_name() -> None:
    assert PATH is not None and PATH.parent.name == "bundled"
    assert resolve_model_path("pylm") == PATH
    assert resolve_model_path("/some/dir") == Path("/some/dir")
    assert bundled_path("tiny") is None
    weights = PATH / "model.safetensors"
    assert weights.stat().st_size <= 16 * 1024 * 1024
    config = json.loads((PATH / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    record = json.loads((PATH / "training.json").read_text())
    assert record["held_out_loss"] < 4.5
    report = inspect_model("pylm")
    assert "tokenizer.json" in report.tokenizer and report.chat_template


def test_tokenizer_specials_and_chat_template() -> None:
    assert PATH is not None
    # As the engine reads it: tokenizer_config.json's EOS plus config/generation_config.json's.
    config, tok = read_checkpoint(PATH)
    assert isinstance(tok, HFTokenizer)
    ids = {t: tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS}
    assert all(len(v) == 1 for v in ids.values())
    assert tok.bos_token_id == ids["<|begin_of_text|>"][0]
    assert (
        set(tok.eos_token_ids) == set(config.eos_token_ids) == {ids["<|end_of_text|>"][0], ids["<|end|>"][0]}
    )
    assert tok.chat_template == CHAT_TEMPLATE
    assert 4000 <= tok.vocab_size <= 4200
    # Byte-level: any text round-trips; code takes few tokens per character.
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    code = PROMPTS[1]
    assert len(tok.encode(code, add_special_tokens=False)) < len(code) / 2.5


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_is_the_full_decode(text: str) -> None:
    assert PATH is not None
    tok = HFTokenizer.from_dir(PATH)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("# context\n"))
    pieces = [detok.step(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_and_specials_stream_as_the_full_decode(seed: int) -> None:
    assert PATH is not None
    tok = HFTokenizer.from_dir(PATH)
    rng = random.Random(seed)
    special = sorted(tok.special_token_ids)
    ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(tok.vocab_size) for _ in range(300)]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, None, skip_special_tokens=skip)
        pieces = [detok.step(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_greedy_matches_transformers_under_chunked_prefill_and_mixed_batches() -> None:
    assert PATH is not None
    tok = HFTokenizer.from_dir(PATH)
    prompts = [tok.encode(p) for p in PROMPTS]
    max_new = [24, 9, 17, 30]
    expected = hf_greedy(PATH, prompts, max_new)
    engine = EngineCore(
        engine_config_from_kwargs("pylm", dtype="float32", max_num_batched_tokens=16, block_size=4)
    )
    assert engine.config.model == "pylm"
    assert run_staggered(engine, prompts, max_new) == expected


def test_greedy_output_is_python_and_ends_by_eos() -> None:
    llm = LLM("pylm", dtype="float32")
    out = llm.generate([CLASS_PROMPT], SamplingParams(max_tokens=64, temperature=0.0))[0].outputs[0]
    # The signature closes and an indented body follows: Python, not noise.
    assert "):\n        " in out.text and "self." in out.text and "\ufffd" not in out.text
    prompt = render_chat([ChatMessage("user", "Hello!")], CHAT_TEMPLATE, bos_token="<|begin_of_text|>")
    assert PATH is not None
    ids = HFTokenizer.from_dir(PATH).encode(prompt, add_special_tokens=False)
    chat = llm.generate([ids], SamplingParams(max_tokens=256, temperature=0.0))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.text.startswith("def ")


def test_corpus_selection_and_chat_exchanges(tmp_path: Path) -> None:
    for rel in ["a.py", "pkg/b.py", "test/c.py", "pkg/tests/d.py", "site-packages/e.py", "encodings/f.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    (tmp_path / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (tmp_path / "_sysconfigdata_x.py").write_text("build = {}\n")
    assert [p.relative_to(tmp_path).as_posix() for p in corpus_files(tmp_path)] == ["a.py", "pkg/b.py"]
    source = (
        "class A:\n    @property\n    def f(self, x):\n        '''Return x twice.\n\n        More.'''\n"
        "        return 2 * x\n\n\ndef g():\n    pass\n"
    )
    assert chat_exchanges(source) == [
        ("Return x twice.", "def f(self, x):\n    '''Return x twice.\n\n    More.'''\n    return 2 * x\n")
    ]
    assert chat_exchanges("def broken(:\n") == []
