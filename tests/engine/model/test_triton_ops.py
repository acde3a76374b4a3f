"""The model's Triton RMSNorm (with its residual add) and rotary kernels, run in Triton's CPU interpreter
(conftest sets TRITON_INTERPRET=1), against the torch path of the same layers (Hugging Face's numerics); and
what they save: the torch ops one layer dispatches for its norms and rotation.

On CPU a layer never picks these (they are for CUDA tensors); the tests set the layer's kernel module by
hand, as prepare() does on a GPU. triton is imported unconditionally: a missing install must fail here.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import triton  # noqa: F401  (fails the module loudly where triton is missing)
from torch.utils._python_dispatch import TorchDispatchMode

from chunkwise.engine.attention import get_attention_backend
from chunkwise.engine.attention.backend import AttentionMetadata, kv_cache_shape
from chunkwise.engine.datatypes.config import RopeScaling
from chunkwise.engine.model import triton_ops
from chunkwise.engine.model.layers import RMSNorm, RotaryEmbedding
from chunkwise.engine.model.llama import LlamaForCausalLM
from chunkwise.engine.model.presets import PRESETS

REPO = Path(__file__).resolve().parents[3]
# What a one-ulp difference in rounding allows: fp32 sums in another order, bf16 roundings at one more
# place (the torch path rounds cos/sin and each product to bf16; the kernel rounds once).
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def torch_norm(dim: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(dim, generator=gen))
    return norm.to(dtype)


def triton_norm(norm: RMSNorm) -> RMSNorm:
    twin = RMSNorm(norm.weight.shape[0], norm.eps).to(norm.weight.dtype)
    with torch.no_grad():
        twin.weight.copy_(norm.weight)
    twin.triton = triton_ops
    return twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 80])
def test_rms_norm_matches_the_torch_path(dtype: torch.dtype, dim: int):
    gen = torch.Generator().manual_seed(0)
    norm = torch_norm(dim, dtype, gen)
    fast = triton_norm(norm)
    x = (3 * torch.randn(7, dim, generator=gen)).to(dtype)
    out = fast(x)
    torch.testing.assert_close(out, norm(x), **TOL[dtype])
    # Per head, over a strided view (Qwen3's q/k norm reads q and k in place inside the fused qkv rows).
    qkv = (3 * torch.randn(5, 6 * dim, generator=gen)).to(dtype)
    k = qkv[:, 2 * dim : 5 * dim].view(5, 3, dim)
    assert not k.is_contiguous()
    torch.testing.assert_close(fast(k), norm(k), **TOL[dtype])
    padded = (3 * torch.randn(5, 3, dim + 8, generator=gen)).to(dtype)[..., :dim]  # heads apart
    torch.testing.assert_close(fast(padded), norm(padded), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_and_normalises_the_sum(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    norm = torch_norm(96, dtype, gen)
    fast = triton_norm(norm)
    x = torch.randn(9, 96, generator=gen).to(dtype)
    residual = torch.randn(9, 96, generator=gen).to(dtype)
    want_sum, want = norm.add(x, residual.clone())
    kept = residual.clone()
    got_sum, got = fast.add(x, kept)
    assert got_sum is kept  # the residual stream updated in place: no new tensor
    if dtype == torch.float32:
        assert torch.equal(got_sum, want_sum)  # one rounding of the same sum
    else:
        # Within one bf16 rounding step of `x + residual`: on a GPU the cast rounds to nearest even, as
        # torch does; Triton's interpreter rounds bf16 casts its own way (a neighbour, at most).
        assert ((got_sum.float() - want_sum.float()).abs() <= want_sum.float().abs() * 2**-7).all()
    torch.testing.assert_close(got, want, **TOL[dtype])


def rotary_pair(scaling: RopeScaling | None, head_dim: int) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    slow = RotaryEmbedding(head_dim, 256, 10000.0, scaling)
    fast = RotaryEmbedding(head_dim, 256, 10000.0, scaling)
    fast.triton = triton_ops
    return slow, fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), [(6, 16), (20, 80)])
def test_rotary_matches_the_torch_path_in_place_over_the_fused_qkv_rows(
    dtype: torch.dtype, heads: int, head_dim: int
):
    """20 heads span two programs' head blocks; head_dim 80 a half (40) that is not a power of two."""
    gen = torch.Generator().manual_seed(2)
    yarn = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    for scaling in (None, yarn):
        slow, fast = rotary_pair(scaling, head_dim)
        t = 11
        qkv = torch.randn(t, (heads + 2) * head_dim, generator=gen).to(dtype)
        positions = torch.randint(0, 256, (t,), generator=gen)
        qk = qkv[:, : heads * head_dim].view(t, heads, head_dim)
        original = qk.clone()
        want = slow.apply(original.clone(), slow.lookup(positions, dtype))
        rest = qkv[:, heads * head_dim :].clone()
        got = fast.apply(qk, fast.lookup(positions, dtype))
        assert got.data_ptr() == qk.data_ptr()  # rotated where it lies
        torch.testing.assert_close(got, want, **TOL[dtype])
        assert torch.equal(qkv[:, heads * head_dim :], rest)  # v untouched
        # A head stride that is not head_dim (heads padded apart): the kernel follows the view's strides.
        padded = torch.randn(t, heads, head_dim + 8, generator=gen).to(dtype)[..., :head_dim]
        want_padded = slow.apply(padded.clone(), slow.lookup(positions, dtype))
        torch.testing.assert_close(
            fast.apply(padded, fast.lookup(positions, dtype)), want_padded, **TOL[dtype]
        )
        if dtype == torch.bfloat16:
            # Against the rotation in fp32 rounded once, the kernel is as close as one rounding allows.
            ref = slow.apply(original.float(), slow.lookup(positions, torch.float32))
            assert (got.float() - ref).abs().max() <= 2**-7 * ref.abs().max()


