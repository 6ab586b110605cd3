"""Multiplexed RPC over one stream: many concurrent calls, each with a deadline.

One :class:`RpcConnection` per secure stream. Its :meth:`~RpcConnection.run` owns three kinds of
task in one nursery: the reader (dispatches frames), the writer (frames reach it through a
bounded outbox), and one task per incoming request. A small frame is written by the task
that made it when the stream is idle (no hop through the writer); anything else queues.

Rules (see ``protocol/rpc.py`` for the frames):

- ``req``/``cancel`` go caller -> callee; ``res``/``item``/``end``/``err`` go back. Each side
  numbers its own calls.
- The caller sends the time left before its effective deadline as ``t``; the callee runs the
  handler under ``move_on_after(t)`` and answers ``err timeout`` when it runs out.
- A caller cancelled mid-call sends ``cancel``; the callee cancels that handler. Late frames
  for finished calls are ignored. A call never reads its payload after it returned: a
  cancelled request still queued is withdrawn (nothing sent, no ``cancel``), and one whose
  payload is being written is finished from a copy (zero-copy tensor uploads rely on it;
  cutting the frame short would end the connection for every call on it), and so is one
  answered before the peer read all of it.
- A handler's ``RemoteError`` keeps its code, a ``ProtocolError`` is ``bad_request``, anything
  else ``internal``; an unregistered method is ``unknown_method``.
- More than ``max_inflight_requests`` concurrent requests from the peer, an oversized or
  malformed frame, or a frame that breaks the rules: the connection is dropped. Our own calls
  wait for a slot instead, so that two peers with the same limits never trip each other.
- Quick requests that come while the outbox is full are answered by tasks, one at a time:
  a large reply waits for room (``QUEUE_BYTES`` of bulk frames), so that a peer that asks
  for large replies and reads none holds its in-flight slots, not our memory.
- When the connection ends, every pending call fails at once with ``PeerUnavailableError``.
  A direct write cut off midway (a deadline while the socket is full) ends the connection
  too: the stream cannot be resynchronised after half a sealed frame. So such writes are
  kept from harm's way: none right after a large write (the socket may be full: see
  ``Outbox``), and a handler's frames are queued while the caller's cancel or deadline may
  still cut in (its last one is written directly outside that scope).
- With no call in flight either way and no frame read or written for ``idle_timeout``
  seconds, the connection closes itself.
- A streaming reply is buffered up to ``STREAM_BUFFER_ITEMS`` items; beyond that the reader
  waits for the consumer (head-of-line blocking for the whole connection), so consume promptly.
"""

from __future__ import annotations

import logging
import math
import time

import trio

from protocol.rpc import FrameKind, RpcFrame, decode_rpc_frame

from .calls import STREAM_BUFFER_ITEMS as STREAM_BUFFER_ITEMS
from .calls import ConnectionClosedError as ConnectionClosedError
from .calls import Handler as Handler
from .calls import HandlerRegistry as HandlerRegistry
from .calls import QuickHandler as QuickHandler
from .calls import Reply as Reply
from .calls import ReplyStream as ReplyStream
from .calls import Request as Request
from .calls import StreamHandler as StreamHandler
from .errors import PeerUnavailableError
from .rpc_calling import WRONG_KIND as WRONG_KIND
from .rpc_calling import Calling
from .rpc_link import PEER_SILENCE
from .rpc_serving import Serving
from .wire import FrameReader, send_coalesced

__all__ = [
    "ConnectionClosedError",
    "Handler",
    "HandlerRegistry",
    "QuickHandler",
    "Reply",
    "ReplyStream",
    "Request",
    "RpcConnection",
    "StreamHandler",
]

logger = logging.getLogger(__name__)

_BYE_GRACE = 5.0
"""Seconds a connection closed for idleness keeps its end open after its ``bye``, for the
peer to close first (and the most its watchdog waits for that, the bye's write included)."""
_HOLD_LOOP_AT_MOST = 0.005  # seconds of frames handled in a row before other tasks run


