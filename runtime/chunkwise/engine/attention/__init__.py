"""Attention backends: one interface (backend.py), chosen once at start-up."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING

from chunkwise.engine.attention.backend import AttentionBackend, AttentionMetadata, kv_cache_shape

if TYPE_CHECKING:
    from chunkwise.engine.attention.triton_backend import TritonAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend", "kv_cache_shape"]

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")

log = logging.getLogger(__name__)


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """The backend called `name` for `device`: "torch" is the reference, "auto" the best one built.

    "auto" takes Triton on CUDA when triton is installed, chunkwise's C++ kernels on CPU when they build, and
    the torch reference otherwise, saying why in the log. Triton is an optional dependency, so it is imported
    only here, once chosen.
    """
    from chunkwise.engine.attention.torch_ref import TorchAttentionBackend

    device_type = device.split(":", 1)[0]
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device_type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not {device_type!r}")
        return _cpu_backend()
    if name == "auto":
        if device_type == "cuda" and _triton_installed():
            backend = _triton_backend(device_type)
            # With TRITON_INTERPRET=1 on a GPU machine every kernel would run in numpy on host copies.
            if not backend.interpreted:
                return backend
        if device_type == "cpu":
            from chunkwise.engine.kernels import KernelUnavailable

            try:
                return _cpu_backend()
            except KernelUnavailable as e:
                log.warning(
                    "attention: the torch reference, since chunkwise's CPU kernels are unavailable: %s", e
                )
        return TorchAttentionBackend()
    if name == "triton":
        return _triton_backend(device_type)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def _cpu_backend() -> AttentionBackend:
    from chunkwise.engine.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend()


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreter_requested() -> bool:
    # The spellings triton itself reads as true.
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


def _triton_backend(device_type: str) -> TritonAttentionBackend:
    if device_type not in ("cuda", "cpu"):
        raise ValueError(
            f"the Triton attention backend runs on CUDA (or on CPU in Triton's interpreter), not {device_type!r}"
        )
    if not _triton_installed():
        raise ValueError("the Triton attention backend needs the triton package (pip install triton)")
    cpu_message = (
        "on CPU the Triton attention backend runs only in Triton's interpreter: set TRITON_INTERPRET=1 "
        "before chunkwise is imported (it is slow, for tests); use 'torch' or 'auto' to serve on CPU"
    )
    # Checked before the kernels module is first imported: triton.jit reads TRITON_INTERPRET only then.
    if device_type == "cpu" and not _interpreter_requested():
        raise ValueError(cpu_message)
    from chunkwise.engine.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    if device_type == "cpu" and not backend.interpreted:
        raise ValueError(cpu_message + " (the kernels were already built for a GPU in this process)")
    return backend
