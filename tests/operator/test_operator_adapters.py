"""LoRA adapters in the operator (issue 34, part 5), as pure functions: spec.adapters and the engine's LoRA fields,
the render (init containers and --lora-modules, or nothing but the flags with runtime updates), what to load
and unload on a replica, and status.adapters with its AdaptersReady condition.

The operator running for real against kmock, with replicas on loopback, is test_operator_adapters_e2e.py.
"""

from __future__ import annotations

import copy
from typing import Any

import kopf
import kubernetes_validate
import pytest
from test_operator_manifests import OWNER, restricted_violations

from chunkwise_operator import adapters, manifests, status
from chunkwise_operator.adapters import Failure, Plan, Replica, ReplicaState
from chunkwise_operator.spec import RESERVED_MOUNT_PATHS, Adapter, SpecError, parse

SQL = {"name": "sql", "uri": "hf://org/sql-lora@v2"}
CHAT = {"name": "chat", "uri": "s3://adapters/chat/v1/"}
STATIC: dict[str, Any] = {
    "model": {"uri": "hf://org/base", "credentialsSecret": "hf-token"},
    "image": "chunkwise:dev",
    "adapters": [SQL, CHAT],
    "engine": {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8, "extraArgs": ["--max-model-len", "4096"]},
}
RUNTIME: dict[str, Any] = {**STATIC, "engine": {**STATIC["engine"], "runtimeLoraUpdates": True}}