class RpcConnection(Calling, Serving):
    """Calls both ways over one stream. Start :meth:`run` in a nursery, then call.

    The calling side is ``Calling`` (``rpc_calling.py``), the serving side ``Serving``
    (``rpc_serving.py``), their shared state and writes ``RpcLink`` (``rpc_link.py``); this
    class adds the connection's tasks: the reader, the writer and the idle timer."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until it ends; connection failures are not raised."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    self._tasks = nursery
                    nursery.start_soon(self._guard, self._read_loop, nursery)
                    nursery.start_soon(self._guard, self._write_loop)
                    if math.isfinite(self.idle_timeout):
                        nursery.start_soon(self._guard, self._idle_watchdog)
                    task_status.started()
        finally:
            self._shutdown(self._cause or PeerUnavailableError("connection closed"))
            await trio.aclose_forcefully(self._byte_stream)
            self._finished.set()

    async def flush(self) -> None:
        """Wait until the requests we serve are answered and every queued frame is written
        (or the connection ended): a peer that leaves cleanly first finishes what it
        started, e.g. a result stream whose last chunks are still queued."""
        while not self.closed and self._incoming:
            await self._served.park()
        await self._outbox.drained()

    async def aclose(self) -> None:
        """Close the connection; pending calls fail with ``PeerUnavailableError``."""
        self._shutdown(PeerUnavailableError("connection closed locally"))
        await self._finished.wait()

    def close_idle_nowait(self, cause: BaseException, *, grace: bool = False) -> None:
        """End an idle connection on our side's initiative, telling the peer first (a
        ``bye`` frame, then the close once it is written): the peer then reads the close
        as ours, not as a departure, so it does not dial back to check on us (which, with
        every slot taken, would push another idle peer out, and so on), and it sends again
        on a fresh connection any request that crossed the ``bye``: we do not serve
        requests that arrive after it. A connection already closing is left as it is.

        The bye goes after the frames already queued (a reply queued, its request no
        longer counted in flight, was overtaken by an urgent bye: the peer failed it as
        unread and sent it again, running the handler twice; a review). With ``grace``
        (the idle timer's close) our end then stays open until the peer closes its own,
        or ``_BYE_GRACE``; without (making room for a newcomer) it closes once the bye is
        written, so that the slot is free at once."""
        if self.closed or self._bye_cause is not None:
            return
        self._bye_cause = cause
        self._bye_grace = grace
        self._outbox.put_nowait(self._encode(RpcFrame(FrameKind.BYE, 0))[0])

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        reader = self._reader = FrameReader(
            self._byte_stream,
            self.max_frame_size,
            budget=self._receive_budget,
            group=self._receive_group,
            # while a frame waits for the receive budget the peer is not read, its calls
            # unanswered: it took us for gone after its silence timeout (a review)
            keepalive=self._keepalive,
            keepalive_every=min(self.silence_timeout, PEER_SILENCE) / 4,
        )
        # Frames already read and deciphered come without a scheduler pass, and quick
        # handlers run inline: a security review's 128 pipelined stores of 64 signed
        # entries held every other task of the node for 1.7 s. Other tasks run after every
        # 5 ms spent on frames (time spent waiting for them is not counted: no extra pass
        # for a frame that comes after a pause).
        handling, started = 0.0, None
        while True:
            if started is not None:
                handling += time.perf_counter() - started
                if handling > _HOLD_LOOP_AT_MOST:
                    await trio.lowlevel.checkpoint()
                    handling = 0.0
            if (data := await reader.next_frame()) is None:
                break
            started = time.perf_counter()
            self.last_activity = self._frame_received = trio.current_time()
            frame = decode_rpc_frame(data)
            del data  # hold no frame buffer while waiting: the reader reuses free ones
            if frame.kind is FrameKind.REQUEST:
                if self._bye_cause is not None:
                    continue  # crossed our bye: the peer sends it again elsewhere
                quick = self._handlers.quick.get(frame.method)
                if (
                    quick is not None
                    and self._outbox.has_room()
                    and self._outbox.has_room(True)
                    and not self._quick_backlog  # (in turn)
                ):
                    self._answer_quick(frame, quick, nursery)
                elif quick is not None:
                    self._queue_quick(frame, nursery)
                else:
                    self._start_request(frame, nursery)
            elif frame.kind is FrameKind.BYE:
                self._peer_said_bye()
                return
            elif frame.kind is FrameKind.CANCEL:
                incoming = self._incoming.pop(frame.request_id, None)
                if incoming is not None:
                    incoming.by_caller = True
                    incoming.scope.cancel()
                    if incoming.queued:  # nothing to answer: out of the backlog now (a
                        # request and its cancel, again and again, piled up there)
                        for index, entry in enumerate(self._quick_backlog):
                            if entry[1] is incoming:
                                del self._quick_backlog[index]
                                break
            else:
                await self._deliver(frame)
            del frame
        # The peer closed on reading our bye: no departure. Otherwise it closed without a
        # bye of its own (its idle timer says one first: _peer_said_bye), a departure;
        # our calls still waiting may have been read and served: they fail (sent again,
        # a handler could run twice; a review)
        if self._bye_cause is not None:
            self._shutdown(self._bye_cause)
            return
        if not self.closed:
            self.lost = True
        self._shutdown(PeerUnavailableError("the peer closed the connection"))

    async def _write_loop(self) -> None:
        while True:
            pieces = await self._outbox.get_batch()
            await send_coalesced(self._byte_stream, pieces)
            del pieces
            self._outbox.release()
            self.last_activity = trio.current_time()
            if self._bye_cause is not None and self._outbox.empty:
                # Our bye is written. The peer closes when it reads it (a request of its
                # that crossed the bye then fails there as unread and goes again on a fresh
                # connection); until then, or the grace, our end stays open, so that its
                # writes meanwhile do not fail as a lost connection instead (a review)
                if self._bye_grace:
                    await trio.sleep(_BYE_GRACE)
                self._shutdown(self._bye_cause)
                return

    async def _idle_watchdog(self) -> None:
        while True:
            deadline = self._last_sign_of_use + self.idle_timeout
            now = trio.current_time()
            if now >= deadline:
                if not self.num_inflight and not self._call_slots.statistics().tasks_waiting:
                    logger.debug("%r: idle for %.1f s, closing", self, self.idle_timeout)
                    # With a bye first: a request of the peer's crossing our close is then
                    # sent again on a fresh connection, whatever the peer's own idle
                    # timeout (its guess that we never read it went by its own: a call
                    # failed when the two differed, a review found)
                    cause = PeerUnavailableError("connection closed for idleness")
                    self.close_idle_nowait(cause, grace=True)
                    await trio.sleep(_BYE_GRACE)  # the writer closes once the bye is out
                    self._shutdown(cause)
                    return
                deadline = now + self.idle_timeout
            await trio.sleep_until(deadline)
