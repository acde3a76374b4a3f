"""RequestStream: one request's deltas from AsyncEngine, as an async iterator."""

from __future__ import annotations

import asyncio
from typing import Protocol

from chunkwise.outputs import RequestOutput
from chunkwise.request import Request


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
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.finished:
                self.engine.abort(self.request_id)
