"""The start-up warm-up of packed oneDNN layers: every row count a step can run a layer at, once per shape."""

from __future__ import annotations

import pytest
import torch

from chunkwise.engine.model import layers
from chunkwise.engine.model.layers import Linear, onednn_row_counts, onednn_rows, warm_up_onednn

pytestmark = pytest.mark.isa


def test_row_counts_are_every_padded_count_once():
    counts = onednn_row_counts(300)
    assert counts == sorted(set(counts))
    assert set(counts) == {onednn_rows(m) for m in range(1, 301)}
    assert counts[-1] == onednn_rows(300)


def test_warm_up_calls_each_shape_at_each_count_within_the_flop_cap(monkeypatch):
    # fp32 weights pack wherever oneDNN exists (bf16 ones only where it takes bf16): this runs on every CPU.
    monkeypatch.setattr(layers, "cpu_has_avx512", lambda: True)
    model = torch.nn.Module()
    model.a = Linear(64, 96)
    model.b = Linear(64, 96)  # the same shape as a: warmed once
    model.c = Linear(96, 4096)
    model.lm_head = Linear(96, 500)
    for m in model.children():
        m.prepare(widen_half_on_cpu=False)
        assert m.kernel == "onednn-packed"
    seen: list[tuple[int, int]] = []
    real = Linear.forward
    monkeypatch.setattr(
        Linear, "forward", lambda self, x: (seen.append((self.out_features, x.shape[0])), real(self, x))[1]
    )
    monkeypatch.setattr(layers, "WARM_UP_MAX_FLOPS", 2 * 100 * 96 * 4096)  # c stops past 100 rows
    calls, seconds = warm_up_onednn(model, max_rows=200, head_rows=40)
    assert calls == len(seen) and seconds >= 0
    by_layer: dict[int, list[int]] = {}
    for out, rows in seen:
        by_layer.setdefault(out, []).append(rows)
    assert by_layer[96] == onednn_row_counts(200)  # a and b share a shape: once
    assert by_layer[4096] == [m for m in onednn_row_counts(200) if m <= 100]
    assert by_layer[500] == onednn_row_counts(40)  # the head: one row per sequence
