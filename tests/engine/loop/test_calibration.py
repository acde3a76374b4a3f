"""Start-up calibration: the probe's timings wait for the device (a step that samples nothing never
synchronises), and the KV cache on CUDA is what --gpu-memory-utilization leaves after a profiled step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chunkwise.engine.loop.calibration import (
    MemoryReading,
    ProfileStep,
    StartupProbe,
    kv_blocks_for_utilization,
    kv_blocks_on_device,
    profile_memory,
    run_profile_step,
)


class RecordingRunner:
    """A runner on a (pretend) CUDA device whose steps only enqueue work, as a GPU runner's do."""

    def __init__(self, events: list[str]) -> None:
        self.device = torch.device("cuda")
        self.events = events

    def execute(self, so: object) -> None:
        scheduled = getattr(so, "scheduled", [])
        self.events.append("execute" if scheduled else "cleanup")


def test_time_forward_waits_for_the_device_before_and_after_the_timed_step(monkeypatch: pytest.MonkeyPatch):
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    kv = SimpleNamespace(block_size=16, pool=SimpleNamespace(num_blocks=8))
    probe = StartupProbe(RecordingRunner(events), kv, max_model_len=64)  # type: ignore[arg-type]
    assert probe.time_forward(20) >= 0
    # The warm-up, then the timed forward between two waits, then the runner forgets the request.
    assert events == ["execute", "sync", "execute", "sync", "cleanup"]


# -- KV sizing on CUDA (gpu_memory_utilization) --------------------------------------------------------------

MIB, GIB = 1 << 20, 1 << 30
# An H200 as nvidia-smi reports it, and Llama-3-8B in bf16: 8,030,261,248 parameters; KV per token
# 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB, so 2 MiB per 16-token block.
H200 = 143_771 * MIB
WEIGHTS_8B = 8_030_261_248 * 2
BLOCK_8B = 16 * 2 * 32 * 8 * 128 * 2
ACTIVATIONS = 3 * GIB // 2
NON_TORCH = GIB // 2


def size(utilization: float, max_model_len: int | None = 8192, total: int = H200) -> int:
    return kv_blocks_for_utilization(
        total=total,
        peak=WEIGHTS_8B + ACTIVATIONS,
        non_torch=NON_TORCH,
        utilization=utilization,
        block_bytes=BLOCK_8B,
        block_size=16,
        max_model_len=max_model_len,
    )


def test_an_8b_model_on_an_h200_gets_what_0_9_of_the_device_leaves():
    # 0.9 x 143,771 MiB = 129,393.9 MiB; less 15,316.3 MiB of weights, 1,536 of activations and 512 outside
    # torch: 112,029.6 MiB, 56,014 blocks of 2 MiB (896,224 tokens, ~109 GiB).
    assert size(0.9) == 56_014
    budget = int(H200 * 0.9) - WEIGHTS_8B - ACTIVATIONS - NON_TORCH
    assert 56_014 * BLOCK_8B <= budget < 56_015 * BLOCK_8B
    # The whole device: 14,377.1 MiB more, 7,189 blocks more (with the 0.9 budget's remainder).
    assert size(1.0) == 63_203


def test_a_utilization_below_the_weights_is_refused_with_the_utilization_that_fits():
    with pytest.raises(ValueError) as e:
        size(0.1)  # 14.0 GiB, less than the 15.0 GiB of weights
    msg = str(e.value)
    assert "--gpu-memory-utilization 0.1 lets this engine use 14.04 GiB of the device's 140.40 GiB" in msg
    assert "leaves -2.92 GiB, 0 blocks of 16 tokens" in msg
    assert "one request of max_model_len 8192 tokens needs 512 (1.00 GiB)" in msg
    # Weights, activations, outside torch and 512 blocks: 17.96 GiB, 12.8% of the device.
    assert "raise --gpu-memory-utilization to 0.13 or more" in msg
    assert "--max-model-len" not in msg  # nothing fits: a shorter max_model_len would not help
    assert size(0.13) >= 512  # the suggestion is enough ...
    with pytest.raises(ValueError):
        size(0.12)  # ... and the least that is


def test_a_cache_shorter_than_one_max_model_len_request_is_refused_with_the_length_that_fits():
    # 0.2 of the device is 28,754.2 MiB; less 17,364.3 MiB leaves 11,389.9 MiB: 5,694 blocks, where one
    # 131,072-token request needs 8,192.
    with pytest.raises(ValueError) as e:
        size(0.2, max_model_len=131_072)
    msg = str(e.value)
    assert "5694 blocks of 16 tokens, where one request of max_model_len 131072 tokens needs 8192" in msg
    assert "raise --gpu-memory-utilization to 0.24 or more" in msg
    assert "lower --max-model-len to 91104 or less" in msg
    assert size(0.2, max_model_len=91_104) == 5694
    assert size(0.24, max_model_len=131_072) >= 8192


def test_without_max_model_len_one_block_is_enough_and_a_device_too_small_says_so():
    # max_model_len not set: the engine cuts it to what the cache holds, so only an empty cache is refused.
    assert size(0.9, max_model_len=None) == 56_014
    # A 16 GB card: the 8B model's 15,316 MiB of weights, its activations and a block do not fit at all.
    t4 = 15_360 * MIB
    with pytest.raises(ValueError) as e:
        size(1.0, max_model_len=None, total=t4)
    msg = str(e.value)
    assert "where one block needs 2.0 MiB" in msg
    assert "use a smaller model or a device with more memory" in msg
    assert "raise --gpu-memory-utilization" not in msg  # not even 1.0 would do


