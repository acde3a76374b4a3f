"""The endpoint picker over real gRPC: a client plays the gateway, message by message as GAIE's Endpoint
Picker Protocol (docs/proposals/004-endpoint-picker-protocol, v1.0.0) and Envoy's ext_proc v3 specify.

The replicas behind the router are faked at its HTTP transport (their /health and /metrics); the edge under
test, the gRPC server, is real and listens on loopback.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkwise.engine.tokenizer import ByteTokenizer
from chunkwise.router.core import Router
from chunkwise.router.epp import (
    BODY_CHUNK,
    DESTINATION,
    LB_NAMESPACE,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
    start_epp,
)
from chunkwise.router.prompt import PromptReader

from .conftest import URLS
from .fake_replicas import FakeFleet, body, make_router

Mode = processing_mode_pb2.ProcessingMode
ENDPOINTS = [u.removeprefix("http://") for u in URLS]


class Gateway:
    """One ext_proc stream, driven the way Envoy drives it: send a message, read what comes back."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, msg: pb.ProcessingRequest) -> None:
        await self.call.write(msg)

    async def recv(self) -> pb.ProcessingResponse:
        msg = await self.call.read()
        assert msg is not grpc.aio.EOF, "the picker closed the stream"
        return msg

    async def close(self) -> None:
        await self.call.done_writing()


@pytest.fixture
async def fleet_router() -> AsyncIterator[tuple[FakeFleet, Router]]:
    fleet = FakeFleet()
    router = make_router(fleet, URLS, policy="round-robin")
    await router.probe_all()
    yield fleet, router
    await router.client.aclose()


@pytest.fixture
async def stub(fleet_router: tuple[FakeFleet, Router]) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    _, router = fleet_router
    server = await start_epp(router, PromptReader(ByteTokenizer(), 16, 64), "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.ExternalProcessorStub(channel)
    await channel.close()
    await server.stop(0)


def headers(path: str = "/v1/completions", eos: bool = False, **extra: str) -> pb.HttpHeaders:
    values = {":method": "POST", ":path": path, "content-type": "application/json", **extra}
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        ),
        end_of_stream=eos,
    )


def metadata(namespace: str, key: str, value: object) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: s})


def destination(resp: pb.ProcessingResponse, where: str) -> tuple[str, str]:
    """The header the picker set, and the dynamic metadata value: they must agree (the protocol)."""
    common = getattr(resp, where).response
    (option,) = common.header_mutation.set_headers
    assert option.header.key == DESTINATION
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert common.clear_route_cache
    meta = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value
    return option.header.raw_value.decode(), meta


def error_of(resp: pb.ProcessingResponse) -> tuple[int, dict[str, str], dict[str, object]]:
    imm = resp.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    return imm.status.code, hdrs, json.loads(imm.body)


async def test_full_duplex_request_is_routed_once_the_body_is_complete_and_its_answer_accounted(
    fleet_router: tuple[FakeFleet, Router], stub: pb_grpc.ExternalProcessorStub
) -> None:
    _, router = fleet_router
    gw = Gateway(stub)
    raw = body("x" * 70_000, max_tokens=4, stream=True)  # past one streamed chunk
    await gw.send(pb.ProcessingRequest(request_headers=headers()))
    half = len(raw) // 2
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[:half])))
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[half:], end_of_stream=True)))
    # Headers first (the destination), then the body, streamed back whole and in order.
    head = await gw.recv()
    assert head.WhichOneof("response") == "request_headers"
    header, meta = destination(head, "request_headers")
    assert header == meta
    names = header.split(",")
    assert names[0] == ENDPOINTS[0]  # round-robin's first
    assert sorted(names) == sorted(ENDPOINTS)  # the pick and two fallbacks, no repeats
    echoed = b""
    while True:
        part = await gw.recv()
        assert part.WhichOneof("response") == "request_body"
        streamed = part.request_body.response.body_mutation.streamed_response
        assert len(streamed.body) <= BODY_CHUNK
        echoed += streamed.body
        if streamed.end_of_stream:
            break
    assert echoed == raw
    assert len(router.replicas[URLS[0]].inflight) == 1

    # The answer: headers, then SSE chunks; the first token and the end reach the router's accounting.
    await gw.send(
        pb.ProcessingRequest(
            response_headers=headers(**{":status": "200", "content-type": "text/event-stream"}),
            metadata_context=metadata(LB_NAMESPACE, SERVED, ENDPOINTS[0]),
        )
    )
    assert (await gw.recv()).WhichOneof("response") == "response_headers"
    (entry,) = router.replicas[URLS[0]].inflight.values()
    assert entry.first_token_at is None
    chunk = b'data: {"choices":[{"text":"a"}]}\n\n'
    await gw.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
    out = await gw.recv()
    assert out.response_body.response.body_mutation.streamed_response.body == chunk
    assert entry.first_token_at is not None
    await gw.send(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))
    )
    last = await gw.recv()
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    assert not router.replicas[URLS[0]].inflight
    await gw.close()


