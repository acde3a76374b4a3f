"""A Hugging Face checkpoint's tokenizer: tokenizer.json through `tokenizers`, plus what
tokenizer_config.json (or chat_template.jinja / .json) says of its special tokens and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


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

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds its token trie from)."""
        return str(self._tok.to_str())

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