class FakeDevice:
    """torch's caching allocator as far as the sizing reads it: the peak of live tensors since the last
    reset, a reservation that keeps freed blocks until emptied, and memory that other code holds."""

    def __init__(self, total: int, weights: int, load_peak: int, non_torch: int) -> None:
        self.total, self.non_torch = total, non_torch
        self.allocated, self.peak, self.reserved = weights, load_peak, load_peak
        self.events: list[str] = []

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n  # freed blocks stay reserved

    def reset_peak(self) -> None:
        self.events.append("reset")
        self.reserved = self.peak = self.allocated

    def read(self) -> MemoryReading:
        self.events.append("read")
        used = self.reserved + self.non_torch
        return MemoryReading(self.total, used, self.allocated, self.peak, self.reserved)


def test_profile_counts_the_steps_peak_less_its_own_kv_cache_and_what_torch_does_not_hold():
    # Loading peaked at twice the weights (a checkpoint read beside the tensors it fills): not the step's.
    dev = FakeDevice(H200, WEIGHTS_8B, load_peak=2 * WEIGHTS_8B, non_torch=NON_TORCH)
    scratch_kv = 256 * BLOCK_8B

    def step() -> ProfileStep:
        dev.events.append("step")
        dev.alloc(scratch_kv)
        dev.alloc(ACTIVATIONS)
        dev.free(ACTIVATIONS)
        dev.free(scratch_kv)
        return ProfileStep(num_rows=256, num_tokens=1024, kv_bytes=scratch_kv)

    p = profile_memory(dev, step)
    assert dev.events == ["reset", "read", "step", "read"]
    assert p.total == H200
    assert p.weights == WEIGHTS_8B
    assert p.peak == WEIGHTS_8B + ACTIVATIONS
    assert p.activations == ACTIVATIONS
    assert p.non_torch == NON_TORCH  # the reserved-but-free cache is torch's, not outside it
    assert p.step.num_rows == 256


def tiny_runner_factory(max_model_len: int = 256):
    from chunkwise.engine.attention import get_attention_backend
    from chunkwise.engine.model.loader import load_model
    from chunkwise.engine.worker.model_runner import ModelRunner

    backend = get_attention_backend("torch", "cpu")
    loaded = load_model("tiny", dtype=torch.float32, device="cpu", backend=backend)
    asked: list[int] = []

    def make(num_tokens: int, num_rows: int):
        def runner(num_blocks: int) -> ModelRunner:
            asked.append(num_blocks)
            return ModelRunner(
                loaded.model,
                loaded.config,
                backend,
                num_blocks=num_blocks,
                block_size=16,
                num_host_blocks=0,
                dtype=torch.float32,
                device=torch.device("cpu"),
                max_num_tokens=num_tokens,
                max_num_reqs=num_rows,
                max_model_len=max_model_len,
            )

        return runner

    return make, asked, loaded.config


@pytest.mark.parametrize(
    ("num_tokens", "num_rows", "max_model_len", "rows", "tokens", "blocks"),
    [
        (64, 8, 256, 8, 64, 8),  # 8 rows of 8 tokens, a block each
        (100, 3, 256, 3, 100, 9),  # 34 + 33 + 33 tokens: 3 blocks each
        (10, 256, 256, 10, 10, 10),  # more rows than tokens: a token a row
        (1024, 2, 100, 2, 200, 14),  # no row longer than max_model_len: 2 x 100 tokens, 7 blocks each
    ],
)
def test_the_profiled_step_is_the_largest_the_scheduler_can_compose_and_samples_every_row(
    num_tokens: int, num_rows: int, max_model_len: int, rows: int, tokens: int, blocks: int
):
    make, asked, cfg = tiny_runner_factory(max_model_len)
    step = run_profile_step(
        make(num_tokens, num_rows),
        num_tokens=num_tokens,
        num_rows=num_rows,
        block_size=16,
        max_model_len=max_model_len,
    )
    assert (step.num_rows, step.num_tokens) == (rows, tokens)  # num_rows counts the rows the runner sampled
    assert asked == [blocks]
    # Its KV blocks are what the real cache will replace; the sink block the runner adds stays in the peak,
    # since the real runner has one too.
    per_layer = 2 * blocks * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert step.kv_bytes == cfg.num_hidden_layers * per_layer


def test_kv_blocks_on_device_profiles_through_the_runner_and_logs_the_breakdown(
    caplog: pytest.LogCaptureFixture,
):
    make, asked, _ = tiny_runner_factory()
    dev = FakeDevice(H200, WEIGHTS_8B, load_peak=WEIGHTS_8B, non_torch=NON_TORCH)
    real = make(1024, 256)

    def runner(num_blocks: int):
        r = real(num_blocks)
        dev.alloc(sum(t.numel() * t.element_size() for t in r.kv_caches))
        dev.alloc(ACTIVATIONS)  # what the step would take on the device (the fake sees no CPU tensor)
        dev.free(ACTIVATIONS)
        return r

    with caplog.at_level("INFO", logger="chunkwise.engine.loop.calibration"):
        blocks = kv_blocks_on_device(
            runner,
            dev,
            utilization=0.9,
            block_bytes=BLOCK_8B,
            block_size=16,
            max_num_batched_tokens=1024,
            max_num_seqs=256,
            max_model_len=8192,
            profile_len=256,
        )
    assert asked == [256] and blocks == 56_014
    assert (
        "GPU memory: 140.40 GiB total x --gpu-memory-utilization 0.90 = 126.36 GiB for this engine: weights "
        "14.96 GiB, activation peak 1.50 GiB (1024 tokens in 256 rows, sampled), outside torch 512.0 MiB, "
        "KV cache 109.40 GiB (56014 blocks, 896224 tokens)"
    ) in caplog.text
