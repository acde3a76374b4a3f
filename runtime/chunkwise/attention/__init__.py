"""Attention backends: one interface (backend.py), chosen once at start-up."""

from __future__ import annotations

from chunkwise.attention.backend import AttentionBackend, AttentionMetadata, kv_cache_shape

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend", "kv_cache_shape"]

BACKEND_NAMES = ("auto", "torch", "triton")


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """The backend called `name` for `device`: "torch" is the reference, "auto" the best one built."""
    from chunkwise.attention.torch_ref import TorchAttentionBackend

    if name == "torch":
        return TorchAttentionBackend()
    if name == "auto":
        # Triton will take CUDA once its kernels exist; until then the reference serves everywhere.
        return TorchAttentionBackend()
    if name == "triton":
        raise ValueError("the Triton attention backend is not built yet; use 'torch' or 'auto'")
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
