"""Engine options are declared once, as config fields: kwargs, flags and --help are derived from them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from chunkwise.cli import main
from chunkwise.engine.args import add_engine_args, engine_config_from_args
from chunkwise.engine.datatypes.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpecConfig,
    engine_args,
    engine_config_from_kwargs,
)
from chunkwise.server.args import add_serve_args

CONFIGS = (EngineConfig, CacheConfig, SchedulerConfig, SpecConfig)
SECTIONS = {"cache", "scheduler", "spec"}

# A value other than the default for every engine option (num_blocks and kv_cache_memory_bytes exclude
# each other, so the byte budget gets its own case below; tensor_parallel_size > 1 excludes a cuda device and
# a draft model, so it has its own test).
NOT_DEFAULT: dict[str, object] = {
    "dtype": "float16",
    "device": "cuda:1",
    "seed": 7,
    "attention_backend": "torch",
    "enforce_eager": True,
    "block_size": 8,
    "num_blocks": 99,
    "enable_prefix_caching": False,
    "swap_space_bytes": 12345,
    "kv_events_buffer": 16,
    "gpu_memory_utilization": 0.5,
    "max_num_seqs": 3,
    "max_num_batched_tokens": 4096,
    "max_model_len": 2048,
    "enable_chunked_prefill": False,
    "batching": "static",
    "preemption_mode": "swap",
    "output_length_quantile": 0.5,
    "output_length_estimator": "mean",
    "cold_start_output_tokens": 17,
    "long_prompt_threshold": 100,
    "max_long_prefills": 2,
    "max_long_prefill_chunk": 64,
    "prefix_lookahead": 3,
    "prefix_reuse_min_fraction": 0.25,
    "max_prefix_bypass": 1,
    "max_waiting": 5,
    "scheduling_policy": "priority",
    "fairness": "vtc",
    "warm_up_kernels": True,
    "speculative_method": "draft",
    "num_speculative_tokens": 2,
    "adaptive_speculation": False,
    "speculative_model": "small",
    "distributed_port": 29600,
    "distributed_backend": "nccl",
    "enable_lora": True,
    "max_loras": 2,
    "max_lora_rank": 8,
    "max_cpu_loras": 3,
    "lora_kernel": "triton",
    "quantization": "fp8",
}


def value_in(config: EngineConfig, name: str) -> object:
    a = engine_args()[name]
    return getattr(getattr(config, a.section) if a.section else config, a.field_name)


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(p)
    return p


def argv_for(kwargs: dict[str, object]) -> list[str]:
    argv: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            argv += [flag, str(value)]
    return argv


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_option_field_has_help_text(cls: type) -> None:
    for f in dataclasses.fields(cls):
        if f.name in SECTIONS:
            continue
        assert f.metadata.get("help", "").strip(), f"{cls.__name__}.{f.name}"


def test_every_option_is_a_kwarg_exactly_once() -> None:
    declared = sum(len(dataclasses.fields(c)) for c in CONFIGS) - len(SECTIONS)
    assert len(engine_args()) == declared
    parallel = {"tensor_parallel_size", "pipeline_parallel_size"}
    own_case = {"model", "kv_cache_memory_bytes", "kv_offloading_size"}
    assert set(NOT_DEFAULT) | own_case | parallel == set(engine_args())


def test_every_option_has_a_serve_flag_and_help_with_its_default() -> None:
    p = serve_parser()
    engine = next(g for g in p._action_groups if g.title == "engine")
    by_dest = {a.dest: a for a in engine._group_actions}
    for name, a in engine_args().items():
        flag = "--" + name.replace("_", "-")
        assert flag in p._option_string_actions, flag
        if name not in by_dest:
            continue  # a command's own flag (max_waiting: the server's, with the server's default)
        action = by_dest[name]
        assert action.help and "(default: " in action.help, name
        if a.default is not None:
            shown = ("on" if a.default else "off") if isinstance(a.default, bool) else str(a.default)
            assert action.help.endswith(f"(default: {shown})"), (name, action.help)
    assert set(by_dest) == {n for n, a in engine_args().items() if a.has_engine_flag}


def test_serve_help_lists_every_engine_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for name in engine_args():
        assert "--" + name.replace("_", "-") in out, name
    assert "--max-num-batched-tokens" in out and "(default: 1024)" in out


def test_kv_offloading_size_is_a_tier_of_the_prefix_cache() -> None:
    # Its own case: NOT_DEFAULT turns prefix caching off, which the host tier needs.
    config = engine_config_from_kwargs("tiny", kv_offloading_size=0.5)
    assert config.cache.kv_offloading_size == 0.5
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        engine_config_from_kwargs("tiny", kv_offloading_size=0.5, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        engine_config_from_kwargs("tiny", kv_offloading_size=-1.0)


def test_no_kwargs_is_the_default_config() -> None:
    assert engine_config_from_kwargs("tiny") == EngineConfig()
    assert engine_config_from_kwargs("tiny", **dict.fromkeys(NOT_DEFAULT)) == EngineConfig()


@pytest.mark.parametrize("bytes_instead_of_blocks", [False, True])
def test_kwargs_and_flags_land_on_their_fields(bytes_instead_of_blocks: bool) -> None:
    kwargs = dict(NOT_DEFAULT)
    if bytes_instead_of_blocks:
        del kwargs["num_blocks"]
        kwargs["kv_cache_memory_bytes"] = 1 << 24
    config = engine_config_from_kwargs("small", **kwargs)
    for name, value in kwargs.items():
        assert value_in(config, name) == value, name
        assert value != engine_args()[name].default, name
    assert config.model == "small"
    ns = serve_parser().parse_args(["--model", "small", *argv_for(kwargs)])
    assert engine_config_from_args(ns) == config
    again = {name: value_in(config, name) for name in kwargs}
    assert engine_config_from_kwargs("small", **again) == config


def test_tensor_parallel_size_kwarg_and_flag_land_on_its_field() -> None:
    config = engine_config_from_kwargs("small", tensor_parallel_size=2)
    assert config.tensor_parallel_size == 2 != engine_args()["tensor_parallel_size"].default
    ns = serve_parser().parse_args(["--model", "small", "--tensor-parallel-size", "2"])
    assert engine_config_from_args(ns).tensor_parallel_size == 2


def test_flags_not_given_leave_the_defaults() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])) == EngineConfig()


def test_an_unknown_kwarg_names_itself_and_the_nearest_option() -> None:
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_seq'\]") as e:
        engine_config_from_kwargs("tiny", max_num_seq=3)
    assert "did you mean 'max_num_seqs'?" in str(e.value)
    assert "'max_num_seqs'" in str(e.value).split("known: ")[1]
    # The field's own name is not the kwarg where vLLM's name differs.
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['method'\]"):
        engine_config_from_kwargs("tiny", method="ngram")
    with pytest.raises(ValueError, match=r"\['zzz'\]; known"):
        engine_config_from_kwargs("tiny", zzz=1)


def test_unchunked_the_budget_becomes_max_model_len_unless_given() -> None:
    sched = engine_config_from_kwargs("tiny", enable_chunked_prefill=False, max_model_len=4096).scheduler
    assert sched.max_num_batched_tokens == 4096
    sched = engine_config_from_kwargs("tiny", enable_chunked_prefill=False).scheduler
    assert sched.max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match="must be >= max_model_len"):
        engine_config_from_kwargs(
            "tiny", enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp8"}, "dtype must be auto, float32, float16 or bfloat16, got 'fp8'"),
        ({"batching": "x"}, "batching must be 'continuous' or 'static', got 'x'"),
        ({"preemption_mode": "x"}, "preemption_mode must be 'auto', 'swap' or 'recompute', got 'x'"),
        ({"output_length_estimator": "x"}, "output_length_estimator must be 'quantile' or 'mean', got 'x'"),
        ({"speculative_method": "x"}, "speculative_method must be None, 'ngram' or 'draft', got 'x'"),
        ({"max_num_seqs": 0}, "max_num_seqs must be positive, got 0"),
        ({"num_blocks": 4, "kv_cache_memory_bytes": 1 << 20}, "not both"),
        (
            {"gpu_memory_utilization": 0.0},
            "--gpu-memory-utilization) is a fraction of the device's memory, in (0, 1]; got 0.0",
        ),
        ({"gpu_memory_utilization": 1.5}, "in (0, 1]; got 1.5"),
        ({"gpu_memory_utilization": float("nan")}, "in (0, 1]; got nan"),
        ({"quantization": "int4"}, "quantization must be 'int8' or 'fp8', got 'int4'"),
        ({"quantization": "fp8"}, "quantization 'fp8' runs on CUDA"),
        (
            {"quantization": "int8", "tensor_parallel_size": 2},
            "not supported with tensor or pipeline parallelism",
        ),
    ],
)
def test_validation_errors_name_the_option(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        engine_config_from_kwargs("tiny", **kwargs)
    assert message in str(e.value)


def test_choices_on_the_cli_are_the_configs() -> None:
    p = serve_parser()
    assert p._option_string_actions["--dtype"].choices == ["auto", "float32", "float16", "bfloat16"]
    assert p._option_string_actions["--speculative-method"].choices == ["ngram", "draft"]
    with pytest.raises(argparse.ArgumentError):
        p.parse_args(["--batching", "dynamic"])


def test_replay_replica_flags_are_the_engines() -> None:
    """`chunkwise replay run` takes the engine's own scheduler flags (same help, same defaults): a value
    given lands in the replica's scheduler config, one not given is the engine's default."""
    from chunkwise.sim.cli import _SCHED_OPTIONS, _config_kwargs, _prefix_caching, add_replay_args

    p = argparse.ArgumentParser()
    add_replay_args(p)
    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    helps = {a.dest: a.help for a in engine._actions}
    replay_run = p._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    replay_helps = {a.dest: a.help for a in replay_run._actions}
    for name in _SCHED_OPTIONS:
        assert replay_helps[name] == helps[name], name
    given = p.parse_args(["run", "--profile", "x", "--preemption-mode", "swap", "--no-enable-prefix-caching"])
    assert _config_kwargs(given)["preemption_mode"] == "swap" and _prefix_caching(given) is False
    default = p.parse_args(["run", "--profile", "x"])
    assert "preemption_mode" not in _config_kwargs(default)
    assert _prefix_caching(default) is CacheConfig().enable_prefix_caching
