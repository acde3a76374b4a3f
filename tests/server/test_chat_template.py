"""Chat templating: the default format, the byte model's template, and a checkpoint-style template."""

from __future__ import annotations

import pytest

from chunkwise.engine.tokenizer import BYTE_CHAT_TEMPLATE
from chunkwise.server.chat import (
    ChatMessage,
    ChatTemplateError,
    default_format,
    jinja_available,
    message_text,
    render_chat,
)

MESSAGES = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!")]
EXPECTED = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!\n<|assistant|>\n"

# A Llama-3-like template: writes the BOS itself, refuses a conversation with raise_exception.
HF_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def test_default_format() -> None:
    assert default_format(MESSAGES) == EXPECTED
    assert default_format(MESSAGES, add_generation_prompt=False) == EXPECTED.removesuffix("<|assistant|>\n")
    assert render_chat(MESSAGES, None) == EXPECTED


def test_jinja2_is_installed_here() -> None:
    # The rest of this file exercises the Jinja path; the default format covers environments without it.
    assert jinja_available()


def test_byte_model_template_renders_the_documented_format() -> None:
    assert render_chat(MESSAGES, BYTE_CHAT_TEMPLATE) == EXPECTED
    assert render_chat(MESSAGES, BYTE_CHAT_TEMPLATE, add_generation_prompt=False) == default_format(
        MESSAGES, add_generation_prompt=False
    )


def test_checkpoint_template_with_special_tokens() -> None:
    text = render_chat(MESSAGES[:2], HF_TEMPLATE, bos_token="<s>", eos_token="</s>")
    assert text == "<s><|start|>system\nBe brief.<|end|><|start|>user\nHi<|end|><|start|>assistant\n"


def test_template_refusal_is_a_client_error() -> None:
    with pytest.raises(ChatTemplateError, match="tool messages are not supported"):
        render_chat([ChatMessage("tool", "42")], HF_TEMPLATE)


def test_template_cannot_escape_the_sandbox() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        render_chat(MESSAGES, evil)


@pytest.mark.parametrize(
    ("messages", "match"),
    [([], "at least one message"), ([ChatMessage("wizard", "x")], "unknown role")],
)
def test_invalid_conversations(messages: list[ChatMessage], match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(messages, None)


def test_message_text() -> None:
    assert message_text(None) == ""
    assert message_text("plain") == "plain"
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    with pytest.raises(ChatTemplateError, match="image_url"):
        message_text([{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ChatTemplateError):
        message_text([{"type": "text", "text": 3}])
