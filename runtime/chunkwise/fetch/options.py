"""The fetch's settings, with their defaults declared once (the command's flags take them from here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkwise.fetch.select import Selection

DEFAULT_RETRIES = 5
DEFAULT_BACKOFF_S = 1.0
# A read that stalls this long is a dead connection: drop it and resume.
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_PROGRESS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class FetchOptions:
    selection: Selection = field(default_factory=Selection)
    token: str | None = None  # a bearer token for hf://, gs:// and http(s)://, from --token-file
    force: bool = False  # replace a different model's files in DIR rather than refuse
    retries: int = DEFAULT_RETRIES
    backoff_s: float = DEFAULT_BACKOFF_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S
    # --adapter: the URI must be a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors), not a model.
    adapter: bool = False
