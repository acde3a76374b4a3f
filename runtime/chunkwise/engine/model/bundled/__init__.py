"""Checkpoints that ship inside the package: real Hugging Face directories, served by name with no download.

`pylm` is a small Llama trained here on the Python standard library's own sources (see docs/models.md and
`tools/train_pylm.py`). A name here is resolved to its directory, which then loads through the
same HF-directory path as any checkpoint; the random presets (`tiny`, `small`) live in chunkwise.engine.model.presets.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent

# The bundled checkpoints, by the name `--model` takes.
BUNDLED = ("pylm",)


def bundled_path(name: str) -> Path | None:
    """The directory of the bundled checkpoint `name`, or None when `name` is not one (or is not installed)."""
    if name not in BUNDLED:
        return None
    path = MODELS_DIR / name
    return path if (path / "config.json").is_file() else None


def resolve_model_path(name_or_path: str) -> Path:
    """`name_or_path` as a directory: a bundled checkpoint's, or the path itself."""
    return bundled_path(name_or_path) or Path(name_or_path)
