"""chunkwise's elementwise CPU kernels against the torch code they replace, per call, in fp32 and bf16:
silu_and_mul over the benchmark model's MLP (2 x 1536), rms_norm (512), the residual add fused with it
(fused_add_rms_norm, against the add and rms_norm kernel it replaces), the KV cache write (write_kv, against the
two index_copy_ it replaces: 2 KV heads of 64, as views of the fused qkv output), rotary (12 heads of 64), the argmax of
fp32 logits (vocab 32000) and the sampler's exponential race (softmax, exponential_, divide and argmax in torch).
Every kernel result is checked against torch's first.

    taskset -c 1 .venv/bin/python bench/cpu/elementwise.py          # the build this CPU gets
    CHUNKWISE_CPU_ISA=avx2 taskset -c 1 .venv/bin/python bench/cpu/elementwise.py   # the AVX2 build
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from chunkwise.engine import kernels

print(f"kernels: {kernels.load().name}")
torch.set_num_threads(1)
ops = torch.ops.chunkwise


def per_call_us(fn, n: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


print(f"{'dtype':10}{'rows':>6}{'silu_and_mul':>22}{'rms_norm':>22}{'rotary':>22}")
for dtype in (torch.float32, torch.bfloat16):
    for rows in (1, 32, 256, 1024):
        x = torch.randn(rows, 3072).to(dtype)
        out = torch.empty(rows, 1536, dtype=dtype)
        ops.silu_and_mul(out, x)
        torch.testing.assert_close(out, F.silu(x[:, :1536]) * x[:, 1536:], atol=2e-2, rtol=2e-2)
        silu = per_call_us(lambda x=x, out=out: ops.silu_and_mul(out, x))
        silu_t = per_call_us(lambda x=x: F.silu(x[:, :1536]) * x[:, 1536:])
        h = torch.randn(rows, 512).to(dtype)
        w = torch.randn(512).to(dtype)
        o2 = torch.empty_like(h)
        norm = per_call_us(lambda h=h, w=w, o2=o2: ops.rms_norm(o2, h, w, 1e-6))
        norm_t = per_call_us(
            lambda h=h, w=w, dtype=dtype: (
                w * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            )
        )
        q = torch.randn(rows, 12, 64).to(dtype)
        table = torch.randn(4096, 2, 32)
        pos = torch.randint(0, 4096, (rows,))
        rot = per_call_us(lambda q=q, table=table, pos=pos: ops.rotary_embedding(q, table, pos))
        cs = table.index_select(0, pos).to(dtype)
        cos, sin = cs[:, 0, None, :], cs[:, 1, None, :]
        rot_t = per_call_us(
            lambda q=q, cos=cos, sin=sin: torch.cat(
                (q[..., :32] * cos - q[..., 32:] * sin, q[..., 32:] * cos + q[..., :32] * sin), dim=-1
            )
        )
        name = str(dtype).removeprefix("torch.")
        print(
            f"{name:10}{rows:>6}{silu:>9.1f} us (torch {silu_t:6.1f}){norm:>8.1f} us (torch {norm_t:6.1f})"
            f"{rot:>8.1f} us (torch {rot_t:6.1f})"
        )


def add_then_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What RMSNorm.add ran before fused_add_rms_norm: the add in torch, then the norm kernel."""
    h = x + residual
    out = torch.empty_like(h)
    ops.rms_norm(out, h, w, 1e-6)
    return out


print(f"\n{'dtype':10}{'rows':>6}{'fused_add_rms_norm':>34}  (best of 5, alternating)")
for dtype in (torch.float32, torch.bfloat16):
    for rows in (1, 32, 256, 1024):
        x, residual = torch.randn(rows, 512).to(dtype), torch.randn(rows, 512).to(dtype)
        w = torch.randn(512).to(dtype)
        want_norm, want_sum = add_then_norm(x, residual, w), x + residual
        ops.fused_add_rms_norm(x, residual, w, 1e-6)
        assert torch.equal(x, want_norm) and torch.equal(residual, want_sum)
        fused, unfused = float("inf"), float("inf")
        for _ in range(5):
            fused = min(
                fused, per_call_us(lambda x=x, r=residual, w=w: ops.fused_add_rms_norm(x, r, w, 1e-6))
            )
            unfused = min(unfused, per_call_us(lambda x=x, r=residual, w=w: add_then_norm(x, r, w)))
        name = str(dtype).removeprefix("torch.")
        print(
            f"{name:10}{rows:>6}{fused:>12.2f} us (add + rms_norm {unfused:6.2f} us, {unfused / fused:.2f}x)"
        )

print(f"\n{'dtype':10}{'rows':>6}{'write_kv':>34}  (best of 5, alternating)")
for dtype in (torch.float32, torch.bfloat16):
    for rows in (1, 32, 256, 1024):
        cache = torch.zeros(2, 512, 16, 2, 64, dtype=dtype)
        flat = cache.view(2, 512 * 16, 2, 64)
        qkv = torch.randn(rows, 12, 64).to(dtype)
        k, v = qkv[:, 8:10], qkv[:, 10:]
        slots = torch.randperm(512 * 16)[:rows]

        def copies(k=k, v=v, slots=slots, flat=flat, dtype=dtype) -> None:
            flat[0].index_copy_(0, slots, k.to(dtype))
            flat[1].index_copy_(0, slots, v.to(dtype))

        ops.write_kv(cache, k, v, slots)
        assert torch.equal(flat[0][slots], k) and torch.equal(flat[1][slots], v)
        fused, unfused = float("inf"), float("inf")
        for _ in range(5):
            fused = min(fused, per_call_us(lambda c=cache, k=k, v=v, s=slots: ops.write_kv(c, k, v, s)))
            unfused = min(unfused, per_call_us(copies))
        name = str(dtype).removeprefix("torch.")
        print(
            f"{name:10}{rows:>6}{fused:>12.2f} us (2 x index_copy_ {unfused:6.2f} us, {unfused / fused:.2f}x)"
        )

print(f"\n{'rows':>6}{'argmax':>30}{'exponential race':>34}")
for rows in (1, 32, 64, 256):
    logits = torch.randn(rows, 32000)
    assert torch.equal(kernels.argmax(logits), logits.argmax(-1))
    am = per_call_us(lambda logits=logits: kernels.argmax(logits))
    am_t = per_call_us(lambda logits=logits: logits.argmax(-1))
    inv_t = torch.ones(rows)
    seeds = torch.randint(0, 1 << 62, (rows,))

    def torch_race(logits: torch.Tensor = logits) -> torch.Tensor:
        probs = (logits - logits.amax(-1, keepdim=True)).softmax(-1)
        q = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(torch.float32).tiny)
        return (probs / q).argmax(-1)

    race = per_call_us(
        lambda logits=logits, inv_t=inv_t, seeds=seeds: kernels.exponential_race(logits, inv_t, seeds)
    )
    race_t = per_call_us(torch_race)
    print(f"{rows:>6}{am:>12.1f} us (torch {am_t:7.1f}){race:>14.1f} us (torch {race_t:8.1f})")
