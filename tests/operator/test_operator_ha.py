"""Two operator replicas with Kopf peering on kmock: one works, the other stands by, and takes over when the
active one is killed (SIGKILL: no goodbye in the peering object, so the standby waits out its lifetime)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kmock as km
import pytest
from operator_harness import ROOT, Cluster, eventually, running_operator

from chunkwise_operator.main import PEERING_LIFETIME_ENV, PEERING_NAME, peering_priority

PEERINGS = km.resource("kopf.dev/v1/clusterkopfpeerings")
TINY = {"model": {"preset": "tiny"}, "image": "chunkwise:dev"}
LIFETIME_S = 2


def test_the_older_replica_has_the_higher_priority() -> None:
    assert peering_priority(1000.0, 999) > peering_priority(1000.001, 0)
    assert peering_priority(1000.0, 1) != peering_priority(1000.0, 2)


def peers(cluster: Cluster) -> dict[str, dict[str, object]]:
    obj = cluster.get(PEERINGS, PEERING_NAME, namespace=None)
    return dict((obj or {}).get("status") or {}) if obj is not None else {}


def deployment_replicas(cluster: Cluster) -> int | None:
    return (cluster.get(Cluster.DEPLOYMENTS, "chat") or {}).get("spec", {}).get("replicas")


async def test_the_standby_takes_over_when_the_active_replica_is_killed(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(PEERING_LIFETIME_ENV, str(LIFETIME_S))
    command = [sys.executable, "-m", "kopf", "run", "--all-namespaces", "--peering", PEERING_NAME]
    log = tmp_path / "active.log"
    with log.open("w") as sink:
        # The older replica, so the active one: a process of its own, to be killed without a word.
        active = subprocess.Popen(
            [*command, "-m", "chunkwise_operator.main"],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
        try:
            await eventually(
                lambda: active.poll() is not None or peers(cluster), timeout=30, what="active peer"
            )
            assert active.poll() is None, log.read_text()
            async with running_operator(cluster, caplog, standby=True, peering_name=PEERING_NAME) as standby:
                await eventually(lambda: len(peers(cluster)) == 2, what="two peers")

                await cluster.create_isvc("chat", TINY)
                await eventually(
                    lambda: deployment_replicas(cluster) == 1, timeout=20, what="active reconciled"
                )
                # A mandatory peer starts paused, and stays so while an older one lives.
                assert standby.count("Resuming operations after the pause") == 0
                assert standby.count("Handler 'reconcile-") == 0

                active.send_signal(signal.SIGKILL)
                await asyncio.to_thread(active.wait, 10)
                killed = time.monotonic()
                await cluster.patch_isvc("chat", {"spec": {"replicas": 3}})
                await eventually(
                    lambda: deployment_replicas(cluster) == 3, timeout=15, what="standby took over"
                )
                takeover = time.monotonic() - killed
                assert standby.count("Resuming operations after the pause") >= 1
                # It waited for the dead peer's record to expire, and not much longer.
                assert takeover < LIFETIME_S + 5, takeover
                print(f"takeover after SIGKILL: {takeover:.1f} s (peering lifetime {LIFETIME_S} s)")
                assert standby.failures() == []
        finally:
            if active.poll() is None:
                active.kill()
                active.wait(10)
    assert "Created the peering object" in log.read_text()