async def test_buffered_mode_answers_the_headers_at_once_and_routes_on_the_body(
    fleet_router: tuple[FakeFleet, Router], stub: pb_grpc.ExternalProcessorStub
) -> None:
    gw = Gateway(stub)
    config = pb.ProtocolConfiguration(request_body_mode=Mode.BUFFERED, response_body_mode=Mode.NONE)
    await gw.send(pb.ProcessingRequest(request_headers=headers(), protocol_config=config))
    first = await gw.recv()
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body("hi"), end_of_stream=True)))
    second = await gw.recv()
    assert second.WhichOneof("response") == "request_body"
    header, meta = destination(second, "request_body")
    assert header == meta and header.split(",")[0] == ENDPOINTS[0]
    assert not second.request_body.response.HasField("body_mutation")  # the body goes on as it came
    await gw.close()


async def test_no_ready_endpoint_is_an_immediate_503(
    fleet_router: tuple[FakeFleet, Router], stub: pb_grpc.ExternalProcessorStub
) -> None:
    _, router = fleet_router
    for url in URLS:
        router.eject(router.replicas[url], "test")
    gw = Gateway(stub)
    await gw.send(pb.ProcessingRequest(request_headers=headers()))
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body(), end_of_stream=True)))
    status, hdrs, err = error_of(await gw.recv())
    assert status == 503
    assert hdrs["retry-after"] == "2"
    assert err["error"]["type"] == "service_unavailable"  # type: ignore[index]


async def test_the_subset_hint_restricts_the_pick_and_an_empty_one_is_503(
    stub: pb_grpc.ExternalProcessorStub,
) -> None:
    gw = Gateway(stub)
    hint = metadata(SUBSET_NAMESPACE, SUBSET, [ENDPOINTS[2]])
    await gw.send(pb.ProcessingRequest(request_headers=headers(), metadata_context=hint))
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body(), end_of_stream=True)))
    header, _ = destination(await gw.recv(), "request_headers")
    assert header == ENDPOINTS[2]  # no fallback outside the subset
    gw2 = Gateway(stub)
    await gw2.send(
        pb.ProcessingRequest(
            request_headers=headers(), metadata_context=metadata(SUBSET_NAMESPACE, SUBSET, ["10.9.9.9:8000"])
        )
    )
    await gw2.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body(), end_of_stream=True)))
    assert error_of(await gw2.recv())[0] == 503


