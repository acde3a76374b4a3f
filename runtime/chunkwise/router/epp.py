"""The router as a Gateway API Inference Extension endpoint picker (EPP): Envoy's ext_proc v3 over gRPC.

A gateway (Istio, kgateway, Envoy Gateway, GKE) calls `envoy.service.ext_proc.v3.ExternalProcessor/Process`
once per HTTP request; this module answers as the Endpoint Picker Protocol (GAIE
docs/proposals/004-endpoint-picker-protocol, v1.0.0) asks:

- the request's headers and body come in; once the body is complete the replica is picked by the same
  `Router.pick` the HTTP proxy uses (policy, prefix index, SLO headers), and the answer names it in the
  `x-gateway-destination-endpoint` header and in dynamic metadata `envoy.lb` under the same key, as
  `ip:port`, followed by fallbacks (the other candidates in order of predicted completion);
- `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` in the request's metadata restricts the
  pick to those endpoints;
- no ready endpoint: an immediate 503; a sheddable request no replica can serve within its targets: an
  immediate 429 with Retry-After; a body that is not JSON, or a bad SLO header: an immediate 400;
- the answer's headers and body pass through; the router's accounting of the request follows them (first
  token, end), on the endpoint the gateway reports in `envoy.lb` / `x-gateway-destination-endpoint-served`.

Body modes: FULL_DUPLEX_STREAMED (what GAIE configures, and what is assumed when the gateway sends no
`protocol_config`) holds the request headers' answer until the body is complete, then streams the body back;
BUFFERED answers the headers at once and puts the destination on the body's answer. STREAMED cannot route on
the body and is refused with a message saying so.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkwise.router.core import Pick, Router
from chunkwise.router.prompt import CHAT, COMPLETIONS, PromptReader, RoutedRequest
from chunkwise.router.slo import Shed, Slo, SloHeaderError, parse_slo
from chunkwise.router.sse import FirstTokenWatch
from chunkwise.router.wake import Waker

logger = logging.getLogger("chunkwise.router.epp")

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Endpoints named per answer: the pick and this many fallbacks for the gateway's retries.
MAX_FALLBACKS = 2
# Some Envoy builds cap a streamed chunk at 64 KiB; the body goes back in pieces below that.
BODY_CHUNK = 62_000
NO_ENDPOINT_RETRY_AFTER_S = 2

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED_MODES = (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL)
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def endpoint_of(url: str) -> str:
    """A replica URL as the protocol names endpoints: `ip:port`."""
    return urlsplit(url).netloc


def _header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def _struct_get(metadata: base_pb2.Metadata, namespace: str, key: str) -> Any:
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values]
    return None


def immediate(status: int, message: str, headers: dict[str, str] | None = None) -> pb.ProcessingResponse:
    """The gateway answers the client itself: OpenAI's error body, as the router's HTTP face gives it."""
    kind = {400: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}.get(
        status, "server_error"
    )
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    mutation = pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
            for k, v in {"content-type": "application/json", **(headers or {})}.items()
        ]
    )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation,
            body=json.dumps(body).encode(),
            details=message,
        )
    )


def _continue() -> pb.CommonResponse:
    return pb.CommonResponse()


def _streamed(body: bytes, end: bool) -> list[pb.CommonResponse]:
    pieces = [body[i : i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    return [
        pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(
                    body=piece, end_of_stream=end and i == len(pieces) - 1
                )
            )
        )
        for i, piece in enumerate(pieces)
    ]


@dataclass
class _Exchange:
    """One ext_proc stream: one HTTP request and its answer."""

    picker: EndpointPicker
    request_mode: int = FULL_DUPLEX
    response_mode: int = FULL_DUPLEX
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    metadata: base_pb2.Metadata = field(default_factory=base_pb2.Metadata)
    pick: Pick | None = None
    watch: FirstTokenWatch | None = None
    routed: bool = False

    async def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            self.request_mode = msg.protocol_config.request_body_mode
            self.response_mode = msg.protocol_config.response_body_mode
        if msg.HasField("metadata_context"):
            self.metadata = msg.metadata_context
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(msg.request_headers)
        if kind == "request_body":
            return await self._request_body(msg.request_body)
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self._response_headers(msg.response_headers)
        if kind == "response_body":
            return self._response_body(msg.response_body)
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    # -- the request ---------------------------------------------------------------------------------------
    async def _request_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.headers = _header_map(headers)
        if headers.end_of_stream:  # no body (GET /v1/models): route now
            return await self._route(b"", body_follows=False)
        if self.request_mode == _Mode.STREAMED:
            return [
                self.picker.refuse(
                    500,
                    "request_body_mode STREAMED sends the headers on before the body, so the endpoint "
                    "cannot be picked from it: configure FULL_DUPLEX_STREAMED (GAIE's default) or BUFFERED",
                    "bad_configuration",
                )
            ]
        if self.request_mode in BUFFERED_MODES:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=_continue()))]
        return []  # full duplex: the headers' answer waits for the body

    async def _request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.body += body.body
        if not body.end_of_stream:
            return []
        return await self._route(bytes(self.body), body_follows=True)

    async def _route(self, body: bytes, *, body_follows: bool) -> list[pb.ProcessingResponse]:
        picker = self.picker
        path = self.headers.get(":path", "").split("?", 1)[0]
        generation = path in (COMPLETIONS, CHAT)
        data: Any = None
        if generation and body_follows:
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                return [picker.refuse(400, "the request body is not JSON", "bad_request")]
        try:
            slo = parse_slo(self.headers) if generation else None
        except SloHeaderError as e:
            return [picker.refuse(400, str(e), "bad_request")]
        subset = _struct_get(self.metadata, SUBSET_NAMESPACE, SUBSET)
        exclude = picker.outside(subset) if subset is not None else []
        routed = picker.reader.read_parsed(path, data) if generation else RoutedRequest(path=path)
        try:
            endpoints = await picker.choose(routed, exclude, slo, accounted=generation)
        except Shed as e:
            return [picker.refuse(429, e.message, "shed", {"retry-after": str(e.retry_after_s)})]
        if isinstance(endpoints, str):
            return [
                picker.refuse(503, endpoints, "unavailable", {"retry-after": str(NO_ENDPOINT_RETRY_AFTER_S)})
            ]
        self.pick, names = endpoints
        self.routed = True
        picker.router.metrics.epp_streams.labels("routed").inc()
        value = ",".join(names)
        common = pb.CommonResponse(
            header_mutation=pb.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=DESTINATION, raw_value=value.encode()),
                        append_action=_OVERWRITE,
                    )
                ]
            ),
            clear_route_cache=True,
        )
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: value}})
        if not body_follows:
            return [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
                )
            ]
        if self.request_mode in BUFFERED_MODES:
            return [
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
                )
            ]
        head = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
        )
        return [head] + [
            pb.ProcessingResponse(request_body=pb.BodyResponse(response=c)) for c in _streamed(body, True)
        ]

    # -- the answer ----------------------------------------------------------------------------------------
    def _response_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        served = _struct_get(self.metadata, LB_NAMESPACE, SERVED)
        if self.pick is not None and isinstance(served, str) and served:
            self.pick = self.picker.follow(self.pick, served)
        answer = _header_map(headers)
        ok = answer.get(":status", "200") == "200"
        if self.pick is not None and ok and answer.get("content-type", "").startswith("text/event-stream"):
            self.watch = FirstTokenWatch(self.headers.get(":path", "").split("?", 1)[0])
        out = [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=_continue()))]
        if headers.end_of_stream:
            self.end()
        return out

    def _response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.watch is not None and self.pick is not None and self.watch.feed(body.body):
            self.picker.router.first_token(self.pick)
            self.watch = None
        if body.end_of_stream:
            self.end()
        if self.response_mode == FULL_DUPLEX:
            return [
                pb.ProcessingResponse(response_body=pb.BodyResponse(response=c))
                for c in _streamed(body.body, body.end_of_stream)
            ]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=_continue()))]

    def end(self) -> None:
        """The request is over (answered, or the stream went away): its accounting ends, once."""
        if self.pick is not None:
            self.picker.router.finish(self.pick)
            self.pick = None


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """ext_proc's one RPC, over the router's state. Runs on the router's event loop (grpc.aio)."""

    def __init__(self, router: Router, reader: PromptReader, waker: Waker | None = None) -> None:
        self.router = router
        self.reader = reader
        self.waker = waker

    async def Process(  # the RPC's name in the proto
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange(self)
        try:
            async for msg in request_iterator:
                for out in await exchange.handle(msg):
                    yield out
                    if out.HasField("immediate_response"):
                        return
        finally:
            exchange.end()

    def refuse(
        self, status: int, message: str, outcome: str, headers: dict[str, str] | None = None
    ) -> pb.ProcessingResponse:
        self.router.metrics.epp_streams.labels(outcome).inc()
        self.router.metrics.responses.labels(str(status)).inc()
        return immediate(status, message, headers)

    def outside(self, subset: Iterable[str]) -> list[str]:
        """The replica URLs a subset hint rules out."""
        allowed = set(subset)
        return [url for url in self.router.replicas if endpoint_of(url) not in allowed]

    async def choose(
        self, routed: RoutedRequest, exclude: list[str], slo: Slo | None, *, accounted: bool
    ) -> tuple[Pick | None, list[str]] | str:
        """The pick and the endpoints to name, or why there are none. Raises Shed."""
        router = self.router
        if not accounted:
            replica = router.any_candidate(exclude)
            if replica is None:
                return await self._none()
            return None, [endpoint_of(replica.url)]
        pick = router.pick(routed, exclude=exclude, slo=slo)
        if pick is None:
            return await self._none()
        now = router.clock()
        rest = router.candidates(now, [*exclude, pick.replica.url])
        rest.sort(key=lambda r: router.cost.predict(r, routed, now).completion)
        return pick, [endpoint_of(pick.replica.url)] + [endpoint_of(r.url) for r in rest[:MAX_FALLBACKS]]

    async def _none(self) -> str:
        if self.waker is not None:
            await self.waker.nudge()  # scale from zero: the gateway's retry finds a replica
        return "no endpoint of the pool is ready"

    def follow(self, pick: Pick, served: str) -> Pick:
        """The gateway used a fallback: the accounting moves to the endpoint that served."""
        if endpoint_of(pick.replica.url) == served:
            return pick
        for url, replica in self.router.replicas.items():
            if endpoint_of(url) == served:
                return self.router.move(pick, replica)
        return pick


# The gRPC health services GAIE's protocol names; the empty name is the server as a whole.
HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


@dataclass
class EppServer:
    server: grpc.aio.Server
    health: Any
    port: int

    async def stop(self, grace_s: float = 5.0) -> None:
        # Not ready first, so a gateway health-checking the picker stops choosing it before streams end.
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


async def start_epp(
    router: Router, reader: PromptReader, host: str, port: int, waker: Waker | None = None
) -> EppServer:
    """Serve ext_proc and gRPC health (plaintext, h2c) on host:port; port 0 picks a free one."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(router, reader, waker), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen for the endpoint picker on {host}:{port}")
    await server.start()
    for name in HEALTH_SERVICES:
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("endpoint picker (Envoy ext_proc, gRPC h2c) listening on %s:%d", host, bound)
    return EppServer(server, checks, bound)