def tiny_model(qk_norm: bool) -> tuple[LlamaForCausalLM, Any]:
    config = dataclasses.replace(PRESETS["tiny"], qk_norm=qk_norm, num_hidden_layers=3)
    backend = get_attention_backend("torch", "cpu")
    torch.manual_seed(3)
    model = LlamaForCausalLM(config, backend)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return model, config


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_model_on_the_triton_path_gives_the_torch_path_hidden_states(qk_norm: bool):
    """The layers' residual stream carried into the next norm (one fused add and norm each), the in-place
    rotation and the per-head q/k norm, end to end over a prefill and a decode step with kept rows."""
    model, config = tiny_model(qk_norm)
    block = 4
    t = 10
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 7, 10]),
        seq_lens=torch.tensor([7, 3]),
        block_tables=torch.tensor([[0, 1], [2, 0]]),
        slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 9, 10]),
        query_lens_host=[7, 3],
        seq_lens_host=[7, 3],
        max_query_len=7,
        max_seq_len=7,
        block_size=block,
    )
    ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2])
    keep = torch.tensor([6, 9])

    def run(use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ops = triton_ops if use_triton else None
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.triton = ops
        model.model.rotary.triton = ops
        shape = kv_cache_shape(3, block, config.num_key_value_heads, config.head_dim)
        caches = [torch.zeros(shape) for _ in range(config.num_hidden_layers)]
        with torch.inference_mode():
            return model(ids, positions, caches, meta), model(ids, positions, caches, meta, keep=keep)

    (want_all, want_kept), (got_all, got_kept) = run(False), run(True)
    torch.testing.assert_close(got_all, want_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kept, want_kept, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kept, want_all[keep], rtol=1e-4, atol=1e-4)


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class Launches:
    """Stands in for a kernel: records each launch, runs nothing (what the GPU would run is not dispatched
    by torch; the interpreter's own tensor traffic would be)."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.log.append(self.name)


def test_one_layers_norms_and_rotation_take_three_launches_instead_of_two_dozen_ops(
    monkeypatch: pytest.MonkeyPatch,
):
    """Host work per decode step on a GPU is one dispatch and launch per op: a layer's input norm, its
    rotation and its post-attention add and norm, as torch ops and through the Triton kernels."""
    dim, heads, head_dim, t = 64, 6, 16, 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(t, dim, generator=gen)
    residual = torch.randn(t, dim, generator=gen)
    attn = torch.randn(t, dim, generator=gen)
    qk = torch.randn(t, heads, head_dim, generator=gen)
    positions = torch.arange(t)

    def layer(norm: RMSNorm, post: RMSNorm, rotary: RotaryEmbedding, launches: list[str]) -> int:
        rope = rotary.lookup(positions, x.dtype)  # once per step, not per layer: outside the count
        stream = residual.clone()
        with CountOps() as mode:
            stream, _ = norm.add(x, stream)
            rotary.apply(qk, rope)
            post.add(attn, stream)
        return len(mode.ops) + len(launches)

    slow_norm, slow_post = torch_norm(dim, torch.float32, gen), torch_norm(dim, torch.float32, gen)
    slow_rotary, fast_rotary = rotary_pair(None, head_dim)
    before = layer(slow_norm, slow_post, slow_rotary, [])
    launches: list[str] = []
    monkeypatch.setattr(triton_ops, "rms_norm_kernel", Launches(launches, "rms_norm"))
    monkeypatch.setattr(triton_ops, "rotary_kernel", Launches(launches, "rotary"))
    after = layer(triton_norm(slow_norm), triton_norm(slow_post), fast_rotary, launches)
    assert launches == ["rms_norm", "rotary", "rms_norm"]
    # torch: an add and ~8 ops per norm, ~7 for the rotation (a slice pair, four products, two sums, a cat);
    # Triton: each one launch and one output allocation (the rotation none).
    assert before >= 20, before
    assert after == 5, after


def test_the_kernels_compile_for_sm_90(tmp_path: Path):
    """What the interpreter cannot catch: both kernels, in the shapes an 8B model and a Qwen3 use, compile
    to cubins through Triton's real JIT (tests/engine/triton_compile_check.py --model-ops)."""
    script = REPO / "tests/engine/triton_compile_check.py"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "runtime"),
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),
        "TRITON_DEFAULT_FP_FUSION": "1",
    }
    result = subprocess.run(
        [sys.executable, str(script), "--model-ops"], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and all(": ok (" in line for line in lines), result.stdout


def test_only_the_torch_reference_keeps_torch_norms_on_a_gpu(monkeypatch: pytest.MonkeyPatch):
    """The torch backend's model is what the GPU token check compares Triton against: were its norms and
    rotation the same kernels, a bug in them could not show. (The CUDA check is faked: every tensor counts.)"""
    from types import SimpleNamespace

    from chunkwise.engine.model import layers
    from chunkwise.engine.model.loader import load_model

    monkeypatch.setattr(layers, "triton_kernels_for", lambda t: triton_ops)

    def kernels(backend: Any) -> set[Any]:
        model = load_model("tiny", dtype=torch.float32, device="cpu", backend=backend).model
        norms = {m.triton for m in model.modules() if isinstance(m, RMSNorm)}
        return norms | {model.model.rotary.triton}

    assert kernels(get_attention_backend("torch", "cpu")) == {None}
    assert kernels(SimpleNamespace(name="triton")) == {triton_ops}
