"""The operator's commands against the runtime's own parsers: every flag it writes exists, and its defaults
are the engine's.

The operator never imports the runtime (its image has no torch); this test is where the two meet.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from chunkwise.engine.args import engine_config_from_args
from chunkwise.engine.datatypes.config import engine_args
from chunkwise.fetch.args import add_fetch_args
from chunkwise.router import wake
from chunkwise.router.args import add_router_args
from chunkwise.server.args import add_serve_args
from chunkwise_operator import gateway, manifests
from chunkwise_operator import spec as operator_spec
from chunkwise_operator.spec import GROUP, PLURAL, VERSION, EngineSpec, RouterSpec, Speculation, parse


def parser(add: Any) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add(p)
    return p


def serve_namespace(argv: list[str]) -> argparse.Namespace:
    assert argv[:2] == ["chunkwise", "serve"]
    return parser(add_serve_args).parse_args(argv[2:])


def test_an_empty_spec_runs_the_engine_as_shipped() -> None:
    """The operator's defaults are the runtime's: its command means what `chunkwise serve --model M` means."""
    argv = manifests.engine_command(parse({"model": {"preset": "tiny"}}))
    from_operator = engine_config_from_args(serve_namespace(argv))
    plain = engine_config_from_args(
        serve_namespace(["chunkwise", "serve", "--model", "tiny", "--device", "cpu"])
    )
    assert dataclasses.asdict(from_operator) == dataclasses.asdict(plain)
    ns, bare = serve_namespace(argv), serve_namespace(["chunkwise", "serve", "--model", "tiny"])
    assert ns.queue_delay_slo_seconds == bare.queue_delay_slo_seconds
    assert ns.drain_timeout_seconds == bare.drain_timeout_seconds


@pytest.mark.parametrize(
    "spec",
    [
        {"model": {"preset": "tiny"}},
        {
            "model": {"uri": "hf://org/m@v1"},
            "resources": {"gpu": 1, "memory": "64Gi"},
            "engine": {
                "dtype": "bfloat16",
                "maxNumSeqs": 64,
                "blockSize": 32,
                "kvCacheMemory": "8Gi",
                "preemptionMode": "swap",
                "enablePrefixCaching": False,
                "speculation": {"method": "ngram", "numTokens": 3},
                "queueDelaySloSeconds": 2.5,
                "drainGraceSeconds": 60,
                "extraArgs": ["--max-model-len", "8192"],
            },
            "router": {"enabled": True},
            "autoscaling": {"enabled": True, "minReplicas": 0},
            "gateway": {"inferencePool": True},
        },
        {
            "model": {"preset": "tiny"},
            "resources": {"gpu": 1},
            "engine": {"kvOffloadingMemory": "1536Mi", "schedulingPolicy": "priority", "fairness": "vtc"},
            "router": {"tenantHeader": "X-Org-Id"},
        },
    ],
    ids=["defaults", "every-field", "multi-tenant"],
)
def test_every_command_the_operator_writes_parses_with_the_runtime(spec: dict[str, Any]) -> None:
    parsed = parse(spec)
    ns = serve_namespace(manifests.engine_command(parsed))
    config = engine_config_from_args(ns)
    e = parsed.engine
    assert (config.scheduler.max_num_seqs, config.cache.block_size) == (e.max_num_seqs, e.block_size)
    assert config.device == manifests.device(parsed) and config.dtype == e.dtype
    assert config.cache.enable_prefix_caching is e.enable_prefix_caching
    assert config.scheduler.preemption_mode == e.preemption_mode
    assert (config.scheduler.scheduling_policy, config.scheduler.fairness) == (
        e.scheduling_policy,
        e.fairness,
    )
    assert config.cache.kv_offloading_size * 2**30 == e.kv_offloading_bytes
    assert ns.tenant_header == parsed.router.tenant_header
    router = manifests.router_command("svc", "ml", parsed)
    assert router[:2] == ["chunkwise", "router"]
    rns = parser(add_router_args).parse_args(router[2:])
    assert rns.block_size == e.block_size
    # Scale from zero: the router raises this service's /scale, on the API the CRD serves.
    assert rns.wake_inference_service == ("svc" if parsed.autoscaling.min_replicas == 0 else None)
    # The InferencePool's endpoint picker: the port its endpointPickerRef names (off without a pool).
    assert (rns.epp_port == gateway.EPP_PORT) is parsed.gateway.inference_pool
    assert (wake.GROUP, wake.VERSION, wake.PLURAL) == (GROUP, VERSION, PLURAL)
    if parsed.model.uri is not None:
        for tokenizer_only in (False, True):
            fetch = manifests.fetch_command(parsed, tokenizer_only)
            assert fetch[:2] == ["chunkwise", "fetch-model"]
            fns = parser(add_fetch_args).parse_args(fetch[2:])
            assert fns.tokenizer_only is tokenizer_only


# Each EngineSpec field and the `chunkwise serve` flag it is rendered to. Every field must be here, so a
# field added to the operator is held to the runtime's default from the start.
SPEC_FLAGS = {
    "dtype": "--dtype",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "preemption_mode": "--preemption-mode",
    "enable_prefix_caching": "--enable-prefix-caching",
    "queue_delay_slo_seconds": "--queue-delay-slo-seconds",
    "drain_grace_seconds": "--drain-timeout-seconds",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    # Multi-tenant scheduling (issue 37): rendered only where they differ from these defaults.
    "scheduling_policy": "--scheduling-policy",
    "fairness": "--fairness",
    # Bytes here, GiB there: both 0 (off) by default.
    "kv_offloading_bytes": "--kv-offloading-size",
}
SPECULATION_FLAGS = {"method": "--speculative-method", "num_tokens": "--num-speculative-tokens"}
# The LoRA fields (issue 34), rendered only for a service with adapters or runtime updates (vLLM's names, the
# server contract of issue 34 part 3). The server's flags are built beside the operator's: until they land,
# the tests that need them skip, naming why, and they run (and hold the names) once `serve` has them.
LORA_FLAGS = {
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
    "max_cpu_loras": "--max-cpu-loras",
    "runtime_lora_updates": "--allow-runtime-lora",
}
LORA_MODELED = {"--enable-lora", "--lora-modules", *LORA_FLAGS.values()}
# The operator spells "off" as "none" where the runtime's default is None.
OFF: dict[object, object] = {"none": None}


def runtime_default(flag: str) -> object:
    """The default a flag of `chunkwise serve` stands for: the engine field's, else the server's own."""
    action = parser(add_serve_args)._option_string_actions[flag]
    option = engine_args().get(action.dest)
    return option.default if option is not None and option.has_engine_flag else action.default


@pytest.mark.parametrize(
    ("spec", "tp", "pp"),
    [
        ({"model": {"preset": "tiny"}, "resources": {"gpu": 4}}, 4, 1),
        ({"model": {"preset": "tiny"}, "resources": {"gpu": 4}, "engine": {"tensorParallelSize": 2}}, 2, 1),
        ({"model": {"preset": "tiny"}, "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 3}}, 2, 3),
    ],
    ids=["gpu-4", "gpu-4-tp-2", "cpu-tp-2-pp-3"],
)
def test_the_parallel_sizes_reach_the_runtimes_parser(spec: dict[str, Any], tp: int, pp: int) -> None:
    """Parsed by `chunkwise serve`'s own parser: the engine config is not built, since the engine still
    refuses pipeline stages and CUDA ranks (issue 33), and that refusal is the engine's to lift."""
    ns = serve_namespace(manifests.engine_command(parse(spec)))
    # A flag left out parses as None: the engine's default, 1 (test_the_operators_engine_defaults_are_the_runtimes).
    assert (ns.tensor_parallel_size or 1, ns.pipeline_parallel_size or 1) == (tp, pp)


