"""`chunkwise router`: build the router from its flags and serve it with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette

from chunkwise.router.core import Router
from chunkwise.router.cost import CostModel, Defaults
from chunkwise.router.discovery import Discovery, KubeDiscovery, StaticDiscovery, kube_api_client
from chunkwise.router.prompt import PromptReader, load_tokenizer
from chunkwise.router.proxy import build_app
from chunkwise.router.wake import WAKE_RETRY_AFTER_S, KubeScaler, WakeConfig, Waker

logger = logging.getLogger("chunkwise.router")

# Generations stream for as long as they take: no read timeout upstream. A replica that cannot accept a
# connection in this long is treated as down.
CONNECT_TIMEOUT_S = 5.0


def make_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=30.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        # Replica URLs are cluster addresses: never send them through a proxy from the environment.
        trust_env=False,
    )


def build(args: argparse.Namespace) -> tuple[Router, Starlette]:
    """The router and its app, from parsed flags; the app's lifespan runs discovery and the poller."""
    cost = CostModel(
        args.block_size,
        Defaults(prefill_rate=args.default_prefill_rate, tpot_s=args.default_tpot_seconds),
    )
    reader = PromptReader(
        load_tokenizer(args.tokenizer), args.block_size, args.default_max_tokens, cost.adapter_names
    )
    router = Router(
        policy=args.policy,
        cost=cost,
        client=make_client(),
        poll_interval_s=args.poll_interval_seconds,
        index_capacity_blocks=args.prefix_cache_blocks,
        kv_events=args.kv_events,
    )
    discovery: Discovery
    waker: Waker | None = None
    if args.wake_inference_service and not args.kube_service:
        raise ValueError("--wake-inference-service needs --kube-service: replicas appear through the Service")
    if args.kube_service:
        try:
            import kubernetes  # noqa: F401
        except ImportError:
            raise ValueError(
                "--kube-service needs the kubernetes client: pip install 'chunkwise[operator]'"
            ) from None
        discovery = KubeDiscovery(args.kube_service, args.namespace, args.poll_interval_seconds)
        if args.wake_inference_service:
            config = WakeConfig(
                service=args.wake_inference_service,
                namespace=args.namespace,
                queue_limit=args.wake_queue_limit,
                wait_s=args.wake_timeout_seconds,
                keepalive_s=args.keepalive_seconds,
                retry_after_s=WAKE_RETRY_AFTER_S,
            )
            scaler = KubeScaler(config.service, config.namespace, kube_api_client)
            waker = Waker(config, lambda: bool(router.candidates(router.clock())), scaler.scale_up)
    else:
        discovery = StaticDiscovery(args.replicas or [])

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        discovered = asyncio.Event()

        def update(urls: list[str]) -> None:
            router.set_replicas(urls)
            discovered.set()

        tasks = [asyncio.ensure_future(discovery.run(update))]
        # Readiness as soon as it is known, rather than one poll interval later.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(discovered.wait(), timeout=5.0)
        await router.probe_all()
        tasks.append(asyncio.ensure_future(router.poll_forever()))
        logger.info("routing with policy %s over %d replica(s)", router.policy.name, len(router.replicas))
        epp = None
        if args.epp_port is not None:
            from chunkwise.router.epp import start_epp  # grpc only where the picker is asked for

            epp = await start_epp(router, reader, args.host, args.epp_port, waker)
        try:
            yield
        finally:
            if epp is not None:
                await epp.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await router.close()
            await router.client.aclose()

    return router, build_app(router, reader, lifespan=lifespan, waker=waker)


def serve_router(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: the poller alone would write several lines a second.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        _, app = build(args)
    except (ValueError, OSError) as e:
        # A bad --tokenizer directory, or --kube-service without the kubernetes client.
        logger.error("cannot start the router: %s", e)
        return 2
    # No access log: at fleet request rates it would cost the router more CPU than routing does.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
