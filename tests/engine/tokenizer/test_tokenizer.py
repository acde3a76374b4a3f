"""Byte and Hugging Face tokenizers, and the incremental detokenizer's one promise: what it emits is
never taken back, and all of it joined is the full decode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from chunkwise.engine.tokenizer import (
    ByteDetokenizer,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    make_detokenizer,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: naïve café, 中文字符, emoji 🙂🚀, Ελληνικά, русский.",
    "def main():\n    return 42  # the answer",
]


def stream(tokenizer, ids, prompt_ids=None, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kw)
    pieces = [detok.step(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


def byte_stream(tokenizer, ids, prompt_ids=None, **kw) -> list[str]:
    detok = ByteDetokenizer(**kw)
    pieces = [detok.step(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


# Both detokenizers the byte tokenizer can use: the generic window and the one the engine picks for it.
BYTE_STREAMS = [stream, byte_stream]


# ---------------------------------------------------------------- byte tokenizer


def test_byte_roundtrip_and_specials():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert ids[1:] == list(text.encode("utf-8"))
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
    assert tok.vocab_size == 258
    assert tok.eos_token_ids == (257,)
    assert tok.special_token_ids == {256, 257}
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<s>hi</s>"
    assert tok.decode([104, 105, 257]) == "hi"
    # A lone continuation byte is not text.
    assert tok.decode([0xB8]) == "\ufffd"
    assert tok.chat_template is not None


@pytest.mark.parametrize("stream", BYTE_STREAMS)
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_bytes_never_emit_partial_characters(text, stream):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # Multi-byte characters are held back until complete, so some steps emit nothing ...
    if len(ids) > len(text):
        assert "" in pieces[:-1]
    # ... and a completed character comes out whole, on the step of its last byte.
    emitted = 0
    for i, piece in enumerate(pieces[:-1]):
        emitted += len(piece.encode("utf-8"))
        assert emitted == i + 1 or bytes(ids[emitted : i + 1]).decode("utf-8", errors="ignore") == ""


@pytest.mark.parametrize("stream", BYTE_STREAMS)
def test_incremental_with_prompt_and_special_tokens(stream):
    tok = ByteTokenizer()
    prompt = tok.encode("Prompt ends mid-way: ")
    out = [
        *tok.encode("中文", add_special_tokens=False),
        tok.EOS,
        *tok.encode("ok", add_special_tokens=False),
    ]
    assert "".join(stream(tok, out, prompt)) == "中文ok"
    assert "".join(stream(tok, out, prompt, skip_special_tokens=False)) == "中文</s>ok"


@pytest.mark.parametrize("stream", BYTE_STREAMS)
@pytest.mark.parametrize("seed", range(20))
def test_incremental_random_bytes_match_full_decode(seed, stream):
    # A random model emits arbitrary bytes: invalid sequences, truncated characters, long runs of them.
    rng = random.Random(seed)
    tok = ByteTokenizer()
    ids = [rng.choice([rng.randrange(0x80, 0x100), rng.randrange(0, 0x80), 0xE4, 0xB8, 0xF0, 0x9F])]
    for _ in range(300):
        ids.append(
            rng.choice([rng.randrange(0x80, 0x100), rng.randrange(0, 0x80), 0xE4, 0xB8, 0xF0, 0x9F, 257])
        )
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == tok.decode(ids, skip_special_tokens=False)


def test_long_invalid_run_is_streamed_not_hoarded():
    tok = ByteTokenizer()
    ids = [0xFF] * 100 + list("中".encode())
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(i) for i in ids]
    # Most of the run comes out before the end, and the pending window stays short.
    assert len("".join(pieces[:100])) >= 90
    assert len(detok._ids) - detok._prefix <= 2 * IncrementalDetokenizer.MAX_PENDING
    assert "".join(pieces) + detok.flush() == tok.decode(ids)


def test_long_generation_keeps_window_and_buffer_bounded():
    tok = ByteTokenizer()
    text = "αβγ abc " * 1000
    detok = IncrementalDetokenizer(tok)
    out = []
    for i in tok.encode(text, add_special_tokens=False):
        out.append(detok.step(i))
        assert len(detok._ids) <= IncrementalDetokenizer.TRIM_AT + 2 * IncrementalDetokenizer.MAX_PENDING
    out.append(detok.flush())
    assert "".join(out) == text


# ---------------------------------------------------------------- HF tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 20, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    path = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>", "special": True},
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            }
        )
    )
    return path


def test_hf_tokenizer_from_dir(hf_dir):
    tok = HFTokenizer.from_dir(hf_dir, extra_eos_token_ids=[7])
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    bos, eos, im_end = raw.token_to_id("<s>"), raw.token_to_id("</s>"), raw.token_to_id("<|im_end|>")
    assert tok.bos_token_id == bos
    assert tok.eos_token_ids == (eos, 7)
    assert {bos, eos, im_end} <= tok.special_token_ids
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tok.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == bos
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_hf_chat_template_from_jinja_file(tmp_path, hf_dir):
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == ()


def test_hf_tokenizer_errors(tmp_path, hf_dir):
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="malformed JSON"):
        HFTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_incremental_matches_full_decode(hf_dir, text):
    tok = HFTokenizer.from_dir(hf_dir)
    ids = tok.encode(text, add_special_tokens=False)
    # Byte-level BPE splits the rarer characters into single bytes: the same hold-back applies.
    pieces = stream(tok, ids, prompt_ids=tok.encode("context "))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_metaspace_leading_spaces_survive_streaming(tmp_path):
    # SentencePiece-style decoders drop the space of a window's first word: the context window must
    # keep every later word's space.
    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, "▁world": 3, "▁again": 4, "!": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer.from_dir(tmp_path)
    ids = [2, 3, 4, 5, 3]
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "Hello world again! world"


# ---------------------------------------------------------------- a SentencePiece-style byte-fallback BPE

EMOJI_CJK = [
    "Hello 🙂 world 🚀!",
    "中文字符和日本語のテキスト",
    "naïve café — ünïcödé 👩‍👩‍👧 done",
    "mixed 中 🙂 the end",
]


@pytest.fixture(scope="module")
def fallback_tok(tmp_path_factory) -> HFTokenizer:
    from tests.hf_models import save_byte_fallback_tokenizer

    path = tmp_path_factory.mktemp("fallback")
    save_byte_fallback_tokenizer(path)
    return HFTokenizer.from_dir(path)


@pytest.mark.parametrize("text", EMOJI_CJK)
def test_byte_fallback_text_streams_as_the_full_decode(fallback_tok, text):
    ids = fallback_tok.encode(text, add_special_tokens=False)
    pieces = fallback_tok_stream(fallback_tok, ids)
    assert "".join(pieces) == fallback_tok.decode(ids) == text
    # Characters made of byte pieces are held back until whole, never streamed as U+FFFD.
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("seed", range(12))
def test_random_ids_with_special_tokens_stream_as_the_full_decode(fallback_tok, seed):
    """What a random model emits: any id, byte pieces that form no character, and special tokens between
    words (skipped by default, whose neighbours' spaces must survive)."""
    rng = random.Random(seed)
    vocab = fallback_tok.vocab_size
    special = sorted(fallback_tok.special_token_ids)
    ids = [rng.choice(special) if rng.random() < 0.15 else rng.randrange(vocab) for _ in range(200)]
    for skip in (True, False):
        pieces = fallback_tok_stream(fallback_tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == fallback_tok.decode(ids, skip_special_tokens=skip)


def test_a_skipped_special_token_keeps_the_next_words_space(fallback_tok):
    words = fallback_tok.encode("The scheduler decides which requests run", add_special_tokens=False)
    eot = fallback_tok.eos_token_ids[0]
    ids = [*words[:3], eot, *words[3:]]
    assert "".join(fallback_tok_stream(fallback_tok, ids)) == fallback_tok.decode(ids)


def fallback_tok_stream(tok, ids, **kw) -> list[str]:
    # As the engine builds it: no prompt context, so the text is exactly that of the output ids alone.
    detok = make_detokenizer(tok, **kw)
    return [*(detok.step(i) for i in ids), detok.flush()]
