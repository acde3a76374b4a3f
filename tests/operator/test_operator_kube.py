"""kube.py: drift detection (pure) and create-or-patch/delete against the emulated API server."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from typing import Any

import kmock as km
import kopf
import kubernetes
import pytest
from e2e.local.kube import INFERENCE_POOLS
from operator_harness import NAMESPACE, Cluster

from chunkwise_operator import manifests
from chunkwise_operator.kube import (
    INFERENCE_POOL,
    ChildConflict,
    Kube,
    Outcome,
    controller_owner,
    differs,
    drifted,
    owned_by,
    unsent,
)
from chunkwise_operator.spec import parse

OWNER = kopf.Body(
    {
        "apiVersion": "serving.chunkwise.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "tiny", "namespace": NAMESPACE, "uid": "uid-tiny"},
    }
)


@pytest.mark.parametrize(
    ("desired", "live", "expected"),
    [
        ({"a": 1}, {"a": 1, "defaulted": "x"}, False),
        ({"a": {"b": [1, {"c": 2}]}}, {"a": {"b": [1, {"c": 2, "d": 3}]}}, False),
        ({"a": 1}, {"a": 2}, True),
        ({"a": 1}, {}, True),
        ({"a": [1, 2]}, {"a": [1]}, True),
        ({"a": [1, 2]}, {"a": [2, 1]}, True),
        ({"a": {"b": 1}}, {"a": "b"}, True),
        ({"a": ["x"]}, {"a": {"0": "x"}}, True),
    ],
)
def test_drifted(desired: Any, live: Any, expected: bool) -> None:
    assert drifted(desired, live) is expected


@pytest.mark.parametrize(
    ("desired", "live", "expected"),
    [
        (
            {"requests": {"cpu": "0.5", "memory": "1.5Gi"}},
            {"requests": {"cpu": "500m", "memory": "1536Mi"}},
            False,
        ),
        ({"limits": {"cpu": 2}}, {"limits": {"cpu": "2"}}, False),
        ({"emptyDir": {"sizeLimit": "1Gi"}}, {"emptyDir": {"sizeLimit": "1024Mi"}}, False),
        ({"requests": {"cpu": "0.5"}}, {"requests": {"cpu": "501m"}}, True),
        # Only quantity fields compare by value: an env var "0.5" is not the string "500m".
        ({"env": [{"name": "X", "value": "0.5"}]}, {"env": [{"name": "X", "value": "500m"}]}, True),
    ],
)
def test_quantities_compare_by_value(desired: Any, live: Any, expected: bool) -> None:
    assert differs(desired, live) is expected


# A Deployment's managedFields entry as a real API server writes it (keyed list elements, "." nodes).
OWNED = {
    "f:metadata": {"f:annotations": {"f:team": {}}},
    "f:spec": {
        "f:template": {
            "f:spec": {
                "f:nodeSelector": {"f:zone": {}},
                "f:containers": {
                    'k:{"name":"engine"}': {
                        ".": {},
                        "f:env": {'k:{"name":"A"}': {".": {}, "f:value": {}}},
                        "f:ports": {'k:{"containerPort":8000,"protocol":"TCP"}': {".": {}, "f:name": {}}},
                        "f:args": {},
                    }
                },
                "f:finalizers": {'v:"x"': {}},
            }
        }
    },
}


def test_unsent_names_the_owned_fields_no_longer_sent() -> None:
    engine = {
        "name": "engine",
        "env": [{"name": "A", "value": "1"}],
        "ports": [{"containerPort": 8000, "name": "http"}],
        "args": [],
    }
    desired = {
        "metadata": {"annotations": {"team": "t"}},
        "spec": {
            "template": {"spec": {"nodeSelector": {"zone": "a"}, "containers": [engine], "finalizers": ["x"]}}
        },
    }
    assert list(unsent(OWNED, desired)) == []
    desired["metadata"]["annotations"] = {}
    desired["spec"]["template"]["spec"]["nodeSelector"] = {}
    engine["env"] = []
    desired["spec"]["template"]["spec"]["finalizers"] = []
    assert list(unsent(OWNED, desired)) == [
        "f:metadata.f:annotations.f:team",
        "f:spec.f:template.f:spec.f:nodeSelector.f:zone",
        'f:spec.f:template.f:spec.f:containers.k:{"name":"engine"}.f:env.k:{"name":"A"}',
        'f:spec.f:template.f:spec.f:finalizers.v:"x"',
    ]
    live = {
        **desired,
        "metadata": {
            "annotations": {"team": "t"},
            "managedFields": [{"manager": "chunkwise-operator", "operation": "Apply", "fieldsV1": OWNED}],
        },
    }
    assert drifted(desired, live)


def test_ownership_helpers() -> None:
    child: dict[str, Any] = {"metadata": {}}
    kopf.append_owner_reference(child, owner=OWNER)
    assert owned_by(child, "uid-tiny")
    assert not owned_by(child, "uid-other")
    assert controller_owner(child) == "tiny"
    assert (
        controller_owner({"metadata": {"ownerReferences": [{"kind": "ReplicaSet", "controller": True}]}})
        is None
    )


@pytest.fixture
def kube(cluster: Cluster) -> Iterator[Kube]:
    client = Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url)))
    yield client
    client.close()


def deployment() -> dict[str, Any]:
    dep = manifests.runtime_deployment("tiny", NAMESPACE, parse({"model": {"preset": "tiny"}, "image": "i"}))
    kopf.append_owner_reference(dep, owner=OWNER)
    return dep


async def test_apply_creates_then_leaves_alone_then_corrects_drift(cluster: Cluster, kube: Kube) -> None:
    desired = deployment()

    assert await asyncio.to_thread(kube.apply, copy.deepcopy(desired), "uid-tiny") is Outcome.CREATED
    live = cluster.get(Cluster.DEPLOYMENTS, "tiny")
    assert live is not None and live["spec"] == desired["spec"] and not drifted(desired, live)
    assert await asyncio.to_thread(kube.apply, copy.deepcopy(desired), "uid-tiny") is Outcome.UNCHANGED

    await cluster.patch_deployment("tiny", {"spec": {"replicas": 7}})
    assert await asyncio.to_thread(kube.apply, copy.deepcopy(desired), "uid-tiny") is Outcome.PATCHED
    live = cluster.get(Cluster.DEPLOYMENTS, "tiny")
    assert live is not None and live["spec"]["replicas"] == 1
    # The write was a server-side apply under the operator's field manager, forced over other managers.
    patch = list(cluster.k[km.action.UPDATE, Cluster.DEPLOYMENTS])[-1]
    assert patch.headers["Content-Type"] == "application/apply-patch+yaml"
    assert patch.params == {"fieldManager": "chunkwise-operator", "force": "true"}


async def test_apply_refuses_objects_owned_by_others(cluster: Cluster, kube: Kube) -> None:
    foreign = deployment()
    foreign["metadata"]["ownerReferences"] = []
    await asyncio.to_thread(kube.apply, foreign, "uid-someone")  # created with no owner at all
    with pytest.raises(ChildConflict, match="Deployment default/tiny exists and is not owned"):
        await asyncio.to_thread(kube.apply, deployment(), "uid-tiny")
    assert not await asyncio.to_thread(
        kube.delete_owned, "apps/v1", "Deployment", NAMESPACE, "tiny", "uid-tiny"
    )
    assert cluster.get(Cluster.DEPLOYMENTS, "tiny") is not None


async def test_delete_owned(cluster: Cluster, kube: Kube) -> None:
    await asyncio.to_thread(kube.apply, deployment(), "uid-tiny")
    assert await asyncio.to_thread(kube.delete_owned, "apps/v1", "Deployment", NAMESPACE, "tiny", "uid-tiny")
    assert cluster.get(Cluster.DEPLOYMENTS, "tiny") is None
    assert not await asyncio.to_thread(
        kube.delete_owned, "apps/v1", "Deployment", NAMESPACE, "tiny", "uid-tiny"
    )
    assert await asyncio.to_thread(kube.get, "apps/v1", "Deployment", NAMESPACE, "tiny") is None


async def test_a_custom_resource_child_is_applied_and_deleted_like_the_others(
    cluster: Cluster, kube: Kube
) -> None:
    """The InferencePool goes through CustomObjectsApi; the same verbs, the same server-side apply."""
    pool = manifests.inference_pool("tiny", NAMESPACE)
    kopf.append_owner_reference(pool, owner=OWNER)
    assert await asyncio.to_thread(kube.serves, INFERENCE_POOL)
    assert await asyncio.to_thread(kube.apply, copy.deepcopy(pool), "uid-tiny") is Outcome.CREATED
    live = cluster.pool("tiny")
    assert live is not None and live["spec"] == pool["spec"]
    assert await asyncio.to_thread(kube.apply, copy.deepcopy(pool), "uid-tiny") is Outcome.UNCHANGED
    await cluster.patch(Cluster.POOLS, "tiny", {"spec": {"targetPorts": [{"number": 1}]}})
    assert await asyncio.to_thread(kube.apply, copy.deepcopy(pool), "uid-tiny") is Outcome.PATCHED
    patch = list(cluster.k[km.action.UPDATE, Cluster.POOLS])[-1]
    assert patch.headers["Content-Type"] == "application/apply-patch+yaml"
    assert patch.params == {"fieldManager": "chunkwise-operator", "force": "true"}
    assert (cluster.pool("tiny") or {})["spec"]["targetPorts"] == [{"number": 8000}]
    api_version, kind, name = manifests.inference_pool_ref("tiny")
    assert await asyncio.to_thread(kube.delete_owned, api_version, kind, NAMESPACE, name, "uid-tiny")
    assert cluster.pool("tiny") is None


async def test_serves_reads_discovery(cluster: Cluster, kube: Kube) -> None:
    del cluster.k.resources[INFERENCE_POOLS]
    assert not await asyncio.to_thread(kube.serves, INFERENCE_POOL)
    # The group served, but not this resource of it.
    cluster.k.resources["inference.networking.k8s.io/v1/inferenceobjectives"] = {"kind": "InferenceObjective"}
    assert not await asyncio.to_thread(kube.serves, INFERENCE_POOL)
    cluster.k.resources[INFERENCE_POOLS] = {"kind": "InferencePool", "namespaced": True}
    assert await asyncio.to_thread(kube.serves, INFERENCE_POOL)
