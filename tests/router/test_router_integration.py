"""`chunkwise router` as a process in front of real `chunkwise serve` replicas on 127.0.0.x addresses.

The official openai client talks to the router; the replicas are real engines (the tiny model), each on
its own loopback address at port 8000, as pods would be.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from e2e.local.processes import Child, free_hosts, router_argv, serve_argv, wait_healthy

STARTUP_S = 120.0
SYSTEM = "You are the fleet's assistant. Answer briefly and cite the runbook section. " * 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-integration")


@pytest.fixture(scope="module")
def replicas(workdir: Path) -> Iterator[list[str]]:
    """Two engines, shared by the module's tests (each takes seconds to load)."""
    hosts = free_hosts(8000, 2, first=40)
    children = [Child(f"replica-{h}", serve_argv(h), workdir / f"replica-{h}.log") for h in hosts]
    try:
        for h, c in zip(hosts, children):
            wait_healthy(f"http://{h}:8000", STARTUP_S, c)
        yield [f"http://{h}:8000" for h in hosts]
    finally:
        for c in children:
            c.stop()


class RouterProcess:
    def __init__(self, workdir: Path, replicas: list[str], *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.child = Child(
            f"router-{self.port}",
            router_argv("127.0.0.1", self.port, replicas, "--poll-interval-seconds", "0.2", *flags),
            workdir / f"router-{self.port}.log",
        )

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", trust_env=False, timeout=5).text

    def metric(self, line_prefix: str) -> float:
        for line in self.metrics().splitlines():
            if line.startswith(line_prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
def start_router(workdir: Path) -> Iterator[object]:
    started: list[RouterProcess] = []

    def start(replica_urls: list[str], *flags: str) -> RouterProcess:
        r = RouterProcess(workdir, replica_urls, *flags)
        started.append(r)
        wait_healthy(r.url, 30, r.child)
        return r

    yield start
    for r in started:
        r.child.stop()


def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=router.url + "/v1", api_key="unused", http_client=httpx.Client(trust_env=False)
    )


def test_openai_client_through_the_router(replicas: list[str], start_router: object) -> None:
    router = start_router(replicas)  # type: ignore[operator]
    c = client(router)
    done = c.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0.0)
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 5
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.choices[0].message.role == "assistant"
    # Streaming survives the hop: several chunks, then the usage the client asked for.
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert len(chunks) >= 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_replica_errors_pass_through(replicas: list[str], start_router: object) -> None:
    router = start_router(replicas)  # type: ignore[operator]
    c = client(router)
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="not-served", prompt="x", max_tokens=2)
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
    # The raw answer is the replica's own, byte for byte, plus the header naming it.
    direct = httpx.post(replicas[0] + "/v1/completions", json={"model": "tiny", "prompt": 5}, trust_env=False)
    routed = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": 5}, trust_env=False)
    assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())
    assert routed.headers["x-chunkwise-replica"] in replicas


def test_shared_prefix_goes_where_it_is_cached_and_the_hashes_agree(
    replicas: list[str], start_router: object
) -> None:
    router = start_router(replicas, "--policy", "predicted-completion")  # type: ignore[operator]
    served: list[str] = []
    cached: list[int] = []
    with httpx.Client(trust_env=False, timeout=30) as http:
        for i in range(6):
            body = {"model": "tiny", "prompt": SYSTEM + f"Question {i}: what now?", "max_tokens": 2}
            resp = http.post(router.url + "/v1/completions", json=body)
            assert resp.status_code == 200
            served.append(resp.headers["x-chunkwise-replica"])
            cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    # One at a time, nothing queued: every request after the first goes where the prefix is.
    assert len(set(served)) == 1
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    # The router's prefix index (the engine's own block hashes) predicted exactly the engine's hits.
    assert router.metric("chunkwise:router_predicted_cached_tokens_total") == sum(cached)


async def test_a_burst_is_spread_not_herded(replicas: list[str], start_router: object) -> None:
    router = start_router(replicas, "--policy", "predicted-completion")  # type: ignore[operator]

    async def one(http: httpx.AsyncClient, i: int) -> str:
        # Long enough that none finishes while the others are still being picked, even on a loaded machine
        # (at 48 tokens the first finished before the last was picked once, under two test workers).
        body = {"model": "tiny", "prompt": f"burst {i} " * 20, "max_tokens": 256, "ignore_eos": True}
        resp = await http.post(router.url + "/v1/completions", json=body)
        assert resp.status_code == 200
        return resp.headers["x-chunkwise-replica"]

    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        served = await asyncio.gather(*(one(http, i) for i in range(8)))
    # All eight picked within milliseconds, before any finished: the accounting at pick time splits them.
    counts = Counter(served)
    assert set(counts) == set(replicas)
    assert max(counts.values()) <= 5, counts


