"""`chunkwise serve`: load the engine, serve the app with uvicorn, drain on SIGTERM.

Start-up: uvicorn listens at once and the engine loads on a thread meanwhile, so /health answers 503
"loading" (not connection refused) until the model is ready.

Drain: the first SIGTERM or SIGINT sets the app draining (new requests and /health get 503 with Retry-After)
while uvicorn keeps accepting connections; requests in flight get --drain-timeout-seconds to finish, the rest
are aborted; then uvicorn shuts down and `serve` returns 0. A second signal stops at once. uvicorn's own
handler would re-raise the signal after shutdown (so the process would die by SIGTERM rather than exit 0);
ours replaces it. Tensor and pipeline parallel's ranks start with the engine and stop after the drain; a rank
lost at any time stops the server with exit code 1 (the requests in flight get the error).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from chunkwise.engine.args import engine_config_from_args
from chunkwise.engine.worker.tp_stage import RankFailure
from chunkwise.server.app import build_app
from chunkwise.server.serving import ServerState

if TYPE_CHECKING:
    from chunkwise.engine import AsyncEngine

logger = logging.getLogger("chunkwise.server")

# After aborting what the drain timeout left, how long to wait for those streams to end.
_ABORT_GRACE_S = 5.0
# uvicorn's own limit on waiting for connections to close once the drain is done.
_GRACEFUL_SHUTDOWN_S = 10


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler on the event loop's thread: hand the work to the loop.
        if self._signalled or self._loop is None:
            logger.warning("second signal %s: stopping without waiting for requests in flight", sig)
            self.should_exit = True
            self.force_exit = self._signalled
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        state = self.state
        state.draining = True
        engine = state.engine
        if engine is not None:
            logger.info(
                "draining: %d request(s) in flight, up to %.0fs", engine.num_unfinished, self.drain_timeout_s
            )
            if not await _wait_idle(engine, self.drain_timeout_s):
                n = engine.abort_all()
                logger.warning("drain timeout: aborted %d request(s)", n)
                await _wait_idle(engine, _ABORT_GRACE_S)
        logger.info("drained; shutting down")
        self.should_exit = True


async def _wait_idle(engine: AsyncEngine, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while engine.num_unfinished > 0:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = engine_config_from_args(args)  # --max-waiting included: it is an engine option too
    except ValueError as e:
        logger.error("invalid engine arguments: %s", e)
        return 2
    if (args.lora_modules or args.allow_runtime_lora) and not config.enable_lora:
        logger.error("invalid engine arguments: --lora-modules and --allow-runtime-lora need --enable-lora")
        return 2
    app = build_app(
        None,
        served_model_name=args.served_model_name or args.model,
        max_waiting=args.max_waiting,
        queue_delay_slo_s=args.queue_delay_slo_seconds or None,
        max_request_bytes=args.max_request_bytes,
        allow_runtime_lora=args.allow_runtime_lora,
        lora_cache_dir=args.lora_cache_dir,
        tenant_header=args.tenant_header,
    )
    state: ServerState = app.state.chunkwise
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="off",
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
    )
    server = DrainingServer(uv_config, state, args.drain_timeout_seconds)
    engines: list[AsyncEngine] = []
    load_error: list[BaseException] = []
    lost_ranks: list[BaseException] = []

    def on_death(error: BaseException) -> None:
        # A lost tensor-parallel rank cannot be recovered in this process: exit (non-zero) so the pod restarts
        # as a whole, rather than serve 503s until a probe notices. Other engine deaths keep /health at 503.
        if isinstance(error, RankFailure):
            logger.error("the engine lost a rank: %s; the server stops", error)
            lost_ranks.append(error)
            server.should_exit = True

    def load() -> None:
        from chunkwise.engine import AsyncEngine

        try:
            t0 = time.monotonic()
            engine = AsyncEngine(config, on_death=on_death)
            engine.start()
            engines.append(engine)
            for name, path in args.lora_modules:
                state.adapters.load(engine, name, path)
                logger.info("LoRA adapter %s from %s", name, path)
            state.attach(engine)
            info = engine.model_info
            weights = (
                info.dtype
                if info.quantization is None
                else f"{info.dtype}, linear layers {info.quantization}"
            )
            logger.info("model %s ready in %.1fs: %s", config.model, time.monotonic() - t0, weights)
        except BaseException as e:
            logger.exception("the engine failed to load")
            load_error.append(e)
            server.should_exit = True

    loader = threading.Thread(target=load, name="chunkwise-load", daemon=True)
    loader.start()
    try:
        server.run()
    finally:
        # A signal during start-up: let the load finish (torch must not be torn down mid-load) and stop it.
        loader.join()
        for engine in engines:
            engine.shutdown()
    return 1 if load_error or lost_ranks else 0
