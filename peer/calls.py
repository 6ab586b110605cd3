"""The values that cross the RPC API: requests, replies, handlers, and reply containers.

Handlers see a :class:`Request` and answer with a :class:`Reply` (or, for a streaming
method, yield several). ``payload`` carries raw bytes (tensors) outside the msgpack body; an
incoming payload is a zero-copy ``memoryview`` valid for as long as it is referenced.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from protocol.identity import PeerID

from .errors import PeerUnavailableError

__all__ = [
    "STREAM_BUFFER_BYTES",
    "STREAM_BUFFER_ITEMS",
    "ConnectionClosedError",
    "Handler",
    "HandlerRegistry",
    "PendingCall",
    "PendingStream",
    "QuickHandler",
    "Reply",
    "ReplyStream",
    "Request",
    "StreamHandler",
]

STREAM_BUFFER_ITEMS = 32
"""Items of a streaming reply buffered before the connection's reader waits for the consumer."""
STREAM_BUFFER_BYTES = 16 << 20
"""Payload bytes of a streaming reply buffered before the reader waits (but always one
item): 32 items of a peer's largest frames held 128 MiB per stream (a review)."""


@dataclass(frozen=True, slots=True)
class Request:
    """An incoming call, as a handler sees it."""

    peer_id: PeerID
    method: str
    body: dict[str, Any]
    payload: bytes | memoryview
    remote_host: str = "?"
    """The caller's network host (IP), e.g. to build its address from an advertised port."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A handler's answer (or one item of a streaming answer)."""

    body: dict[str, Any] = field(default_factory=dict)
    payload: bytes | memoryview = b""


Handler = Callable[[Request], Awaitable[Reply]]
QuickHandler = Callable[[Request], Reply]
"""A plain function that answers at once from memory (no I/O, no waiting): it runs on the
connection's reader, without a task of its own (the DHT's handlers are of this kind)."""
StreamHandler = Callable[[Request], AsyncIterator[Reply]]


class ConnectionClosedError(PeerUnavailableError):
    """The connection was already closed: the request was never sent (safe to retry)."""


class HandlerRegistry:
    """Methods by name: plain handlers answer once, stream handlers yield items."""

    def __init__(self) -> None:
        self.unary: dict[str, Handler] = {}
        self.quick: dict[str, QuickHandler] = {}
        self.streaming: dict[str, StreamHandler] = {}

    def register(self, method: str, handler: Handler) -> None:
        """Serve ``method`` with ``handler``.

        Raises:
            ValueError: if ``method`` is already registered.
        """
        self._check_free(method)
        self.unary[method] = handler

    def register_quick(self, method: str, handler: QuickHandler) -> None:
        """Serve ``method`` with a plain function that answers at once (see QuickHandler).

        Raises:
            ValueError: if ``method`` is already registered.
        """
        self._check_free(method)
        self.quick[method] = handler

    def register_stream(self, method: str, handler: StreamHandler) -> None:
        """Serve ``method`` with an async generator of reply items.

        Raises:
            ValueError: if ``method`` is already registered.
        """
        self._check_free(method)
        self.streaming[method] = handler

    def unregister(self, method: str) -> None:
        """Stop serving ``method`` (requests for it answer ``unknown_method``; calls already
        running finish). Unknown methods are ignored."""
        for table in (self.unary, self.quick, self.streaming):
            table.pop(method, None)

    def _check_free(self, method: str) -> None:
        if method in self.unary or method in self.quick or method in self.streaming:
            raise ValueError(f"method {method!r} is already registered")


class PendingCall:
    """The caller's side of a plain call: the reader sets ``reply`` or ``error``, then ``done``."""

    __slots__ = ("done", "error", "reply")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: Reply | None = None
        self.error: BaseException | None = None


class PendingStream:
    """The caller's side of a streaming call: items arrive on ``send``; ``finish`` ends it."""

    __slots__ = ("error", "finished", "held", "receive", "send", "taken")

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[Reply](STREAM_BUFFER_ITEMS)
        self.error: BaseException | None = None
        self.finished = False
        self.held = 0
        """Payload bytes of the items buffered for the consumer."""
        self.taken = trio.Event()
        """Set (and replaced) when the consumer takes an item or leaves."""

    def has_room(self, size: int) -> bool:
        """Whether an item of ``size`` payload bytes fits the buffer (within
        STREAM_BUFFER_ITEMS and STREAM_BUFFER_BYTES, or the buffer is empty)."""
        stats = self.send.statistics()
        if stats.current_buffer_used >= stats.max_buffer_size:
            return False
        return not self.held or self.held + size <= STREAM_BUFFER_BYTES

    def took(self, item: Reply) -> None:
        """The consumer took ``item`` (or left: None-sized)."""
        self.held -= memoryview(item.payload).nbytes
        self.taken.set()
        self.taken = trio.Event()

    def finish(self, error: BaseException | None) -> None:
        """End the stream, cleanly (``error`` None) or with ``error`` raised to the reader."""
        self.error = error
        self.finished = True
        self.send.close()


AnswerWait = Callable[[Callable[[], Awaitable[Reply]], float], Awaitable[Reply]]
"""How a caller waits for an answer: ``wait(receive, since)`` awaits ``receive()`` while the
connection watches for the peer's silence since ``since`` (``Calling._await_answer``, in
``rpc_calling.py``)."""


class ReplyStream:
    """The items of a streaming reply; raises ``RemoteError``/``PeerUnavailableError``."""

    def __init__(
        self, pending: PendingStream, wait: AnswerWait | None = None, since: float = 0.0
    ) -> None:
        self._pending = pending
        self._wait = wait
        self._since = since  # when the request went out, then when the last item came

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> Reply:
        try:
            if self._wait is None:
                item = await self._pending.receive.receive()
            else:
                item = await self._wait(self._pending.receive.receive, self._since)
                self._since = trio.current_time()
        except trio.EndOfChannel:
            if self._pending.error is not None:
                raise self._pending.error from self._pending.error.__cause__
            raise StopAsyncIteration from None
        self._pending.took(item)
        return item