def test_the_operators_engine_defaults_are_the_runtimes() -> None:
    fields = {f.name for f in dataclasses.fields(EngineSpec)}
    # startup_timeout_seconds is the kubelet's (the startup probe), not a flag of the engine.
    assert fields - {"speculation", "extra_args", "startup_timeout_seconds"} == set(SPEC_FLAGS) | set(
        LORA_FLAGS
    )
    assert {f.name for f in dataclasses.fields(Speculation)} == set(SPECULATION_FLAGS)
    pairs = [(getattr(EngineSpec(), f), flag) for f, flag in SPEC_FLAGS.items()]
    pairs += [(getattr(Speculation(), f), flag) for f, flag in SPECULATION_FLAGS.items()]
    for ours, flag in pairs:
        # "none" is the runtime's own choice for --fairness, and None its default for --speculative-method.
        assert runtime_default(flag) in (ours, OFF.get(ours, ours)), flag
    # spec.router.tenantHeader is rendered onto the runtime pods: a server flag, not an engine field.
    assert (
        RouterSpec().tenant_header
        == operator_spec.DEFAULT_TENANT_HEADER
        == runtime_default("--tenant-header")
    )


def test_the_operators_choices_are_the_runtimes() -> None:
    serve = parser(add_serve_args)._option_string_actions
    assert set(operator_spec.DTYPES) == set(serve["--dtype"].choices)
    assert set(operator_spec.PREEMPTION_MODES) == set(serve["--preemption-mode"].choices)
    assert set(operator_spec.SPECULATIVE_METHODS) == {*OFF, *serve["--speculative-method"].choices}
    assert set(operator_spec.SCHEDULING_POLICIES) == set(serve["--scheduling-policy"].choices)
    assert set(operator_spec.FAIRNESS_POLICIES) == set(serve["--fairness"].choices)
    router = parser(add_router_args)._option_string_actions
    assert set(operator_spec.ROUTER_POLICIES) == set(router["--policy"].choices)