async def test_a_sheddable_request_no_replica_can_serve_in_time_is_429_with_retry_after(
    fleet_router: tuple[FakeFleet, Router], stub: pb_grpc.ExternalProcessorStub
) -> None:
    _, router = fleet_router
    gw = Gateway(stub)
    await gw.send(
        pb.ProcessingRequest(request_headers=headers(**{"x-slo-ttft-ms": "0.001", "x-sheddable": "true"}))
    )
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body("y" * 3000), end_of_stream=True)))
    status, hdrs, err = error_of(await gw.recv())
    assert status == 429
    assert int(hdrs["retry-after"]) >= 1
    assert err["error"]["type"] == "rate_limit_exceeded"  # type: ignore[index]
    assert not any(r.inflight for r in router.replicas.values())
    # The same targets without x-sheddable: routed, best effort.
    gw2 = Gateway(stub)
    await gw2.send(pb.ProcessingRequest(request_headers=headers(**{"x-slo-ttft-ms": "0.001"})))
    await gw2.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body("y" * 3000), end_of_stream=True)))
    assert (await gw2.recv()).WhichOneof("response") == "request_headers"


@pytest.mark.parametrize(
    ("extra", "raw", "needle"),
    [({}, b"{not json", "not JSON"), ({"x-slo-ttft-ms": "soon"}, body(), "x-slo-ttft-ms")],
)
async def test_a_bad_body_or_slo_header_is_an_immediate_400(
    stub: pb_grpc.ExternalProcessorStub, extra: dict[str, str], raw: bytes, needle: str
) -> None:
    gw = Gateway(stub)
    await gw.send(pb.ProcessingRequest(request_headers=headers(**extra)))
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))
    status, _, err = error_of(await gw.recv())
    assert status == 400
    assert needle in err["error"]["message"]  # type: ignore[index]


async def test_the_accounting_follows_the_endpoint_that_served_and_ends_if_the_stream_goes_away(
    fleet_router: tuple[FakeFleet, Router], stub: pb_grpc.ExternalProcessorStub
) -> None:
    _, router = fleet_router
    gw = Gateway(stub)
    await gw.send(pb.ProcessingRequest(request_headers=headers()))
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body(max_tokens=3), end_of_stream=True)))
    header, _ = destination(await gw.recv(), "request_headers")
    await gw.recv()  # the body
    primary, fallback = header.split(",")[:2]
    # The gateway's first try failed; the fallback served.
    await gw.send(
        pb.ProcessingRequest(
            response_headers=headers(**{":status": "200", "content-type": "application/json"}),
            metadata_context=metadata(LB_NAMESPACE, SERVED, fallback),
        )
    )
    await gw.recv()
    inflight = {u.removeprefix("http://"): len(r.inflight) for u, r in router.replicas.items()}
    assert inflight[primary] == 0 and inflight[fallback] == 1
    gw.call.cancel()  # the client went away mid-answer
    for _ in range(100):
        if not any(r.inflight for r in router.replicas.values()):
            break
        await asyncio.sleep(0.01)
    assert not any(r.inflight for r in router.replicas.values())


async def test_a_request_without_body_goes_to_any_endpoint_without_accounting(
    fleet_router: tuple[FakeFleet, Router], stub: pb_grpc.ExternalProcessorStub
) -> None:
    _, router = fleet_router
    gw = Gateway(stub)
    await gw.send(pb.ProcessingRequest(request_headers=headers("/v1/models", eos=True, **{":method": "GET"})))
    header, meta = destination(await gw.recv(), "request_headers")
    assert header == meta and header in ENDPOINTS
    assert not any(r.inflight for r in router.replicas.values())


async def test_grpc_health_reports_the_services_the_protocol_names(
    fleet_router: tuple[FakeFleet, Router],
) -> None:
    _, router = fleet_router
    server = await start_epp(router, PromptReader(ByteTokenizer(), 16, 64), "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
        await server.stop(0)


async def test_streamed_body_mode_is_refused_with_a_message_naming_the_modes_that_work(
    stub: pb_grpc.ExternalProcessorStub,
) -> None:
    gw = Gateway(stub)
    config = pb.ProtocolConfiguration(request_body_mode=Mode.STREAMED)
    await gw.send(pb.ProcessingRequest(request_headers=headers(), protocol_config=config))
    status, _, err = error_of(await gw.recv())
    assert status == 500
    assert err["error"]["type"] == "server_error"  # type: ignore[index]
    assert "FULL_DUPLEX_STREAMED" in err["error"]["message"]  # type: ignore[index]
