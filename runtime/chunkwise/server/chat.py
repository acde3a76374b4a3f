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
    # An assistant turn's tool calls (OpenAI's shape) and a tool turn's answer to one, for templates that
    # render them; None when absent.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("tool_calls", "tool_call_id", "name"):
            value = getattr(self, key)
            if value is not None:
                d[key] = value
        return d


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
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` with `template`, or with the default format when there is none (or no Jinja2).
    `tools` (OpenAI's tool definitions) reach the template as `tools`, as transformers passes them; a
    template that does not use them renders as without."""
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
                messages=[m.as_dict() for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
                tools=tools,
            )
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template could not render these messages: {e}") from e