def pod_spec(data: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = manifests.runtime_workload("svc", "ml", parse(data))["spec"]["template"]
    return template


# ---------------------------------------------------------------------------------------------------- spec


def test_the_spec_reads_adapters_and_the_lora_fields() -> None:
    parsed = parse(RUNTIME)
    assert parsed.adapters == (Adapter("sql", SQL["uri"]), Adapter("chat", CHAT["uri"]))
    e = parsed.engine
    assert (e.max_loras, e.max_lora_rank, e.max_cpu_loras, e.runtime_lora_updates) == (2, 64, 8, True)
    assert parsed.lora_enabled
    plain = parse({"model": {"preset": "tiny"}})
    assert plain.adapters == () and not plain.lora_enabled
    assert (plain.engine.max_loras, plain.engine.max_lora_rank, plain.engine.max_cpu_loras) == (1, 16, None)
    # Runtime loading alone turns LoRA on: adapters may come later without a restart.
    assert parse({"model": {"preset": "tiny"}, "engine": {"runtimeLoraUpdates": True}}).lora_enabled


@pytest.mark.parametrize(
    ("adapters_", "message"),
    [
        ([SQL, {**CHAT, "name": "sql"}], "spec.adapters names 'sql' twice"),
        ([{**SQL, "name": "Sql"}], "spec.adapters[0].name must be a DNS label"),
        ([{**SQL, "name": "a" * 49}], "of at most 48 characters"),
        ([{**SQL, "name": "base"}], "spec.adapters[0].name 'base' is the base model's served name"),
        ([{"name": "x", "uri": "pvc://claim/x"}], "spec.adapters[0].uri must start with one of hf://"),
        ([{"name": "x"}], "spec.adapters[0].uri is required"),
        ({"name": "x"}, "spec.adapters must be a list"),
    ],
)
def test_a_bad_adapter_is_invalid_adapters_naming_it(adapters_: Any, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse({"model": {"preset": "tiny", "servedName": "base"}, "adapters": adapters_})
    assert caught.value.reason == "InvalidAdapters"
    assert message in caught.value.message


# -------------------------------------------------------------------------------------------------- render


def test_static_adapters_are_fetched_by_init_containers_and_named_by_lora_modules() -> None:
    template = pod_spec(STATIC)
    pod = template["spec"]
    (engine,) = pod["containers"]
    assert engine["args"][engine["args"].index("--enable-lora") :] == [
        "--enable-lora",
        "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat",
        "--max-loras", "2",
        "--max-lora-rank", "64",
        "--max-cpu-loras", "8",
        # The user's flags stay last, where the runtime's parser judges them.
        "--max-model-len", "4096",
    ]  # fmt: skip
    assert "--allow-runtime-lora" not in engine["args"]
    init = pod["initContainers"]
    assert [c["name"] for c in init] == ["fetch-model", "fetch-adapter-sql", "fetch-adapter-chat"]
    sql = init[1]
    assert sql["command"] == ["chunkwise"]
    assert sql["args"] == ["fetch-model", SQL["uri"], "/adapters/sql", "--adapter"]
    assert sql["volumeMounts"] == [{"name": "adapters", "mountPath": "/adapters"}]
    assert sql["envFrom"] == [{"secretRef": {"name": "hf-token"}}]  # the model's credentials
    assert sql["resources"] == init[0]["resources"] and sql["resources"] is not init[0]["resources"]
    assert {"name": "adapters", "emptyDir": {"sizeLimit": "4Gi"}} in pod["volumes"]
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in engine["volumeMounts"]
    assert "envFrom" not in engine  # the engine fetches nothing itself


def test_runtime_updates_render_the_flags_and_no_adapter() -> None:
    pod = pod_spec(RUNTIME)["spec"]
    (engine,) = pod["containers"]
    lora = engine["args"][engine["args"].index("--enable-lora") :]
    assert lora == [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64", "--max-cpu-loras", "8",
        "--allow-runtime-lora", "--lora-cache-dir", "/adapters", "--max-model-len", "4096",
    ]  # fmt: skip
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model"]
    # The engine fetches the URIs it is asked to load into a writable volume sized by the limits, not the list.
    (adapters,) = [v for v in pod["volumes"] if v["name"] == "adapters"]
    assert adapters == {"name": "adapters", "emptyDir": {"sizeLimit": "16Gi"}}
    assert {"name": "adapters", "mountPath": "/adapters"} in engine["volumeMounts"]
    # The replica fetches each adapter's URI when the operator loads it: it needs the credentials.
    assert engine["envFrom"] == [{"secretRef": {"name": "hf-token"}}]


def test_with_runtime_updates_the_adapters_never_change_the_pod_template() -> None:
    """The whole point of runtimeLoraUpdates: adding, removing or repointing an adapter rolls no pod."""
    first = manifests.runtime_workload("svc", "ml", parse(RUNTIME))
    for changed in ([], [SQL], [CHAT, SQL], [{**SQL, "uri": "hf://org/sql-lora@v3"}], [SQL, CHAT]):
        data = {**RUNTIME, "adapters": changed}
        assert manifests.runtime_workload("svc", "ml", parse(data)) == first, changed
    # Without runtime updates the same change is a new template, hence a rollout.
    static = manifests.runtime_workload("svc", "ml", parse(STATIC))
    assert manifests.runtime_workload("svc", "ml", parse({**STATIC, "adapters": [SQL]})) != static


def test_no_adapters_no_lora_flags() -> None:
    for data in ({"model": {"preset": "tiny"}}, {**STATIC, "adapters": []}):
        pod = pod_spec(data)["spec"]
        assert not any("lora" in a for a in pod["containers"][0]["args"])
        assert not any(c["name"].startswith("fetch-adapter-") for c in pod.get("initContainers", []))


@pytest.mark.parametrize("data", [STATIC, RUNTIME, {"model": {"preset": "tiny"}, "adapters": [SQL]}])
def test_every_lora_child_validates_and_is_restricted(data: dict[str, Any]) -> None:
    children = manifests.children("svc", "ml", parse(data))
    kopf.append_owner_reference(children, owner=kopf.Body(OWNER))  # type: ignore[arg-type]
    for child in children:
        kubernetes_validate.validate(child, "1.30.0", strict=True)
    pod = pod_spec(data)["spec"]
    assert restricted_violations(pod) == []
    for mount in pod["containers"][0]["volumeMounts"]:
        assert mount["mountPath"] in RESERVED_MOUNT_PATHS, mount


def test_a_pipeline_group_gives_every_stage_the_adapters() -> None:
    data = {**STATIC, "engine": {**STATIC["engine"], "pipelineParallelSize": 2}}
    lws = manifests.runtime_workload("svc", "ml", parse(data))
    templates = lws["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        pod = templates[role]["spec"]
        assert "sql=/adapters/sql" in pod["containers"][0]["args"], role
        assert [c["name"] for c in pod["initContainers"]][1:] == ["fetch-adapter-sql", "fetch-adapter-chat"]


# ---------------------------------------------------------------------------------------------- decisions

WANT = {"sql": "hf://org/sql-lora@v2", "chat": "s3://adapters/chat/v1/"}


def test_plan_brings_a_replica_to_exactly_the_wanted_adapters() -> None:
    loaded = {"chat": "s3://adapters/chat/v1/", "old": "hf://org/old"}
    assert adapters.plan(WANT, loaded, runtime=True) == Plan(
        unload=("old",), load=(("sql", "hf://org/sql-lora@v2"),)
    )
    assert adapters.plan(WANT, dict(WANT), runtime=True) == Plan()
    # Nothing wanted any more: every adapter goes; a fresh replica gets every one.
    assert adapters.plan({}, loaded, runtime=True) == Plan(unload=("chat", "old"))
    assert adapters.plan(WANT, {}, runtime=True).load == (
        ("chat", "s3://adapters/chat/v1/"),
        ("sql", "hf://org/sql-lora@v2"),
    )


def test_plan_reloads_an_adapter_whose_uri_changed() -> None:
    loaded = {"sql": "hf://org/sql-lora@v1", "chat": "s3://adapters/chat/v1/"}
    assert adapters.plan(WANT, loaded, runtime=True) == Plan(
        unload=("sql",), load=(("sql", "hf://org/sql-lora@v2"),)
    )


def test_plan_changes_nothing_without_runtime_updates() -> None:
    # The pod template carries the adapters: a replica of an older template is replaced, never edited.
    assert adapters.plan(WANT, {"old": "/adapters/old"}, runtime=False) == Plan()


def test_a_refused_load_is_held_for_a_while_unless_its_uri_changes() -> None:
    failures = {("pod-a", "sql"): Failure("hf://org/sql-lora@v2", 100.0, "HTTP 400: rank 64 > 16")}
    assert adapters.held(failures, "pod-a", WANT, now=130.0) == {"sql"}
    assert adapters.held(failures, "pod-b", WANT, now=130.0) == set()  # another replica may take it
    assert adapters.held(failures, "pod-a", WANT, now=100.0 + adapters.RETRY_AFTER_S) == set()
    assert adapters.held(failures, "pod-a", {**WANT, "sql": "hf://org/sql-lora@v3"}, now=130.0) == set()
    assert adapters.plan(WANT, {}, True, held={"sql"}).load == (("chat", "s3://adapters/chat/v1/"),)
    adapters.forget(failures, {"pod-b"}, WANT)  # pod-a is gone
    assert failures == {}


def test_served_reads_the_adapters_of_v1_models() -> None:
    answer = {
        "object": "list",
        "data": [
            {"id": "base", "object": "model", "root": "/models/base", "parent": None},
            {"id": "sql", "object": "model", "root": "hf://org/sql-lora@v2", "parent": "base"},
        ],
    }
    assert adapters.served(answer) == {"sql": "hf://org/sql-lora@v2"}
    with pytest.raises(ValueError):
        adapters.served({"error": {"message": "no"}})


def test_replicas_are_the_ready_pods_at_their_http_port() -> None:
    def pod(name: str, ready: bool = True, **spec: Any) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "uid": f"u-{name}", "annotations": {"prometheus.io/port": "9100"}},
            "spec": spec,
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": str(ready)}]},
        }

    http = {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]}
    got = adapters.replicas([pod("b", **http), pod("a"), pod("c", ready=False)])
    assert got == [Replica("u-a", "a", "http://10.0.0.1:9100"), Replica("u-b", "b", "http://10.0.0.1:8000")]


