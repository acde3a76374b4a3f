"""RequestStream: one request's deltas from AsyncEngine, as an async iterator; StreamRegistry: the live
streams, and delivery to their event loops from the engine's threads."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from typing import Protocol

from chunkwise.engine.datatypes.outputs import RequestFailed, RequestOutput
from chunkwise.engine.datatypes.request import Request


class Aborter(Protocol):
    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """One request's deltas from AsyncEngine, as an async iterator.

    `close()` aborts the request unless it already finished (its KV blocks are freed within a step); it is
    idempotent, and callers call it in a `finally` so that a client disconnect, a cancelled task or an error
    anywhere in between never leaves a request generating for nobody.
    """

    def __init__(
        self, engine: Aborter, request: Request, q: asyncio.Queue[RequestOutput | Exception]
    ) -> None:
        self.engine = engine
        self.request_id = request.request_id
        self.prompt_token_ids: list[int] = request.prompt_token_ids
        self._q = q
        self.finished = False
        self._closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            for c in item.outputs:
                if c.finish_reason == "error":
                    raise RequestFailed(str(c.stop_reason))
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.finished:
                self.engine.abort(self.request_id)


Entry = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | Exception]"]


class StreamRegistry:
    """Request id -> (event loop, queue) of each stream still open. Guarded by the engine's lock, which it
    shares: registering a stream and counting its request as pending happen as one step (`*_locked`
    methods are called with the lock held)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._streams: dict[str, Entry] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def has_locked(self, rid: str) -> bool:
        return rid in self._streams

    def add_locked(
        self, rid: str, loop: asyncio.AbstractEventLoop, q: asyncio.Queue[RequestOutput | Exception]
    ) -> None:
        self._streams[rid] = (loop, q)

    def take_all_locked(self) -> list[Entry]:
        entries = list(self._streams.values())
        self._streams.clear()
        return entries

    def deliver(self, out: RequestOutput | Exception, rid: str) -> None:
        with self._lock:
            entry = self._streams.get(rid)
            if entry is not None and (isinstance(out, Exception) or out.finished):
                del self._streams[rid]
        if entry is not None:
            self.send([entry], out)

    def deliver_all(self, outs: Sequence[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop, not one per request."""
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput | Exception], RequestOutput]]
        ]
        by_loop = {}
        with self._lock:
            streams = self._streams
            for out in outs:
                entry = streams.get(out.request_id)
                if entry is None:
                    continue
                if out.finished:
                    del streams[out.request_id]
                loop, q = entry
                by_loop.setdefault(loop, []).append((q, out))
        for loop, items in by_loop.items():
            # A closed event loop raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)

    @staticmethod
    def send(entries: Sequence[Entry], item: RequestOutput | Exception) -> None:
        for loop, q in entries:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(q.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput | Exception], RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
