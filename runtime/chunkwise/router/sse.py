"""Where a relayed stream of server-sent events carries its first generated token (HTTP proxy and EPP)."""

from __future__ import annotations

from chunkwise.router.prompt import CHAT


class FirstTokenWatch:
    """Finds the first generated token in a stream of SSE events (chunks may split or join events).

    Chat streams open with an empty assistant-role event, so their first token is the second event.
    """

    def __init__(self, path: str) -> None:
        self.events_before_token = 1 if path == CHAT else 0
        self.seen = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> bool:
        data = self._tail + chunk
        self.seen += data.count(b"\n\n")
        self._tail = data[-1:]
        return self.seen > self.events_before_token