# ------------------------------------------------------------------------------------------------ status


def state(name: str, loaded: dict[str, str] | None) -> ReplicaState:
    return ReplicaState(Replica(f"u-{name}", name, f"http://{name}"), loaded)


def test_entries_count_the_replicas_serving_each_adapter_from_the_wanted_uri() -> None:
    parsed = parse(RUNTIME)
    states = [
        state("p1", dict(WANT)),
        state("p2", {"sql": "hf://org/sql-lora@v1"}),  # the old URI: not this adapter yet
        state("p3", None),  # /v1/models did not answer
    ]
    failures = {("u-p2", "chat"): Failure(WANT["chat"], 1.0, "HTTP 400: no adapter_config.json")}
    assert adapters.entries(parsed.adapters, WANT, states, failures) == [
        {"name": "sql", "uri": WANT["sql"], "readyReplicas": 1},
        {
            "name": "chat",
            "uri": WANT["chat"],
            "readyReplicas": 1,
            "message": "pod p2: HTTP 400: no adapter_config.json",
        },
    ]


def test_adapters_ready_condition() -> None:
    ok = [{"name": "sql", "readyReplicas": 2}, {"name": "chat", "readyReplicas": 2}]
    assert adapters.condition(ok, 2)[:2] == (True, "Loaded")
    assert adapters.condition(ok, 3) == (False, "Loading", "of 3 ready replicas: sql on 2, chat on 2")
    assert adapters.condition(ok, 0)[:2] == (None, "NoReadyReplicas")
    assert adapters.condition([], 2)[:2] == (True, "NoAdapters")
    failed = [*ok, {"name": "bad", "readyReplicas": 0, "message": "pod p1: HTTP 400: rank 64 > 16"}]
    assert adapters.condition(failed, 2) == (
        False,
        "AdapterLoadFailed",
        "adapter bad failed to load: pod p1: HTTP 400: rank 64 > 16",
    )


