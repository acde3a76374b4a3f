"""GET /v1/kv_events and /v1/kv_events/snapshot: the engine's prefix-cache changes, for the fleet router.

    GET /v1/kv_events?after=N   -> 200 {"epoch", "seq", "block_size", "events": [{"seq", "stored", "removed",
                                   "stored_host", "removed_host"}]}
                                   the events after sequence number N (0: all kept), in order; "seq" is the
                                   last one's. 410 when some of them are no longer kept, or N is ahead of
                                   the log (the engine restarted): read the snapshot and go on from its seq.
    GET /v1/kv_events/snapshot  -> 200 {"epoch", "seq", "block_size", "hashes", "host_hashes"}: every cached
                                   block as of seq.

Hashes are the prefix cache's chained block hashes (cache/hashing.py) as 32 hex digits. Applying the events
in order to the snapshot's set reproduces the engine's cache after each step. A new epoch means a new engine
process: its sequence numbers began again.

"stored" and "removed" (and "hashes") are the device cache's. With a host tier (--kv-offloading-size) the
blocks in host memory (medium "cpu") are in "stored_host", "removed_host" and "host_hashes", empty without
one: a reader that knows only the device's lists reads them as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from chunkwise.engine.cache.events import KVEventLog, hash_hex
from chunkwise.server.errors import APIError, bad_request
from chunkwise.server.serving import UNAVAILABLE_RETRY_AFTER_S

if TYPE_CHECKING:
    from chunkwise.server.serving import ServerState


def add_kv_event_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/kv_events")
    async def kv_events(request: Request) -> JSONResponse:
        log, block_size = _log(state)
        raw = request.query_params.get("after", "0")
        try:
            after = int(raw)
        except ValueError:
            raise bad_request(f"after must be an integer sequence number, got {raw!r}", "after") from None
        if after < 0:
            raise bad_request(f"after must be >= 0, got {after}", "after")
        since = log.since(after)
        if since is None:
            raise APIError(
                410,
                f"events after {after} are no longer kept (or the engine restarted): read "
                "/v1/kv_events/snapshot and continue from its seq",
                type="kv_events_gone",
                code="resync",
            )
        events: list[dict[str, Any]] = [
            {
                "seq": e.seq,
                "stored": [hash_hex(h) for h in e.stored],
                "removed": [hash_hex(h) for h in e.removed],
                "stored_host": [hash_hex(h) for h in e.stored_host],
                "removed_host": [hash_hex(h) for h in e.removed_host],
            }
            for e in since.events
        ]
        return JSONResponse(
            {"epoch": since.epoch, "seq": since.seq, "block_size": block_size, "events": events}
        )

    @app.get("/v1/kv_events/snapshot")
    async def kv_snapshot() -> JSONResponse:
        log, block_size = _log(state)
        snap = log.snapshot()
        return JSONResponse(
            {
                "epoch": snap.epoch,
                "seq": snap.seq,
                "block_size": block_size,
                "hashes": [hash_hex(h) for h in snap.hashes],
                "host_hashes": [hash_hex(h) for h in snap.host_hashes],
            }
        )


def _log(state: ServerState) -> tuple[KVEventLog, int]:
    engine = state.engine
    if engine is None:
        raise APIError(503, "the engine is loading", headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
    log = engine.kv_events
    if log is None:
        raise APIError(
            404,
            "this engine publishes no KV events (prefix caching is off, or --kv-events-buffer is 0)",
            type="not_found_error",
        )
    return log, engine.model_info.block_size