def test_unreachable_replica_is_ejected_then_readmitted(
    replicas: list[str], start_router: object, workdir: Path
) -> None:
    (host,) = free_hosts(8000, 1, first=60)
    late = f"http://{host}:8000"
    router = start_router([*replicas, late])  # type: ignore[operator]
    with httpx.Client(trust_env=False, timeout=30) as http:
        for i in range(6):
            resp = http.post(
                router.url + "/v1/completions", json={"model": "tiny", "prompt": f"q{i}", "max_tokens": 2}
            )
            assert resp.status_code == 200 and resp.headers["x-chunkwise-replica"] != late
        health = http.get(router.url + "/health").json()
        assert (health["replicas"], health["healthy"]) == (3, 2)

        child = Child(f"replica-{host}", serve_argv(host), workdir / f"replica-{host}.log")
        try:
            wait_healthy(late, STARTUP_S, child)
            for _ in range(200):
                if http.get(router.url + "/health").json()["healthy"] == 3:
                    break
                time.sleep(0.1)
            assert http.get(router.url + "/health").json()["healthy"] == 3
            # Readmitted, it takes requests again: at once, or once its first scrapes have measured it (an
            # unmeasured replica's stand-in speed can lose to measured ones for a few poll intervals).
            served: Counter[str] = Counter()
            deadline = time.monotonic() + 20
            while served[late] == 0 and time.monotonic() < deadline:
                served[
                    http.post(
                        router.url + "/v1/completions",
                        json={"model": "tiny", "prompt": f"again {sum(served.values())}", "max_tokens": 2},
                    ).headers["x-chunkwise-replica"]
                ] += 1
            assert served[late] > 0, served

            # It dies: requests already routed to it are retried elsewhere, and it is ejected again.
            child.kill()
            child.wait(10)
            for i in range(6):
                resp = http.post(
                    router.url + "/v1/completions",
                    json={"model": "tiny", "prompt": f"after {i}", "max_tokens": 2},
                )
                assert resp.status_code == 200 and resp.headers["x-chunkwise-replica"] != late
        finally:
            child.stop()
    ejections = [
        line
        for line in router.metrics().splitlines()
        if line.startswith("chunkwise:router_ejections_total") and late in line
    ]
    assert ejections, router.metrics()


def test_client_disconnect_aborts_upstream_and_releases_accounting(
    replicas: list[str], start_router: object
) -> None:
    router = start_router(replicas)  # type: ignore[operator]
    body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(trust_env=False, timeout=30) as http:
        with http.stream("POST", router.url + "/v1/completions", json=body) as resp:
            replica = resp.headers["x-chunkwise-replica"]
            next(resp.iter_raw())  # generation has started; now walk away
        for _ in range(100):
            inflight = router.metric(f'chunkwise:router_replica_inflight{{replica="{replica}"}}')
            running = [
                line
                for line in http.get(replica + "/metrics").text.splitlines()
                if line.startswith("vllm:num_requests_running")
            ]
            if inflight == 0 and running and running[0].endswith(" 0.0"):
                break
            time.sleep(0.1)
    assert inflight == 0
    assert running and running[0].endswith(" 0.0"), running


def test_the_router_as_an_endpoint_picker_names_a_real_replica_that_then_serves(
    replicas: list[str], start_router: object
) -> None:
    """A gRPC client plays the gateway: ask the picker, send the request where it says, report the answer."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from google.protobuf import struct_pb2

    epp_port = free_port()
    router = start_router(replicas, "--epp-port", str(epp_port))  # type: ignore[operator]
    raw = b'{"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "stream": true}'

    def hdrs(values: dict[str, str], eos: bool = False) -> pb.HttpHeaders:
        return pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
            ),
            end_of_stream=eos,
        )

    async def gateway() -> tuple[str, list[bytes]]:
        import grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(
                pb.ProcessingRequest(request_headers=hdrs({":method": "POST", ":path": "/v1/completions"}))
            )
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))
            head = await call.read()
            endpoint = (
                head.dynamic_metadata.fields["envoy.lb"]
                .struct_value.fields["x-gateway-destination-endpoint"]
                .string_value.split(",")[0]
            )
            body = await call.read()
            assert body.request_body.response.body_mutation.streamed_response.body == raw
            chunks: list[bytes] = []
            async with (
                httpx.AsyncClient(trust_env=False) as http,
                http.stream("POST", f"http://{endpoint}/v1/completions", content=raw) as resp,
            ):
                served = struct_pb2.Struct()
                served.update({"x-gateway-destination-endpoint-served": endpoint})
                await call.write(
                    pb.ProcessingRequest(
                        response_headers=hdrs(
                            {":status": str(resp.status_code), "content-type": resp.headers["content-type"]}
                        ),
                        metadata_context=base_pb2.Metadata(filter_metadata={"envoy.lb": served}),
                    )
                )
                await call.read()
                async for chunk in resp.aiter_raw():
                    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
                    out = await call.read()
                    chunks.append(out.response_body.response.body_mutation.streamed_response.body)
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
            await call.read()
            await call.done_writing()
            return endpoint, chunks

    endpoint, chunks = asyncio.run(gateway())
    assert f"http://{endpoint}" in replicas
    text = b"".join(chunks)
    assert text.count(b"data: ") >= 5 and text.rstrip().endswith(b"data: [DONE]")
    assert router.metric('chunkwise:router_epp_streams_total{outcome="routed"}') == 1
    # The answer ended: nothing stays in flight at the picked replica.
    assert 'chunkwise:router_replica_inflight{replica="http://' + endpoint + '"} 0.0' in router.metrics()