def test_compute_status_carries_the_adapters_and_derives_the_condition() -> None:
    parsed = parse({**RUNTIME, "replicas": 2})
    runtime = {"metadata": {}, "spec": {"replicas": 2}, "status": {"replicas": 2, "readyReplicas": 2}}
    previous = {
        "adapters": [
            {"name": "sql", "uri": WANT["sql"], "readyReplicas": 2},
            {"name": "chat", "uri": "s3://adapters/chat/v0/", "readyReplicas": 2},  # the spec moved on
            {"name": "gone", "uri": "hf://org/gone", "readyReplicas": 2},
        ]
    }
    new = status.compute_status(
        name="svc", namespace="ml", parsed=parsed, runtime=runtime, router=None, previous=previous, now="t"
    )
    assert new["adapters"] == [
        {"name": "sql", "uri": WANT["sql"], "readyReplicas": 2},
        {"name": "chat", "uri": WANT["chat"], "readyReplicas": 0},
    ]
    (cond,) = [c for c in new["conditions"] if c["type"] == "AdaptersReady"]
    assert (cond["status"], cond["reason"]) == ("False", "Loading")
    # LoRA turned off: the block and the condition go.
    plain = status.compute_status(
        name="svc", namespace="ml", parsed=parse({"model": {"preset": "tiny"}}), runtime=runtime,
        router=None, previous=new, now="t",
    )  # fmt: skip
    assert "adapters" not in plain and not [c for c in plain["conditions"] if c["type"] == "AdaptersReady"]
    patch = status.status_patch(new, plain)
    assert patch is not None and patch["adapters"] is None


def test_an_invalid_spec_keeps_the_adapters_status() -> None:
    previous = {
        "adapters": [{"name": "sql", "uri": WANT["sql"], "readyReplicas": 2}],
        "conditions": [{"type": "AdaptersReady", "status": "True", "reason": "Loaded", "message": "m"}],
    }
    new = status.compute_status(
        name="svc",
        namespace="ml",
        parsed=SpecError("InvalidAdapters", "x"),
        runtime=None,
        router=None,
        previous=copy.deepcopy(previous),
        now="t",
    )
    assert new["adapters"] == previous["adapters"]
    assert [(c["type"], c["reason"]) for c in new["conditions"]][-1] == ("AdaptersReady", "Loaded")
