"""From a request body to what routing needs: the prompt's token ids, their block hashes, the output length.

The prompt must be tokenized exactly as the replica will tokenize it, or the block hashes never match the
engine's: completions encode the prompt with the tokenizer's special tokens (the byte tokenizer prepends
BOS); chat renders the messages with the model's chat template first, as chunkwise.server.endpoints does.
Anything the router cannot read is routed without prefix information, and the replica answers with the
error it would give a direct client.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from chunkwise.engine.cache.hashing import BlockHash, block_extra, hash_prefix_blocks
from chunkwise.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from chunkwise.server.chat import ChatMessage, ChatTemplateError, message_text, render_chat

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# OpenAI's (and the server's) max_tokens when a completion request leaves it out.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class RoutedRequest:
    """What the policies see of one request."""

    path: str
    prompt_tokens: int = 0
    block_hashes: tuple[BlockHash, ...] = ()
    # l in the routing formula: max_tokens when the client gave one, else the router's default.
    output_tokens: int = 0
    stream: bool = False
    model: str | None = None
    # The prompt's block hashes as a LoRA adapter named `model` would cache them (empty: not computed);
    # the cost model reads them at a replica that serves `model` as an adapter.
    adapter_block_hashes: tuple[BlockHash, ...] = ()


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte` (the built-in models) or a Hugging Face model directory holding tokenizer.json."""
    if spec in ("byte", "tiny", "small"):
        return ByteTokenizer()
    return HFTokenizer.from_dir(spec)


class PromptReader:
    def __init__(
        self,
        tokenizer: Tokenizer,
        block_size: int,
        default_output_tokens: int,
        adapters: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """`adapters`: the LoRA adapter names the fleet serves (its replicas' metrics say), whose requests'
        prompts are hashed as their adapter caches them too."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.default_output_tokens = default_output_tokens
        self.adapters = adapters

    def read(self, path: str, body: bytes) -> RoutedRequest:
        try:
            data = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            data = None
        return self.read_parsed(path, data)

    def read_parsed(self, path: str, data: Any) -> RoutedRequest:
        """`read` for a body already decoded from JSON (the endpoint picker checks it is JSON first)."""
        if not isinstance(data, dict):
            return RoutedRequest(path=path, output_tokens=self.default_output_tokens)
        stream = data.get("stream") is True
        model = data.get("model") if isinstance(data.get("model"), str) else None
        output_tokens = self._output_tokens(path, data)
        ids: list[int] | None = None
        try:
            if path == COMPLETIONS:
                ids = self._completion_ids(data.get("prompt"))
            elif path == CHAT:
                ids = self._chat_ids(data)
        except (ChatTemplateError, ValueError, TypeError, AttributeError, KeyError):
            ids = None  # the replica will say what is wrong with it
        if not ids:
            return RoutedRequest(path=path, output_tokens=output_tokens, stream=stream, model=model)
        adapter_hashes: tuple[BlockHash, ...] = ()
        if model is not None and model in self.adapters():
            adapter_hashes = tuple(hash_prefix_blocks(ids, self.block_size, block_extra(None, model)))
        return RoutedRequest(
            path=path,
            prompt_tokens=len(ids),
            block_hashes=tuple(hash_prefix_blocks(ids, self.block_size)),
            output_tokens=output_tokens,
            stream=stream,
            model=model,
            adapter_block_hashes=adapter_hashes,
        )

    def _output_tokens(self, path: str, data: Mapping[str, Any]) -> int:
        for key in ("max_completion_tokens", "max_tokens"):
            value = data.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        if path == COMPLETIONS and "max_tokens" not in data:
            return COMPLETIONS_DEFAULT_MAX_TOKENS
        return self.default_output_tokens

    def _completion_ids(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) if prompt else None
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
            if len(prompt) == 1:
                return self._completion_ids(prompt[0])
        return None

    def _chat_ids(self, data: Mapping[str, Any]) -> list[int] | None:
        raw = data.get("messages")
        if not isinstance(raw, list) or not raw:
            return None
        messages = [ChatMessage(str(m["role"]), message_text(m.get("content"))) for m in raw]
        tok = self.tokenizer
        bos = "" if tok.bos_token_id is None else tok.decode([tok.bos_token_id], skip_special_tokens=False)
        eos = "" if not tok.eos_token_ids else tok.decode([tok.eos_token_ids[0]], skip_special_tokens=False)
        add_generation_prompt = data.get("add_generation_prompt", True) is not False
        text = render_chat(
            messages,
            tok.chat_template,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
        )
        # The same rule as the server: a template that writes the BOS itself gets no second one.
        return tok.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
