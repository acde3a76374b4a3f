"""Multi-tenant scheduling fields (issue 37, point 5): spec.engine.schedulingPolicy, .fairness,
.kvOffloadingMemory and spec.router.tenantHeader, from the CR to the runtime pods' command and resources.

The flags themselves are held to `chunkwise serve`'s parser in test_operator_runtime_contract.py; the CRD's
CEL rule and spec.py's check of kvOffloadingMemory against enablePrefixCaching in test_operator_admission.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from operator_harness import Cluster, Operator, eventually, inference_service, schema_errors

from chunkwise_operator import manifests
from chunkwise_operator.spec import (
    DEFAULT_TENANT_HEADER,
    EngineSpec,
    Resources,
    SpecError,
    gib,
    parse,
)

GIB = 2**30
TINY: dict[str, Any] = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}
NEW_FLAGS = ("--scheduling-policy", "--fairness", "--kv-offloading-size", "--tenant-header")


def with_(**sections: Any) -> dict[str, Any]:
    return {**TINY, **sections}


def engine_container(spec: dict[str, Any]) -> dict[str, Any]:
    dep = manifests.runtime_deployment("svc", "ml", parse(spec))
    container: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return container


def argv(spec: dict[str, Any]) -> list[str]:
    container = engine_container(spec)
    return [*container.get("command", []), *container.get("args", [])]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_the_defaults_add_no_flag_and_no_memory() -> None:
    """Left out, the fields leave a service's command and pods as they were: no rollout at an operator
    upgrade, and no flag an older runtime image (a service pinned in status.runtimeImage) would refuse."""
    parsed = parse(TINY)
    assert (parsed.engine.scheduling_policy, parsed.engine.fairness) == ("fcfs", "none")
    assert parsed.engine.kv_offloading_bytes == 0
    assert parsed.router.tenant_header == DEFAULT_TENANT_HEADER == "x-tenant-id"
    args = argv(TINY)
    assert not set(NEW_FLAGS) & set(args)
    # The CRD's defaults filled in by the API server mean the same: still no flag.
    explicit = with_(
        engine={"schedulingPolicy": "fcfs", "fairness": "none", "kvOffloadingMemory": "0Gi"},
        router={"tenantHeader": "X-Tenant-ID"},
    )
    assert schema_errors(inference_service("svc", explicit)) == []
    assert parse(explicit) == parsed
    assert argv(explicit) == args


def test_each_field_reaches_the_runtime_command() -> None:
    spec = with_(
        engine={"schedulingPolicy": "priority", "fairness": "vtc", "kvOffloadingMemory": "8Gi"},
        router={"tenantHeader": "X-Org-Id"},
    )
    assert schema_errors(inference_service("svc", spec)) == []
    args = argv(spec)
    assert flag(args, "--scheduling-policy") == "priority"
    assert flag(args, "--fairness") == "vtc"
    assert flag(args, "--kv-offloading-size") == "8"
    # HTTP field names are case-insensitive: the operator passes the lowercase spelling.
    assert flag(args, "--tenant-header") == "x-org-id"
    # Beside the prefix-cache flag the tier belongs to, before the speculation and serving flags.
    at = args.index("--enable-prefix-caching")
    assert args[at + 1 : at + 7] == [
        "--kv-offloading-size", "8", "--scheduling-policy", "priority", "--fairness", "vtc",
    ]  # fmt: skip
    # Each alone renders only its own flag.
    assert [f for f in NEW_FLAGS if f in argv(with_(engine={"fairness": "vtc"}))] == ["--fairness"]
    assert [f for f in NEW_FLAGS if f in argv(with_(router={"tenantHeader": "x-user"}))] == [
        "--tenant-header"
    ]


def test_the_tenant_header_reaches_the_runtime_pods_with_or_without_the_router() -> None:
    """The engine reads it; the router (when there is one) forwards every request header unchanged."""
    for router in ({"tenantHeader": "x-team"}, {"tenantHeader": "x-team", "enabled": True}):
        parsed = parse(with_(router=router))
        assert flag(manifests.engine_command(parsed), "--tenant-header") == "x-team"
        router_args = manifests.router_command("svc", "ml", parsed)
        assert "--tenant-header" not in router_args


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        ("8Gi", "8"),
        ("1536Mi", "1.5"),
        ("512Mi", "0.5"),
        ("1G", "0.931322574615478515625"),
        (2**20, "0.0009765625"),
    ],
)
def test_kv_offloading_memory_is_given_in_gib(quantity: str | int, expected: str) -> None:
    args = argv(with_(engine={"kvOffloadingMemory": quantity}))
    assert flag(args, "--kv-offloading-size") == expected
    # Exact: the engine's GiB times 2**30 is the quantity's bytes.
    assert (
        float(expected) * GIB
        == parse(with_(engine={"kvOffloadingMemory": quantity})).engine.kv_offloading_bytes
    )
    assert gib(parse(with_(engine={"kvOffloadingMemory": quantity})).engine.kv_offloading_bytes) == expected


@pytest.mark.parametrize(
    ("spec", "memory"),
    [
        # The CPU default, 2Gi, plus the tier.
        (with_(engine={"kvOffloadingMemory": "8Gi"}), "10Gi"),
        (with_(engine={"kvOffloadingMemory": "512Mi"}), "2560Mi"),
        # A GPU replica's default: model.size + 8Gi, plus the tier.
        (
            {
                "model": {"uri": "hf://org/m", "size": "16Gi"},
                "resources": {"gpu": 1},
                "engine": {"kvOffloadingMemory": "64Gi"},
            },
            "88Gi",
        ),
        # A GPU replica's default without model.size: 32Gi, plus the tier.
        ({**TINY, "resources": {"gpu": 1}, "engine": {"kvOffloadingMemory": "16Gi"}}, "48Gi"),
        # A given memory is the pod's memory as it stands: it must hold the tier (checked below).
        (with_(resources={"memory": "24Gi"}, engine={"kvOffloadingMemory": "8Gi"}), "24Gi"),
    ],
    ids=["cpu-default", "cpu-default-mi", "gpu-sized", "gpu-default", "given"],
)
def test_the_pods_memory_request_grows_by_the_tier(spec: dict[str, Any], memory: str) -> None:
    assert schema_errors(inference_service("svc", spec)) == []
    parsed = parse(spec)
    assert parsed.resources.memory == memory
    resources = engine_container(spec)["resources"]
    # Request and limit alike (memory is both, as for every runtime pod): the tier is pinned host memory.
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == memory


def test_without_the_tier_the_memory_is_unchanged() -> None:
    assert parse(TINY).resources == Resources(cpu="1", memory="2Gi", gpu=0)
    assert engine_container(TINY)["resources"]["requests"]["memory"] == "2Gi"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            with_(resources={"memory": "8Gi"}, engine={"kvOffloadingMemory": "8Gi"}),
            f"spec.engine.kvOffloadingMemory ({8 * GIB} bytes) does not fit in spec.resources.memory "
            f"(8Gi = {8 * GIB} bytes), the pod's memory request and limit, which must also hold the weights; "
            "raise spec.resources.memory (or leave it out: its default grows by kvOffloadingMemory) or lower "
            "kvOffloadingMemory",
        ),
        (
            # On CPU the KV cache lives in the same memory: the two together must fit.
            with_(resources={"memory": "8Gi"}, engine={"kvCacheMemory": "4Gi", "kvOffloadingMemory": "4Gi"}),
            f"spec.engine.kvOffloadingMemory ({4 * GIB} bytes) with spec.engine.kvCacheMemory ({4 * GIB} bytes) "
            f"does not fit in spec.resources.memory (8Gi = {8 * GIB} bytes), the pod's memory request and "
            "limit, which must also hold the weights; raise spec.resources.memory (or leave it out: its default "
            "grows by kvOffloadingMemory) or lower kvOffloadingMemory",
        ),
        (
            # On a GPU the KV cache is device memory and does not count; the host tier does.
            {
                **TINY,
                "resources": {"gpu": 1, "memory": "16Gi"},
                "engine": {"kvCacheMemory": "40Gi", "kvOffloadingMemory": "16Gi"},
            },
            f"spec.engine.kvOffloadingMemory ({16 * GIB} bytes) does not fit in spec.resources.memory "
            f"(16Gi = {16 * GIB} bytes), the pod's memory request and limit, which must also hold the "
            "weights; raise spec.resources.memory (or leave it out: its default grows by kvOffloadingMemory) "
            "or lower kvOffloadingMemory",
        ),
    ],
    ids=["cpu", "cpu-with-kv-cache", "gpu"],
)
def test_a_tier_over_the_memory_limit_is_refused_not_clamped(spec: dict[str, Any], message: str) -> None:
    # Admitted by the CRD (comparing quantities needs CEL's quantity library; see test_operator_admission.py),
    # then refused by the operator and reported in the status.
    assert schema_errors(inference_service("svc", spec)) == []
    with pytest.raises(SpecError) as caught:
        parse(spec)
    assert (caught.value.reason, caught.value.message) == ("InsufficientMemory", message)


def test_the_neighbours_of_the_memory_check_fit() -> None:
    # Just under the limit on CPU (with the KV cache) and on a GPU (where the KV cache does not count).
    cpu = parse(
        with_(resources={"memory": "9Gi"}, engine={"kvCacheMemory": "4Gi", "kvOffloadingMemory": "4Gi"})
    )
    assert cpu.resources.memory == "9Gi"
    gpu = parse(
        {
            **TINY,
            "resources": {"gpu": 1, "memory": "24Gi"},
            "engine": {"kvCacheMemory": "40Gi", "kvOffloadingMemory": "16Gi"},
        }
    )
    assert gpu.engine.kv_offloading_bytes == 16 * GIB


@pytest.mark.parametrize(
    ("spec", "reason", "message"),
    [
        (
            with_(engine={"schedulingPolicy": "lottery"}),
            "InvalidEngine",
            "spec.engine.schedulingPolicy must be one of fcfs, priority; got 'lottery'",
        ),
        (
            with_(engine={"fairness": "wfq"}),
            "InvalidEngine",
            "spec.engine.fairness must be one of none, vtc; got 'wfq'",
        ),
        (
            with_(engine={"kvOffloadingMemory": "lots"}),
            "InvalidEngine",
            "spec.engine.kvOffloadingMemory: not a byte count: 'lots' (use e.g. 4Gi, 512Mi or 1000000)",
        ),
        (
            with_(engine={"kvOffloadingMemory": -1}),
            "InvalidEngine",
            "spec.engine.kvOffloadingMemory: a byte count must be positive, got -1",
        ),
        (
            with_(engine={"kvOffloadingMemory": "8Gi", "enablePrefixCaching": False}),
            "InvalidEngine",
            "spec.engine.kvOffloadingMemory needs spec.engine.enablePrefixCaching: the host tier keeps the "
            "blocks the prefix cache evicts; turn prefix caching on or leave kvOffloadingMemory out",
        ),
        (
            with_(router={"tenantHeader": "x_tenant"}),
            "InvalidRouter",
            "spec.router.tenantHeader 'x_tenant' does not match ^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$",
        ),
        (
            with_(router={"tenantHeader": "x-tenant:"}),
            "InvalidRouter",
            "spec.router.tenantHeader 'x-tenant:' does not match ^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$",
        ),
        (
            with_(router={"tenantHeader": ""}),
            "InvalidRouter",
            "spec.router.tenantHeader '' does not match ^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$",
        ),
        (
            with_(router={"tenantHeader": "x" * 129}),
            "InvalidRouter",
            "spec.router.tenantHeader is longer than 128 characters",
        ),
    ],
    ids=[
        "policy",
        "fairness",
        "memory-word",
        "memory-negative",
        "no-prefix-cache",
        "underscore",
        "colon",
        "empty",
        "long",
    ],
)
def test_bad_values_are_refused_by_the_crd_and_by_the_operator(
    spec: dict[str, Any], reason: str, message: str
) -> None:
    errors = schema_errors(inference_service("svc", spec))
    assert errors, "the CRD accepted it"
    field = message.split(" ", 1)[0].rstrip(":").removeprefix("spec.")
    assert any(field in e for e in errors), errors
    with pytest.raises(SpecError) as caught:
        parse(spec)
    assert (caught.value.reason, caught.value.message) == (reason, message)


def test_below_a_mebibyte_the_operator_refuses_the_tier() -> None:
    # Like kvCacheMemory: the schema's pattern admits it, the operator's minimum does not.
    spec = with_(engine={"kvOffloadingMemory": "512Ki"})
    assert schema_errors(inference_service("svc", spec)) == []
    with pytest.raises(SpecError) as caught:
        parse(spec)
    assert (
        caught.value.message == "spec.engine.kvOffloadingMemory must be at least 1048576 bytes, got '512Ki'"
    )


def test_a_zero_tier_without_the_prefix_cache_is_off_and_accepted() -> None:
    for zero in (0, "0", "0Gi", "0.0Mi"):
        spec = with_(engine={"kvOffloadingMemory": zero, "enablePrefixCaching": False})
        assert schema_errors(inference_service("svc", spec)) == [], zero
        assert parse(spec).engine == EngineSpec(enable_prefix_caching=False)
        assert "--kv-offloading-size" not in argv(spec)


async def test_a_tier_over_the_limit_is_degraded_in_the_status_and_fixing_it_recovers(
    cluster: Cluster, operator: Operator
) -> None:
    """The real operator (Kopf on kmock): the spec is reported, no pod is created with a clamped request."""

    def condition(ctype: str) -> dict[str, Any]:
        for cond in ((cluster.isvc("chat") or {}).get("status") or {}).get("conditions") or []:
            if cond["type"] == ctype:
                return dict(cond)
        return {}

    bad = with_(
        resources={"memory": "4Gi"}, engine={"kvOffloadingMemory": "6Gi", "schedulingPolicy": "priority"}
    )
    await cluster.create_isvc("chat", bad)
    degraded = await eventually(
        lambda: condition("Degraded").get("status") == "True" and condition("Degraded")
    )
    assert degraded["reason"] == "InsufficientMemory"
    assert degraded["message"].startswith(
        f"spec.engine.kvOffloadingMemory ({6 * GIB} bytes) does not fit in spec.resources.memory (4Gi = "
    )
    assert cluster.get(Cluster.DEPLOYMENTS, "chat") is None
    warning = await eventually(lambda: [e for e in cluster.events() if e["reason"] == "InsufficientMemory"])
    assert warning[0]["type"] == "Warning"

    # Leaving the memory out gives the default plus the tier: 2Gi + 6Gi.
    await cluster.patch_isvc("chat", {"spec": {"resources": {"memory": None}}})
    dep = await eventually(lambda: cluster.get(Cluster.DEPLOYMENTS, "chat"), what="deployment after the fix")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["memory"] == container["resources"]["limits"]["memory"] == "8Gi"
    args = [*container.get("command", []), *container.get("args", [])]
    assert (flag(args, "--kv-offloading-size"), flag(args, "--scheduling-policy")) == ("6", "priority")
    await eventually(lambda: condition("Degraded").get("reason") == "AsExpected", what="recovered")
