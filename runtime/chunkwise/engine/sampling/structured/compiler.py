"""Structured-output specs -> llguidance grammars and matchers, for one engine's tokenizer.

One LLTokenizer per engine (built on first use from the engine's tokenizer, with the model's vocabulary size
so that masks are as wide as its logits); each spec compiled once into a pristine matcher kept in a bounded
LRU cache, from which every request gets a copy (`LLMatcher.deep_copy`, microseconds, against milliseconds
to build one). Thread-safe: the server checks specs on its thread while the step loop makes matchers on its.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chunkwise.engine.datatypes.structured_output import StructuredOutput
from chunkwise.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

# How JSON is written: one separator and no free whitespace, so a weak (or random) model cannot spend its
# tokens on blanks, and the output reads like json.dumps's. A schema's own "x-guidance" may override these.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 128


class StructuredOutputError(ValueError):
    """A spec that cannot be compiled (a client error: its message says why)."""


class StructuredOutputUnavailable(StructuredOutputError):
    """This engine cannot constrain its output (no tokenizer llguidance can read, no EOS token)."""


def llg() -> Any:
    """llguidance, imported on first use: an engine that never constrains an output (a GPU bench, a machine
    without the package) loads without it. Missing, it makes structured outputs unavailable, with the fix."""
    try:
        import llguidance
    except ImportError as e:
        raise StructuredOutputUnavailable(
            f"structured outputs need the llguidance package, which is not installed ({e}): "
            "pip install 'llguidance>=1.9,<2'"
        ) from None
    return llguidance


class _ByteTokens:
    """llguidance's view of the byte-level tokenizer: ids 0..255 are the bytes, then <s> and </s>, then
    (when the model's vocabulary is wider) tokens that no text encodes to."""

    def __init__(self, vocab_size: int) -> None:
        tok = ByteTokenizer()
        self.eos_token_id = tok.EOS
        self.bos_token_id = tok.BOS
        self.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]
        self.tokens += [f"<|unused_{i}|>".encode() for i in range(len(self.tokens), vocab_size)]
        self.special_token_ids = [tok.BOS, tok.EOS, *range(tok.VOCAB_SIZE, vocab_size)]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def build_lltokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> LLTokenizer:
    """llguidance's tokenizer for this engine's. Raises StructuredOutputUnavailable when there is none."""
    if not eos_token_ids:
        raise StructuredOutputUnavailable(
            "structured outputs need an EOS token to end the output where the grammar does; this model has none"
        )
    eos = list(eos_token_ids)
    llguidance = llg()  # its own message when it is missing
    try:
        if isinstance(tokenizer, ByteTokenizer):
            wrapper = llguidance.TokenizerWrapper(_ByteTokens(max(vocab_size, ByteTokenizer.VOCAB_SIZE)))
            return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
        if isinstance(tokenizer, HFTokenizer):
            return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
    except Exception as e:  # llguidance refuses some tokenizers (unusual pre-tokenizers, decoders)
        raise StructuredOutputUnavailable(
            f"structured outputs are not available for this model: llguidance cannot read its tokenizer ({e})"
        ) from e
    raise StructuredOutputUnavailable(
        f"structured outputs are not available for this model: its tokenizer ({type(tokenizer).__name__}) "
        "has no text vocabulary to constrain"
    )


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for a spec (not yet checked)."""
    try:
        if spec.kind == "json":
            return llg().LLMatcher.grammar_from_json_schema(spec.schema(), defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llg().LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            # Lark string literals are JSON's: json.dumps escapes quotes, backslashes and control characters.
            alternatives = " | ".join(json.dumps(c) for c in spec.choices())
            return llg().LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        return llg().LLMatcher.grammar_from_lark(spec.spec)
    except ValueError as e:
        raise StructuredOutputError(f"structured_outputs: invalid {_NAMES[spec.kind]}: {e}") from e


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._lltok: LLTokenizer | None = None
        self._unavailable: StructuredOutputUnavailable | None = None
        self._cache: OrderedDict[StructuredOutput, LLMatcher] = OrderedDict()
        self.num_compiled = 0  # grammars built (cache misses), for tests and logs

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def lltokenizer(self) -> LLTokenizer:
        """Built once, on first use. Raises StructuredOutputUnavailable (every time) if it cannot be."""
        with self._lock:
            return self._lltokenizer_locked()

    def _lltokenizer_locked(self) -> LLTokenizer:
        if self._unavailable is not None:
            raise self._unavailable
        if self._lltok is None:
            try:
                self._lltok = build_lltokenizer(self._tokenizer, self.vocab_size, self._eos)
            except StructuredOutputUnavailable as e:
                self._unavailable = e
                raise
        return self._lltok

    def _pristine(self, spec: StructuredOutput) -> LLMatcher:
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
            lltok = self._lltokenizer_locked()
        # Compiled outside the lock (llguidance drops the GIL while it builds): two threads compiling the
        # same new spec at once both build it, and one of the two copies is kept.
        grammar = grammar_text(spec)
        is_error, messages = llg().LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if is_error:
            raise StructuredOutputError(f"structured_outputs: invalid {_NAMES[spec.kind]}: {messages[0]}")
        matcher = llg().LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(
                f"structured_outputs: invalid {_NAMES[spec.kind]}: {matcher.get_error()}"
            )
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = matcher
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        """Raise StructuredOutputError when `spec` cannot constrain this engine's output."""
        self._pristine(spec)

    def matcher(self, spec: StructuredOutput) -> LLMatcher:
        """A fresh matcher for one request (its own state, from the spec's cached compiled grammar)."""
        return self._pristine(spec).deep_copy()
