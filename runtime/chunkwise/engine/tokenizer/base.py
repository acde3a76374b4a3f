"""The Tokenizer protocol, and the two tokenizers that need no files: byte-level for the built-in models,
and none at all for a checkpoint without tokenizer.json."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

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
