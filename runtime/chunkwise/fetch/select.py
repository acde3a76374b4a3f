"""Which of a source's files a fetch takes: all the engine can use, only the tokenizer's, or --include globs."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

# What HFTokenizer.from_dir and read_checkpoint read (tokenizer/hf.py, model/loader.py), plus the files of
# slow tokenizers' vocabularies, so that the router's pod gets a working tokenizer and nothing else.
# Matched at the top of the model directory only, which is where the loader looks.
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "config.json",
        "generation_config.json",
        "chat_template.jinja",
        "chat_template.json",
    }
)
# Weight formats the loader never reads (it loads *.safetensors only). Hub repos often carry the same
# weights two or three times (pytorch_model.bin, Llama's original/consolidated.*.pth, tf_model.h5 beside
# the safetensors): skipping them halves the download. Only for hf:// (a bucket prefix holds what its
# owner put there) and only when the repo has safetensors, so that nothing is silently dropped otherwise.
UNUSED_WEIGHT_SUFFIXES = frozenset(
    {".bin", ".pth", ".pt", ".ckpt", ".h5", ".msgpack", ".onnx", ".onnx_data", ".gguf", ".ot", ".tflite"}
)


@dataclass(frozen=True)
class Selection:
    tokenizer_only: bool = False
    includes: tuple[str, ...] = ()  # fnmatch globs on the path relative to DIR ('*' also crosses '/')

    @property
    def mode(self) -> str:
        if self.tokenizer_only:
            return "tokenizer-only"
        return "subset" if self.includes else "full"

    def matches(self, path: str) -> bool:
        if not self.tokenizer_only and not self.includes:
            return True
        if self.tokenizer_only and path in TOKENIZER_FILES:
            return True
        return any(fnmatch.fnmatchcase(path, glob) for glob in self.includes)

    def covers(self, other: Selection) -> bool:
        """Whether a directory fetched with this selection holds everything `other` would fetch."""
        if self.mode == "full":
            return True
        if other.mode == "full":
            return False
        return (self.tokenizer_only or not other.tokenizer_only) and set(other.includes) <= set(self.includes)


def select(
    paths: Sequence[str], selection: Selection, *, skip_unused_weights: bool
) -> tuple[list[str], list[str]]:
    """(the paths to fetch, the paths skipped as weight formats the engine cannot load)."""
    chosen = [p for p in paths if selection.matches(p)]
    if (
        not skip_unused_weights
        or selection.mode != "full"
        or not any(p.endswith(".safetensors") for p in chosen)
    ):
        return chosen, []
    unused = [p for p in chosen if PurePosixPath(p).suffix in UNUSED_WEIGHT_SUFFIXES]
    skipped = set(unused)
    return [p for p in chosen if p not in skipped], unused
