"""Chat templating: messages -> one prompt string.

The checkpoint's own template (`tokenizer.chat_template`, a Jinja template as in Hugging Face's
tokenizer_config.json) is rendered with Jinja2 in a sandbox, with the variables transformers passes:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `raise_exception` (a template's way of
refusing a conversation, which becomes a 400).

When the tokenizer has no template, or Jinja2 is not installed, the default format is used (the built-in
byte-level models' template is the same format):

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

one "<|role|>\\ncontent\\n" block per message, then "<|assistant|>\\n" to prompt the reply.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

logger = logging.getLogger("chunkwise.server")

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (a client error: 400)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def default_format(messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages)
    return text + "<|assistant|>\n" if add_generation_prompt else text


def message_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """OpenAI content: a string, or a list of parts of which only {"type": "text"} is supported here."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text":
            raise ChatTemplateError(f"unsupported content part type {kind!r}: this model accepts only text")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError("a text content part needs a string 'text'")
        texts.append(text)
    return "".join(texts)


def jinja_available() -> bool:
    try:
        import jinja2  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(
    messages: Sequence[ChatMessage],
    template: str | None,
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """Render `messages` with `template`, or with the default format when there is none (or no Jinja2)."""
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    for m in messages:
        if m.role not in ROLES:
            raise ChatTemplateError(f"unknown role {m.role!r}; expected one of {', '.join(ROLES)}")
    if template is None or not jinja_available():
        if template is not None:
            logger.warning("jinja2 is not installed: using the default chat format, not the model's template")
        return default_format(messages, add_generation_prompt)
    import jinja2

    try:
        compiled = _compile(template)
    except jinja2.TemplateError as e:
        raise RuntimeError(f"the model's chat template does not compile: {e}") from e
    try:
        return str(
            compiled.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
            )
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template could not render these messages: {e}") from e
