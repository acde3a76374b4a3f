"""`chunkwise router`'s flags and start-up, short of serving on a port."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from chunkwise.router.args import add_router_args
from chunkwise.router.run import build
from chunkwise_operator import manifests
from chunkwise_operator.spec import parse as parse_spec


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return parser.parse_args(list(argv))


def test_flags_and_their_defaults() -> None:
    args = parse("--replicas", "http://127.0.0.2:8000, http://127.0.0.3:8000")
    assert args.replicas == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]
    assert (args.host, args.port, args.policy) == ("127.0.0.1", 8080, "predicted-completion")
    assert (args.poll_interval_seconds, args.block_size, args.tokenizer) == (0.5, 16, "byte")
    # What the operator's router Deployment runs parses, and means what the operator meant.
    spec = parse_spec(
        {"model": {"preset": "tiny"}, "image": "i", "router": {"enabled": True, "policy": "least-loaded"}}
    )
    argv = manifests.router_command("chat", "ml", spec)
    assert argv[:2] == ["chunkwise", "router"]
    kube = parse(*argv[2:])
    assert (kube.kube_service, kube.namespace, kube.replicas) == ("chat", "ml", None)
    assert (kube.host, kube.port, kube.policy) == ("0.0.0.0", manifests.ROUTER_PORT, "least-loaded")


@pytest.mark.parametrize(
    "argv",
    [
        [],  # replicas from somewhere is required
        ["--replicas", "http://a:1", "--kube-service", "chat"],
        ["--replicas", "http://a:1", "--policy", "random"],
        ["--replicas", "http://a:1", "--block-size", "0"],
        ["--replicas", "http://a:1", "--poll-interval-seconds", "0"],
    ],
)
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


def test_app_starts_probes_and_reports_health() -> None:
    # Nothing listens on these: the start-up probe ejects both, and the router says it cannot serve.
    router, app = build(parse("--replicas", "http://127.0.0.1:9,http://127.0.0.1:19"))
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable", "replicas": 2, "healthy": 0}
        assert sorted(router.replicas) == ["http://127.0.0.1:19", "http://127.0.0.1:9"]
        metrics = client.get("/metrics").text
        assert 'chunkwise:router_replica_healthy{replica="http://127.0.0.1:9"} 0.0' in metrics


def test_parsing_the_flags_imports_nothing_heavy() -> None:
    code = (
        "import json, sys; import chunkwise.cli, chunkwise.router.args; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('httpx', 'starlette', 'prometheus_client', 'torch', 'kubernetes'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == []
