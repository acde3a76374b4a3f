"""Rotary frequencies, with the scaling types checkpoints use, computed as transformers computes them.

`rope_frequencies` gives the inverse frequencies and the factor cos/sin are multiplied by; the rotary layer
(layers.RotaryEmbedding) builds its table from them. Each formula follows transformers' modeling_rope_utils in
its arithmetic order, in fp32, so the tables agree bit for bit with what transformers multiplies by.

Only scalings that do not depend on the running sequence length are computed: "dynamic" (NTK) and
"longrope" switch frequencies once a sequence passes a threshold, recomputed per forward pass in
transformers, which no batched engine with chunked prefill reproduces; below that threshold they are exactly
the default and the short factors, and the loader caps the context there (model/hf_config.py).
"""

from __future__ import annotations

import math

import torch

from chunkwise.engine.datatypes.config import RopeScaling


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] fp32, attention factor) for a rotary of `head_dim` dimensions."""
    if scaling is None or scaling.rope_type in ("default", "dynamic"):
        return _default_inv_freq(head_dim, theta), 1.0
    kind = scaling.rope_type
    if kind == "linear":
        return _default_inv_freq(head_dim, theta) / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(head_dim, theta, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "longrope":
        return _longrope_short(head_dim, theta, scaling)
    raise ValueError(f"rope_type {kind!r} has no frequencies here")


def _llama3(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth ramp between."""
    assert s.low_freq_factor is not None and s.high_freq_factor is not None
    assert s.original_max_position_embeddings is not None
    inv_freq = _default_inv_freq(head_dim, theta)
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (over the correction
    range given by beta_fast/beta_slow rotations), and cos/sin scaled by the attention factor."""
    assert s.original_max_position_embeddings is not None
    factor = s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = correction_dim(s.beta_fast)
    high = correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope_short(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """LongRoPE's short factors (what transformers uses up to original_max_position_embeddings) and its
    attention factor, which applies at every length."""
    assert s.original_max_position_embeddings is not None
    attention_factor = s.attention_factor
    if attention_factor is None:
        factor = s.factor
        attention_factor = (
            1.0
            if factor <= 1.0
            else math.sqrt(1 + math.log(factor) / math.log(s.original_max_position_embeddings))
        )
    ext = torch.tensor(s.short_factor, dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta**shape), attention_factor