def test_every_flag_the_operator_reserves_is_a_runtime_flag() -> None:
    serve = parser(add_serve_args)._option_string_actions
    assert set(operator_spec.MODELED_FLAGS) - LORA_MODELED <= set(serve)
    assert set(SPEC_FLAGS.values()) | set(SPECULATION_FLAGS.values()) <= set(operator_spec.MODELED_FLAGS)
    assert set(operator_spec.MODELED_FLAGS) >= LORA_MODELED


def test_the_lora_flags_are_the_runtimes_with_its_defaults() -> None:
    serve = parser(add_serve_args)._option_string_actions
    assert set(serve) >= LORA_MODELED
    for field, flag in LORA_FLAGS.items():
        assert getattr(EngineSpec(), field) == runtime_default(flag), flag


LORA_SPECS = [
    {
        "model": {"preset": "tiny"},
        "adapters": [
            {"name": "sql", "uri": "hf://org/sql-lora"},
            {"name": "chat", "uri": "s3://adapters/chat/"},
        ],
        "engine": {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8},
    },
    {"model": {"preset": "tiny"}, "engine": {"runtimeLoraUpdates": True, "maxLoras": 3}},
]


@pytest.mark.parametrize("spec", LORA_SPECS, ids=["static", "runtime"])
def test_the_lora_command_parses_with_the_runtime(spec: dict[str, Any]) -> None:
    parsed = parse(spec)
    ns = serve_namespace(manifests.engine_command(parsed))
    assert ns.enable_lora is True
    assert (ns.max_loras, ns.max_lora_rank) == (parsed.engine.max_loras, parsed.engine.max_lora_rank)
    assert ns.allow_runtime_lora is parsed.engine.runtime_lora_updates


def test_every_adapter_fetch_parses_with_the_fetcher() -> None:
    parsed = parse(LORA_SPECS[0])
    pod = manifests.runtime_deployment("svc", "ml", parsed)["spec"]["template"]["spec"]
    fetchers = [c for c in pod["initContainers"] if c["name"].startswith("fetch-adapter-")]
    assert len(fetchers) == 2
    for container, adapter in zip(fetchers, parsed.adapters):
        assert container["command"] == ["chunkwise"] and container["args"][0] == "fetch-model"
        fns = parser(add_fetch_args).parse_args(container["args"][1:])
        assert (fns.uri, fns.dir, fns.adapter) == (adapter.uri, f"/adapters/{adapter.name}", True)
