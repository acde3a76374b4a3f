"""dtype="auto": which dtype each device gets, and why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from chunkwise.engine import hardware
from chunkwise.engine.hardware import ONEDNN_PRIMITIVE_CACHE_CAPACITY

# Its expectations depend on the CPU's choices: `make test` runs it again under each CHUNKWISE_CPU_ISA.
pytestmark = pytest.mark.isa


@pytest.fixture
def bf16_units(monkeypatch):
    def set_units(present: bool) -> None:
        monkeypatch.setattr(hardware, "cpu_has_bf16_matmul", lambda: present)

    return set_units


def test_explicit_dtypes_are_kept():
    for name, dtype in hardware.DTYPES.items():
        choice = hardware.resolve_dtype(name, torch.device("cpu"), "bfloat16")
        assert choice.dtype == dtype and choice.name == name


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        hardware.resolve_dtype("float64", torch.device("cpu"), None)


def test_auto_on_cpu_follows_the_matrix_units(bf16_units):
    bf16_units(False)
    choice = hardware.resolve_dtype("auto", torch.device("cpu"), "bfloat16")
    assert choice.dtype == torch.float32
    assert "no bf16 matrix units" in choice.reason and "bfloat16" in choice.reason
    bf16_units(True)
    assert hardware.resolve_dtype("auto", torch.device("cpu"), "float32").dtype == torch.bfloat16


def test_auto_on_cuda_is_half_precision():
    cuda = torch.device("cuda")
    assert hardware.resolve_dtype("auto", cuda, "float32").dtype == torch.bfloat16
    assert hardware.resolve_dtype("auto", cuda, None).dtype == torch.bfloat16
    # A float16 checkpoint stays float16: bf16 would round what it stores.
    assert hardware.resolve_dtype("auto", cuda, "float16").dtype == torch.float16


def test_the_engine_logs_its_choice_and_records_the_resolved_dtype(caplog):
    from chunkwise.engine import EngineCore
    from chunkwise.engine.datatypes.config import engine_config_from_kwargs

    with caplog.at_level("INFO", logger="chunkwise.engine"):
        engine = EngineCore(engine_config_from_kwargs("tiny", max_model_len=64))
    expected = hardware.resolve_dtype("auto", torch.device("cpu"), None)
    assert engine.config.dtype == expected.name
    assert engine.loaded.model.model.embed_tokens.weight.dtype == expected.dtype
    assert any(r.getMessage() == f"dtype {expected.name} ({expected.reason})" for r in caplog.records)


def _onednn_capacity_after_load(env: dict[str, str]) -> str:
    """ONEDNN_PRIMITIVE_CACHE_CAPACITY as a fresh process has it once a model's weights are laid out."""
    code = (
        "import os, torch\n"
        "from chunkwise.engine.model.loader import load_model\n"
        "from chunkwise.engine.attention import get_attention_backend\n"
        "backend = get_attention_backend('auto', 'cpu')\n"
        "load_model('tiny', dtype=torch.float32, device='cpu', backend=backend)\n"
        "print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_onednn_primitive_cache_is_sized_for_serving_unless_the_environment_says() -> None:
    # Before the first primitive is made, so oneDNN reads it (measured: cached row counts run 15% faster).
    assert _onednn_capacity_after_load({}) == str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    assert _onednn_capacity_after_load({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "2048"}) == "2048"


def _caps(**flags: bool) -> dict[str, bool]:
    base = {"avx2": True, "fma3": True}
    return {**base, **flags}


AVX512_FLAGS = {f: True for f in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_bf16")}


@pytest.mark.parametrize(
    ("caps", "want"),
    [
        (_caps(), "avx2"),
        # AVX-512 without its bf16 dot products (Skylake): AVX2's choices (float32) are the right ones there.
        (_caps(**{**AVX512_FLAGS, "avx512_bf16": False}), "avx2"),
        (_caps(**AVX512_FLAGS), "avx512"),
        (_caps(**AVX512_FLAGS, amx_bf16=True, amx_tile=True), "amx"),
        ({"avx2": True}, "x86_64"),  # no FMA: the compiler's baseline
    ],
)
def test_detected_isa_follows_the_flags(monkeypatch, caps, want):
    monkeypatch.setattr(hardware, "cpu_capabilities", lambda: caps)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert hardware.detect_isa() == want


def test_the_isa_override_sets_every_choice_and_is_checked(monkeypatch):
    hardware.cpu_isa.cache_clear()
    try:
        monkeypatch.setattr(hardware, "detect_isa", lambda: "avx2")
        monkeypatch.setenv(hardware.ISA_ENV, "AMX")
        isa = hardware.cpu_isa()
        assert (isa.name, isa.kernels, isa.source) == ("amx", "avx2", "CHUNKWISE_CPU_ISA=amx")
        assert hardware.cpu_has_bf16_matmul() and hardware.cpu_has_avx512()
        assert hardware.resolve_dtype("auto", torch.device("cpu"), None).dtype == torch.bfloat16
        hardware.cpu_isa.cache_clear()
        monkeypatch.setattr(hardware, "detect_isa", lambda: "amx")
        monkeypatch.setenv(hardware.ISA_ENV, "avx2")
        assert not hardware.cpu_has_bf16_matmul() and not hardware.cpu_has_avx512()
        assert hardware.resolve_dtype("auto", torch.device("cpu"), None).dtype == torch.float32
        assert hardware.cpu_isa().kernels == "avx2"
        hardware.cpu_isa.cache_clear()
        monkeypatch.setenv(hardware.ISA_ENV, "sse2")
        with pytest.raises(
            ValueError, match="CHUNKWISE_CPU_ISA must be one of avx2, avx512, amx, got 'sse2'"
        ):
            hardware.cpu_isa()
    finally:
        hardware.cpu_isa.cache_clear()
