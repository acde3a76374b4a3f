"""An operator upgrade rolls no service by itself (issue 31, point 9): the real Kopf operator on kmock.

The operator's default runtime image is spec.DEFAULT_IMAGE, read when a service is reconciled; the test moves
it between two operator runs, as installing a new release would.
"""

from __future__ import annotations

from typing import Any

import pytest
from operator_harness import Cluster, eventually, running_operator

from chunkwise_operator import render
from chunkwise_operator import spec as spec_module
from chunkwise_operator.spec import RUNTIME_IMAGE_STATUS, UPGRADE_RUNTIME_ANNOTATION

OLD, NEW = "chunkwise/runtime:0.1.0", "chunkwise/runtime:0.2.0"
# No spec.image: the service runs the operator's default. The router too (its default is the CPU image).
SERVICE = {"model": {"preset": "tiny"}, "router": {"enabled": True}}


def images(cluster: Cluster, name: str) -> tuple[str | None, str | None]:
    def first(dep: dict[str, Any] | None) -> str | None:
        return None if dep is None else dep["spec"]["template"]["spec"]["containers"][0]["image"]

    return first(cluster.get(Cluster.DEPLOYMENTS, name)), first(
        cluster.get(Cluster.DEPLOYMENTS, f"{name}-router")
    )


def pinned(cluster: Cluster, name: str) -> str | None:
    return ((cluster.isvc(name) or {}).get("status") or {}).get(RUNTIME_IMAGE_STATUS)


async def test_an_operator_upgrade_keeps_each_services_image_until_asked(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spec_module, "DEFAULT_IMAGE", OLD)
    async with running_operator(cluster, caplog):
        await cluster.create_isvc("old", SERVICE)
        await eventually(lambda: images(cluster, "old") == (OLD, OLD), what="the old release's image")
        await eventually(lambda: pinned(cluster, "old") == OLD, what="the image recorded in the status")

    # The new release: its operator starts, resumes every service (Kopf's resume handler reconciles).
    monkeypatch.setattr(spec_module, "DEFAULT_IMAGE", NEW)
    async with running_operator(cluster, caplog):
        await cluster.create_isvc("fresh", SERVICE)
        await eventually(
            lambda: images(cluster, "fresh") == (NEW, NEW), what="a new service on the new image"
        )
        assert pinned(cluster, "fresh") == NEW
        # A spec change of the old service (a reconcile) still keeps its image.
        await cluster.patch_isvc("old", {"spec": {"replicas": 2}})
        await eventually(
            lambda: (cluster.get(Cluster.DEPLOYMENTS, "old") or {}).get("spec", {}).get("replicas") == 2,
            what="the spec change applied",
        )
        assert images(cluster, "old") == (OLD, OLD)
        assert pinned(cluster, "old") == OLD

        # The opt-in: the old service moves to the running operator's image, and its status says so.
        await cluster.patch_isvc("old", {"metadata": {"annotations": {UPGRADE_RUNTIME_ANNOTATION: "true"}}})
        await eventually(lambda: images(cluster, "old") == (NEW, NEW), what="the old service rolled")
        await eventually(lambda: pinned(cluster, "old") == NEW, what="the new image recorded")


def test_a_gpu_service_pins_the_cuda_build_of_the_recorded_release() -> None:
    gpu = {
        "model": {"preset": "tiny"},
        "resources": {"gpu": 1, "memory": "16Gi"},
        "router": {"enabled": True},
    }
    parsed = spec_module.parse(gpu, OLD)
    assert parsed.image == OLD + "-cuda"
    assert parsed.router.image == OLD
    # Given explicitly, spec.image wins over any pin.
    assert spec_module.parse({**gpu, "image": "mine:1"}, OLD).image == "mine:1"


def rendered_images(live: dict[str, Any]) -> set[str]:
    """The images of every Deployment container `chunkwise operator render` prints for a live object."""
    objects, _ = render.render_documents([live], "<stdin>")
    return {
        c["image"]
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    }


def test_render_of_a_live_object_shows_its_pinned_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kubectl get infsvc -o yaml | chunkwise operator render -f -` shows what the operator applies."""
    monkeypatch.setattr(spec_module, "DEFAULT_IMAGE", NEW)
    live = {
        "apiVersion": "serving.chunkwise.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "old"},
        "spec": SERVICE,
        "status": {RUNTIME_IMAGE_STATUS: OLD},
    }
    assert rendered_images(live) == {OLD}
    live["metadata"]["annotations"] = {UPGRADE_RUNTIME_ANNOTATION: "true"}
    assert rendered_images(live) == {NEW}
