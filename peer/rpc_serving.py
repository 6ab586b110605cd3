"""The serving side of an RPC connection: the peer's requests, answered under its deadline.

:class:`Serving` is mixed into :class:`~peer.rpc.RpcConnection` (rules in ``peer/rpc.py``).
A request runs its handler in a task of its own under the caller's deadline and cancel; a
quick handler's request is answered on the reader, or, while the outbox is full, from a
backlog that one task answers in turn. A handler's failure becomes a typed error reply.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import trio

from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.rpc import (
    MAX_ERROR_CODE_LENGTH,
    MAX_ERROR_MESSAGE_LENGTH,
    FrameKind,
    RpcFrame,
)

from .calls import QuickHandler, Reply, Request
from .errors import LimitExceededError, PeerUnavailableError, RemoteError
from .rpc_link import DIRECT_MAX, Incoming, RpcLink

logger = logging.getLogger("peer.rpc")


class Serving(RpcLink):
    """The peer's requests to us, and our answers."""

    def _start_request(self, frame: RpcFrame, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._serve_request, frame, self._register(frame))

    def _register(self, frame: RpcFrame) -> Incoming:
        if frame.request_id in self._incoming:
            raise RemoteProtocolError(f"request id {frame.request_id} is already in flight")
        if len(self._incoming) >= self.max_inflight_requests:
            raise RemoteProtocolError(f"more than {self.max_inflight_requests} requests in flight")
        deadline = math.inf if frame.timeout is None else trio.current_time() + frame.timeout
        incoming = Incoming(trio.CancelScope(deadline=deadline))
        self._incoming[frame.request_id] = incoming
        return incoming

    def _queue_quick(
        self,
        frame: RpcFrame,
        nursery: trio.Nursery,
        incoming: Incoming | None = None,
        reply: Reply | None = None,
    ) -> None:
        """A quick request that came while the outbox was full (or whose large ``reply``
        found no room in the host's send budget): answered in turn by one task, not a task
        each (a peer that pipelines its 128 and reads nothing made us hold 128 tasks, ~5 KiB
        each, on each of its connections)."""
        incoming = self._register(frame) if incoming is None else incoming
        incoming.queued = True
        self._quick_backlog.append((frame, incoming, reply))
        if not self._quick_draining:
            self._quick_draining = True
            nursery.start_soon(self._drain_quick)

    async def _drain_quick(self) -> None:
        try:
            while self._quick_backlog:
                frame, incoming, reply = self._quick_backlog.popleft()
                incoming.queued = False
                await self._serve_request(frame, incoming, reply)
        finally:
            self._quick_draining = False

    async def _serve_request(
        self, frame: RpcFrame, incoming: Incoming, reply: Reply | None = None
    ) -> None:
        request_id = frame.request_id
        request = Request(self.peer_id, frame.method, frame.body, frame.payload, self.remote_host)
        unary = frame.method not in self._handlers.streaming  # its error may skip the queue
        try:
            direct = None
            try:
                with incoming.scope:  # the caller's deadline, and its cancel
                    try:
                        last = await self._answer(request, request_id, reply)
                    except Exception as exc:
                        code, message = self._error_reply(frame.method, exc)
                        last = self._encode(_error_frame(request_id, code, message)), unary
                    if last is not None:
                        direct = await self._queue_or_claim(*last)
            except PeerUnavailableError:
                raise
            except Exception:
                # A handler's nursery whose child failed as the scope was cancelled raises
                # a group of the error and the Cancelled, which the scope's exit leaves as a
                # group of the error alone: it ends this request, never the connection or
                # the host (a review: it took the whole node down).
                logger.debug(
                    "%r: handler %s failed as it was cancelled", self, frame.method, exc_info=True
                )
                direct = None
            if direct is not None:
                # Outside the scope: the caller's cancel (or deadline) coming now must not
                # cut the write off midway, which would end the connection for every call.
                await self._write_claimed(direct)
            elif incoming.scope.cancelled_caught and not incoming.by_caller and not self.closed:
                await self._send_error(request_id, "timeout", "the deadline passed", unary)
        except PeerUnavailableError:
            pass  # the connection closed under us
        finally:
            if self._incoming.get(request_id) is incoming:
                del self._incoming[request_id]
            self._served.unpark_all()

    async def _queue_or_claim(
        self, frame: tuple[list[bytes | memoryview], int], urgent: bool
    ) -> list[bytes | memoryview] | None:
        """Queue a frame (waiting for room, cancellable), or claim the stream to write it
        directly: then its pieces, to write with :meth:`_write_claimed` at once.

        Raises:
            PeerUnavailableError: if the connection is closed.
        """
        pieces, size = frame
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._claim_direct(size):
            return pieces
        await self._queue(pieces, size, urgent=urgent and size <= DIRECT_MAX)
        return None

    def _answer_quick(self, frame: RpcFrame, handler: QuickHandler, nursery: trio.Nursery) -> None:
        """Answer on the reader, no task: the reply is queued for the writer, or, when it
        is large and the host's send budget has no room for it, in the quick backlog."""
        request = Request(self.peer_id, frame.method, frame.body, frame.payload, self.remote_host)
        try:
            reply = handler(request)
            pieces, size = self._encode_reply(frame.request_id, reply)
        except Exception as exc:
            code, message = self._error_reply(frame.method, exc)
            pieces, size = self._encode(_error_frame(frame.request_id, code, message))
        else:
            if not self._outbox.budget_fits(size):
                del pieces  # not held while it waits: made again then
                self._queue_quick(frame, nursery, reply=reply)
                return
        self._outbox.put_nowait(pieces, urgent=size <= DIRECT_MAX, size=size)  # (large: bulk)

    def _error_reply(self, method: str, exc: Exception) -> tuple[str, str]:
        """The error code and message that answer a handler's exception (a group of one,
        as a nursery in the handler wraps it, answers as that one)."""
        while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        if isinstance(exc, RemoteError):
            return exc.code, exc.message
        if isinstance(exc, LocalProtocolError):  # e.g. our reply's body cannot be packed
            logger.debug("%r: cannot answer %s: %s", self, method, exc)
            return "internal", str(exc)
        if isinstance(exc, ProtocolError):
            return "bad_request", str(exc)
        if isinstance(exc, LimitExceededError):
            logger.debug("%r: reply to %s too large: %s", self, method, exc)
            return "internal", "reply too large"
        logger.debug("%r: handler %s failed", self, method, exc_info=True)
        return "internal", type(exc).__name__  # its text may hold local details

    async def _answer(
        self, request: Request, request_id: int, made: Reply | None = None
    ) -> tuple[tuple[list[bytes | memoryview], int], bool] | None:
        """Run the handler (a quick one's ``made`` reply: it ran already) and queue the
        frames of its answer, but the last: returned (encoded, and whether it may skip the
        bulk queue) for the caller to write, or None when every frame was queued."""
        method = request.method
        if (handler := self._handlers.unary.get(method)) is not None:
            return self._encode_reply(request_id, await handler(request)), True
        if (quick := self._handlers.quick.get(method)) is not None:  # the outbox was full
            # One at a time: a peer that asks for many large replies and reads none must
            # not make each of its requests hold one, nor each of its connections (1,024 of
            # them) one while it waits. A small reply needs room in the urgent queue only
            # (it skips the bulk frames and takes nothing from the send budget: pings and
            # lookups never wait behind others' unread pages); a large one waits, not held
            # (made again after), for the bulk queue and the budget.
            async with self._overflow:
                try:
                    await self._outbox.wait_for_room()
                    reply = quick(request) if made is None else made
                    pieces, size = self._encode_reply(request_id, reply)
                    bulk = size > DIRECT_MAX
                    if (bulk and not self._outbox.has_room()) or not self._outbox.budget_fits(size):
                        del pieces
                        await self._outbox.wait_for_room(bulk=bulk, size=size)
                        pieces, size = self._encode_reply(request_id, reply)
                except trio.ClosedResourceError:
                    raise PeerUnavailableError("connection closed") from None
                self._outbox.put_nowait(pieces, urgent=size <= DIRECT_MAX, size=size)
            return None
        if (stream_handler := self._handlers.streaming.get(method)) is not None:
            items = stream_handler(request)
            # this stream's frames that may still be queued (no more than a queue holds)
            queued: deque[list[bytes | memoryview]] = deque(maxlen=self._outbox.capacity)
            try:
                async for item in items:
                    # queued, never written here: this task's scope may be cancelled
                    # any time, and must not cut a write off midway
                    item_frame = RpcFrame(
                        FrameKind.ITEM, request_id, body=item.body, payload=item.payload
                    )
                    pieces, size = self._encode(item_frame)
                    queued.append(pieces)
                    await self._queue(pieces, size)
            except trio.Cancelled:
                # The caller gave up (its cancel, or its deadline): the items still queued
                # would only fill the link, up to 4 MiB a connection, ahead of everything
                # else we send (a slow volunteer's link stayed full for seconds after its
                # step ended, and its DHT pings failed behind it).
                for pieces in queued:
                    self._outbox.withdraw(pieces)
                raise
            finally:
                if (aclose := getattr(items, "aclose", None)) is not None:
                    await aclose()  # an async generator: run its finally blocks now
            return self._encode(RpcFrame(FrameKind.END, request_id)), False
        raise RemoteError("unknown_method", f"no method {method!r}")

    def _encode_reply(self, request_id: int, reply: Reply) -> tuple[list[bytes | memoryview], int]:
        return self._encode(
            RpcFrame(FrameKind.RESPONSE, request_id, body=reply.body, payload=reply.payload)
        )

    async def _queue(
        self, pieces: list[bytes | memoryview], size: int, urgent: bool = False
    ) -> None:
        """Queue a frame for the writer (all of it, or nothing when cancelled).

        Raises:
            PeerUnavailableError: if the connection is closed.
        """
        try:
            await self._outbox.put(pieces, urgent=urgent, size=size)
        except trio.ClosedResourceError:
            raise PeerUnavailableError("connection closed") from None

    async def _send_error(
        self, request_id: int, code: str, message: str, urgent: bool = False
    ) -> None:
        await self._put(_error_frame(request_id, code, message), urgent)

    async def _put(self, frame: RpcFrame, urgent: bool = False) -> None:
        pieces, size = self._encode(frame)
        try:
            await self._send(pieces, size, urgent)
        except trio.ClosedResourceError:
            raise PeerUnavailableError("connection closed") from None


def _error_frame(request_id: int, code: str, message: str) -> RpcFrame:
    return RpcFrame(
        FrameKind.ERROR,
        request_id,
        error_code=code[:MAX_ERROR_CODE_LENGTH],
        error_message=message[:MAX_ERROR_MESSAGE_LENGTH],
    )
