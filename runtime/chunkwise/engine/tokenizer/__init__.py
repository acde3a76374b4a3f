"""Tokenizers: byte-level for the built-in models, Hugging Face `tokenizers` for real checkpoints, and an
incremental detokenizer that turns a token stream into text without ever taking back what it emitted.

base.py holds the Tokenizer protocol, ByteTokenizer and NoTokenizer; hf.py HFTokenizer; detokenize.py the
detokenizers. Callers import from here.
"""

from chunkwise.engine.tokenizer.base import BYTE_CHAT_TEMPLATE, ByteTokenizer, NoTokenizer, Tokenizer
from chunkwise.engine.tokenizer.detokenize import (
    REPLACEMENT_CHAR,
    ByteDetokenizer,
    Detokenizer,
    IncrementalDetokenizer,
    NoText,
    make_detokenizer,
)
from chunkwise.engine.tokenizer.hf import HFTokenizer

__all__ = [
    "BYTE_CHAT_TEMPLATE",
    "REPLACEMENT_CHAR",
    "ByteDetokenizer",
    "ByteTokenizer",
    "Detokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "NoText",
    "NoTokenizer",
    "Tokenizer",
    "make_detokenizer",
]
