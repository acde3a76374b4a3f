"""Tokenizers: byte-level for the built-in models, Hugging Face `tokenizers` for real checkpoints, and an
incremental detokenizer that turns a token stream into text without ever taking back what it emitted."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

REPLACEMENT_CHAR = "\ufffd"

# A small ChatML-style template so the built-in models can serve /v1/chat/completions.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def special_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; 256 is <s> (BOS) and 257 is </s> (EOS)."""

    BOS = 256
    EOS = 257
    VOCAB_SIZE = 258

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def chat_template(self) -> str | None:
        return BYTE_CHAT_TEMPLATE

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset((self.BOS, self.EOS))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif not skip_special_tokens and i == self.BOS:
                out += b"<s>"
            elif not skip_special_tokens and i == self.EOS:
                out += b"</s>"
            # Anything else is outside the vocabulary and has no text.
        return out.decode("utf-8", errors="replace")


class NoTokenizer:
    """A checkpoint without tokenizer.json: token ids in, token ids out, and no text either way.

    Guessing a tokenizer (the byte one, say) would serve text that is wrong; instead a text prompt is refused
    with the reason, and outputs carry their token ids with empty text."""

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_ids: Iterable[int]) -> None:
        self._vocab_size = vocab_size
        self._bos = bos_token_id
        self._eos = tuple(dict.fromkeys(eos_token_ids))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def chat_template(self) -> str | None:
        return None

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self._eos) | (frozenset() if self._bos is None else frozenset((self._bos,)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(
            "this model has no tokenizer (no tokenizer.json in its directory): give the prompt as token ids"
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return str(token["content"])
    return None


class HFTokenizer:
    """A `tokenizers.Tokenizer` (tokenizer.json) plus the facts tokenizer_config.json adds to it."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self._bos = bos_token_id
        self._eos = tuple(dict.fromkeys(eos_token_ids))
        self._chat_template = chat_template
        added = tokenizer.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        self._byte_pieces = _byte_piece_ids(tokenizer)
        special.update(self._eos)
        if bos_token_id is not None:
            special.add(bos_token_id)
        self._special = frozenset(special)

    @classmethod
    def from_dir(cls, path: str | Path, *, extra_eos_token_ids: Iterable[int] = ()) -> HFTokenizer:
        """Load <path>/tokenizer.json; bos/eos and the chat template come from tokenizer_config.json
        (or chat_template.jinja / chat_template.json, where newer transformers versions put it)."""
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(path)
        try:
            tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise ValueError(f"cannot read tokenizer {path / 'tokenizer.json'}: {e}") from e
        cfg: dict[str, Any] = {}
        cfg_path = path / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"malformed JSON in {cfg_path}: {e}") from e
            if isinstance(loaded, dict):
                cfg = loaded

        def token_id(key: str) -> int | None:
            content = _token_content(cfg.get(key))
            return None if content is None else tok.token_to_id(content)

        eos: list[int] = []
        eos_id = token_id("eos_token")
        if eos_id is not None:
            eos.append(eos_id)
        eos.extend(extra_eos_token_ids)
        return cls(
            tok,
            bos_token_id=token_id("bos_token"),
            eos_token_ids=eos,
            chat_template=_read_chat_template(path, cfg),
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special

    @property
    def byte_piece_ids(self) -> frozenset[int]:
        """The <0xXX> pieces a byte-fallback BPE decodes run by run (empty for other tokenizers)."""
        return self._byte_pieces

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _byte_piece_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of <0x00>..<0xFF> when the model falls back to bytes and the decoder joins them (ByteFallback)."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if not model.get("byte_fallback") or "ByteFallback" not in json.dumps(spec.get("decoder")):
        return frozenset()
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    return frozenset(
        i for piece, i in vocab.items() if len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">"
    )


def _read_chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        # Several named templates: the unnamed use is "default".
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    js = path / "chat_template.json"
    if js.is_file():
        try:
            data = json.loads(js.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed JSON in {js}: {e}") from e
        if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
            return str(data["chat_template"])
    return None


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
