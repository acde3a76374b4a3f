"""dtype="auto": which dtype each device gets, and why."""

from __future__ import annotations

import pytest
import torch

from chunkwise import platform


@pytest.fixture
def bf16_units(monkeypatch):
    def set_units(present: bool) -> None:
        monkeypatch.setattr(platform, "cpu_has_bf16_matmul", lambda: present)

    return set_units


def test_explicit_dtypes_are_kept():
    for name, dtype in platform.DTYPES.items():
        choice = platform.resolve_dtype(name, torch.device("cpu"), "bfloat16")
        assert choice.dtype == dtype and choice.name == name


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        platform.resolve_dtype("float64", torch.device("cpu"), None)


def test_auto_on_cpu_follows_the_matrix_units(bf16_units):
    bf16_units(False)
    choice = platform.resolve_dtype("auto", torch.device("cpu"), "bfloat16")
    assert choice.dtype == torch.float32
    assert "no bf16 matrix units" in choice.reason and "bfloat16" in choice.reason
    bf16_units(True)
    assert platform.resolve_dtype("auto", torch.device("cpu"), "float32").dtype == torch.bfloat16


def test_auto_on_cuda_is_half_precision():
    cuda = torch.device("cuda")
    assert platform.resolve_dtype("auto", cuda, "float32").dtype == torch.bfloat16
    assert platform.resolve_dtype("auto", cuda, None).dtype == torch.bfloat16
    # A float16 checkpoint stays float16: bf16 would round what it stores.
    assert platform.resolve_dtype("auto", cuda, "float16").dtype == torch.float16


def test_the_engine_logs_its_choice_and_records_the_resolved_dtype(caplog):
    from chunkwise.config import engine_config_from_kwargs
    from chunkwise.engine import EngineCore

    with caplog.at_level("INFO", logger="chunkwise.engine"):
        engine = EngineCore(engine_config_from_kwargs("tiny", max_model_len=64))
    expected = platform.resolve_dtype("auto", torch.device("cpu"), None)
    assert engine.config.dtype == expected.name
    assert engine.loaded.model.model.embed_tokens.weight.dtype == expected.dtype
    assert any(r.getMessage() == f"dtype {expected.name} ({expected.reason})" for r in caplog.records)
