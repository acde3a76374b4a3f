"""Incremental detokenizers: a token stream into text, never taking back what was emitted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from chunkwise.engine.tokenizer.base import ByteTokenizer, NoTokenizer, Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


def make_detokenizer(
    tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, *, skip_special_tokens: bool = True
) -> Detokenizer:
    """The incremental detokenizer for `tokenizer`: bytes need no window (ByteDetokenizer); anything else
    re-decodes a short window per token (IncrementalDetokenizer)."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteDetokenizer(skip_special_tokens=skip_special_tokens)
    if isinstance(tokenizer, NoTokenizer):
        return NoText()
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)


class NoText:
    """The detokenizer of a model without a tokenizer: its outputs are token ids only."""

    def step(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class ByteDetokenizer:
    """The byte tokenizer's ids through Python's incremental UTF-8 decoder: one call per token, holding back
    only an incomplete character, with exactly the output of ByteTokenizer.decode over the same ids."""

    _SPECIAL: ClassVar[dict[int, bytes]] = {ByteTokenizer.BOS: b"<s>", ByteTokenizer.EOS: b"</s>"}

    def __init__(self, *, skip_special_tokens: bool = True) -> None:
        import codecs

        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._decoder.decode(bytes((token_id,)))
        special = self._SPECIAL.get(token_id)
        if special is None or self.skip_special_tokens:
            return ""
        return self._decoder.decode(special)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time.

    Each step decodes only a short window: the tokens already emitted just before the new ones (so that
    tokenizers that treat a leading space or byte specially see the same context as a full decode) and the
    ones not yet emitted. Text ending in U+FFFD is held back, because the replacement character may be an
    incomplete UTF-8 sequence that the next token completes. Joining every step's return value and flush()
    gives the decode of the whole output.
    """

    # Prompt tokens decoded as context before the first generated one, as vLLM does.
    PROMPT_CONTEXT = 5
    # Held-back tokens past which we look for a safe split (see _force_split); a UTF-8 character is at
    # most 4 bytes, so a longer run of replacement characters is mostly final.
    MAX_PENDING = 8
    # Trim the id list once this many ids lie wholly before the window.
    TRIM_AT = 1024
    # Ids without text (skipped special tokens) the window may hold before they become its start.
    MAX_TEXTLESS = 32

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-self.PROMPT_CONTEXT :]) if prompt_ids else []
        self._ids: list[int] = context
        # A byte-fallback decoder turns a whole run of byte pieces into text at once (U+FFFD for each byte if
        # the run is not valid UTF-8, its ASCII bytes included), so a run's text is final only once it ends.
        self._byte_pieces: frozenset[int] = getattr(tokenizer, "byte_piece_ids", frozenset())
        # Skipped special tokens vanish before decoding: byte pieces on either side of one join a single run.
        self._held = self._byte_pieces | (
            tokenizer.special_token_ids if skip_special_tokens and self._byte_pieces else frozenset()
        )
        self._prefix = 0  # window start: context for decoding, already emitted
        self._read = len(context)  # first id whose text has not been emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        if token_id in self._held:
            return ""  # a byte run in progress: held whole until a token that is not a byte piece ends it
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix)
        if new_text.endswith(REPLACEMENT_CHAR):
            if len(self._ids) - self._read > self.MAX_PENDING:
                return self._force_split(prefix_text, new_text)
            return ""
        if len(new_text) > len(prefix_text):
            self._advance(len(self._ids))
            return new_text[len(prefix_text) :]
        if new_text == prefix_text:
            # The new ids have no text (skipped special tokens). They count as read, but the window keeps
            # its start: the next word's text depends on the context before them (a decoder that joins
            # words with spaces would lose the space). A long run of them ends up as context itself.
            self._read = len(self._ids)
            if self._read - self._prefix > self.MAX_TEXTLESS:
                self._advance(self._read)
        return ""

    def flush(self) -> str:
        """The text still held back (at the end of generation, an incomplete character is final)."""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix)
        self._advance(len(self._ids))
        return new_text[len(prefix_text) :]

    def _advance(self, read: int) -> None:
        self._prefix, self._read = self._read, read
        if self._prefix >= self.TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _force_split(self, prefix_text: str, new_text: str) -> str:
        """A long run of tokens all ending in U+FFFD is undecodable bytes, not one character in progress.

        Emit up to the last split k that cuts no character (the two halves decode to the whole) and
        leaves at least 3 characters after it: those are at least 3 bytes, and only the trailing
        incomplete character (at most 3 bytes) can still change. Without this the window, and each
        step's cost, would grow with the run.
        """
        for k in range(len(self._ids) - 1, self._read, -1):
            tail = self._decode(k)
            if len(tail) < 3:
                continue
            head = self._decode(self._prefix, k)
            if len(head) > len(prefix_text) and head + tail == new_text:
                self._advance(k)
                return head[len(prefix_text) :]
        return ""
