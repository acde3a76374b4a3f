"""chunkwise: an LLM serving engine whose iteration-level scheduler decides how much of peak you get.

Importing the package is cheap and imports no torch: the public names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]

if TYPE_CHECKING:
    from chunkwise.engine import LLM, AsyncEngine
    from chunkwise.engine.datatypes.lora import LoRARequest
    from chunkwise.engine.datatypes.outputs import CompletionOutput, RequestOutput
    from chunkwise.engine.datatypes.sampling_params import SamplingParams
    from chunkwise.engine.datatypes.structured_output import StructuredOutput

_LAZY = {
    "LLM": "chunkwise.engine",
    "AsyncEngine": "chunkwise.engine",
    "LoRARequest": "chunkwise.engine.datatypes.lora",
    "RequestOutput": "chunkwise.engine.datatypes.outputs",
    "CompletionOutput": "chunkwise.engine.datatypes.outputs",
    "SamplingParams": "chunkwise.engine.datatypes.sampling_params",
    "StructuredOutput": "chunkwise.engine.datatypes.structured_output",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chunkwise' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
