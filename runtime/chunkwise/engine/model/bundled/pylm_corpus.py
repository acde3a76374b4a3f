"""What the bundled `pylm` checkpoint was trained on and how its chats are written: its special tokens and
chat template, and the corpus (the Python standard library's own sources, with the held-out split the
benchmarks draw prompts from). The trainer itself is `tools/train_pylm.py`, outside the serving package; this
module is what the package and its tests read of it, and imports nothing heavy.
"""

from __future__ import annotations

import ast
import sysconfig
import textwrap
import zlib
from pathlib import Path

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", END_OF_TURN]
# One "<|role|>\ncontent<|end|>\n" block per message, then "<|assistant|>\n" to prompt the reply. Rendered as
# transformers does (Jinja, trim_blocks and lstrip_blocks), and by chunkwise's server the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Path parts that leave a file out of the corpus: tests, third-party packages, and generated data tables
# (codec maps, pydoc's topic strings, the build's sysconfig) that would teach the model nothing about code.
EXCLUDED_PARTS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__pycache__", "turtledemo"}
)
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
HELD_OUT_EVERY = 50
# A chat exchange's longest function (characters); longer ones stay only in their file.
MAX_CHAT_FUNCTION_CHARS = 1500


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[Path]:
    """The corpus, sorted by relative path: UTF-8 .py files outside the excluded directories."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts[:-1]) or rel.parts[0].startswith(EXCLUDED_PREFIXES):
            continue
        if rel.name.startswith(EXCLUDED_PREFIXES):
            continue
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(path)
    return files


def is_held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELD_OUT_EVERY == 0


def split_corpus(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(training, held-out) texts by relative path."""
    train: dict[str, str] = {}
    held: dict[str, str] = {}
    for path in corpus_files(root):
        rel = path.relative_to(root).as_posix()
        (held if is_held_out(rel) else train)[rel] = path.read_text(encoding="utf-8")
    return train, held


def chat_exchanges(source: str) -> list[tuple[str, str]]:
    """(request, function source) for each documented function: the docstring's first paragraph asks, the
    function (dedented, decorators left out) answers."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        ask = " ".join(doc.strip().split("\n\n")[0].split())
        if node.end_lineno is None:
            continue
        # Whole lines from the `def` to the end: the dedent removes the indentation of a method.
        segment = "".join(lines[node.lineno - 1 : node.end_lineno])
        if not ask or len(segment) > MAX_CHAT_FUNCTION_CHARS or len(ask) > 300:
            continue
        out.append((ask, textwrap.dedent(segment).rstrip() + "\n"))
    return out


def chat_text(ask: str, answer: str) -> str:
    """What CHAT_TEMPLATE renders for one user turn, then the reply and its end of turn."""
    return f"<|user|>\n{ask}{END_OF_TURN}\n<|assistant|>\n{answer}{END_OF_TURN}\n"
