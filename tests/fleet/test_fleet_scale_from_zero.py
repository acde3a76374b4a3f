"""Scale from zero on the local fleet: kmock as the API server, the real operator, router and engine.

The service starts at 0 replicas (going there after scaleToZeroAfterSeconds idle is tested on kmock, in
tests/operator/test_autoscale_operator.py); a streaming request is held by the router (SSE comments while
it waits), which raises the InferenceService's /scale to 1, and completes once the new replica is ready.
The cold start is printed (pytest -s), never asserted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from e2e.local.fleet import LocalFleet

NAME = "chat"
SPEC: dict[str, Any] = {
    "model": {"preset": "tiny"},
    "image": "chunkwise:local",
    "replicas": 0,
    "engine": {"maxNumSeqs": 2, "kvCacheMemory": "64Mi", "drainGraceSeconds": 1},
    "router": {"enabled": True, "policy": "round-robin"},
    "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": 60},
}


def test_a_request_sent_at_zero_replicas_completes(tmp_path: Path) -> None:
    with LocalFleet(tmp_path) as fleet:
        fleet.create_isvc(NAME, SPEC)
        # A router that can wake its service is ready with no replica at all.
        url = fleet.wait_for(lambda: fleet.router_url(NAME), 90, "the router ready")
        assert not fleet.runtime_pods(NAME)

        sent = time.monotonic()
        request = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=request, timeout=120, trust_env=False
        ) as resp:
            status = resp.status_code
            lines = [line for line in resp.iter_lines() if line]
        cold_start_s = time.monotonic() - sent

        assert status == 200, lines
        assert lines[0] == ": waiting for a replica to start"
        data = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {")]
        assert data and all("error" not in d for d in data), lines
        assert "".join(d["choices"][0]["text"] for d in data)
        assert lines[-1] == "data: [DONE]"
        # The router raised the count; the operator and the harness did the rest.
        assert fleet.isvc(NAME)["spec"]["replicas"] == 1
        comments = sum(1 for line in lines if line.startswith(":"))
    print(
        f"scale from zero: a request at 0 replicas completed after {cold_start_s:.1f} s of cold start "
        f"({comments} keep-alive comments)"
    )
