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

import contextlib
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import trio

from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, HEADER, MIN_PEER_FRAME_SIZE
from protocol.identity import PeerID
from protocol.rpc import (
    MAX_ERROR_CODE_LENGTH,
    MAX_ERROR_MESSAGE_LENGTH,
    MAX_INFLIGHT_REQUESTS,
    MAX_REQUEST_ID,
    MAX_TIMEOUT,
    FrameKind,
    RpcFrame,
    decode_rpc_frame,
    encode_rpc_frame,
)

from .calls import STREAM_BUFFER_ITEMS as STREAM_BUFFER_ITEMS
from .calls import ConnectionClosedError as ConnectionClosedError
from .calls import Handler as Handler
from .calls import HandlerRegistry as HandlerRegistry
from .calls import PendingCall, PendingStream
from .calls import QuickHandler as QuickHandler
from .calls import Reply as Reply
from .calls import ReplyStream as ReplyStream
from .calls import Request as Request
from .calls import StreamHandler as StreamHandler
from .errors import LimitExceededError, PeerUnavailableError, RemoteError
from .receive_budget import ReceiveBudget
from .secure import SecureStream
from .send_budget import SendBudget
from .wire import FrameReader, Outbox, TruncatedFrameError, send_coalesced, write_pieces

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

T = TypeVar("T")

WRONG_KIND = "wrong_kind"
"""The code of the :class:`RemoteError` a call gets when the peer answers it as the other
kind of method (stream items for ``call()``, one reply for ``stream()``); raised here, never
sent."""
_STREAMED = "the peer answers this method with a stream: call it with stream(), not call()"
_ANSWERED = "the peer answers this method with one reply: call it with call(), not stream()"

_MIN_TIMEOUT = 1e-3
_NO_LIMIT = (1 << 32) - 1
_DIRECT_MAX = 1 << 16
"""Frames up to this size are written by the task that made them when the stream is idle."""
_WRITE_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
_PEER_SILENCE = 10.0
"""The silence a peer may take for a dead connection (HostConfig.silence_timeout's
default): a reader paused for a stream's consumer shows it is alive more often."""
_PROBE_SLOT_FROM = 16
"""Call slots from which one is kept for the silence probe."""
_PROBE_METHOD = "swarm.silence_probe"
"""A method no peer serves: every peer answers it at once (``unknown_method``), which shows
it alive before a connection is taken for silent (see ``RpcConnection._probe``)."""
_BYE_GRACE = 5.0
"""Seconds a connection closed for idleness keeps its end open after its ``bye``, for the
peer to close first (and the most its watchdog waits for that, the bye's write included)."""


class _Incoming:
    __slots__ = ("by_caller", "queued", "scope")

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope = scope
        self.by_caller = False
        self.queued = False  # in the quick backlog


def _without_frames(exc: BaseException) -> BaseException:
    """``exc``, and the exceptions it chains, without their tracebacks: kept as a closed
    connection's cause, a traceback keeps every local of the frames it went through alive,
    such as the 4 MiB buffer of a frame that a peer announced, sent half of and abandoned
    (a trial's bootstrap node held 155 MiB of them after 60 such connections closed)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        todo += (error.__cause__, error.__context__)
    return exc


class RpcConnection:
    """Calls both ways over one stream. Start :meth:`run` in a nursery, then call."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        peer_id: PeerID,
        handlers: HandlerRegistry,
        *,
        remote_host: str = "?",
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_inflight_requests: int = 128,
        idle_timeout: float = math.inf,
        silence_timeout: float = math.inf,
        receive_budget: ReceiveBudget | None = None,
        receive_group: str | None = None,
        send_budget: SendBudget | None = None,
    ) -> None:
        self._byte_stream = stream
        self._receive_budget = receive_budget
        self._receive_group = receive_group  # what the peer's frames count against in it
        self._reader: FrameReader | None = None
        self.peer_id = peer_id
        self.remote_host = remote_host
        self.max_frame_size = max_frame_size
        # the peer accepts at least the protocol's least maximum, perhaps no more: a frame
        # beyond it that the peer refused would end the connection for every call on it
        self.max_send_frame_size = min(max_frame_size, MIN_PEER_FRAME_SIZE)
        self.max_inflight_requests = max_inflight_requests
        self.idle_timeout = idle_timeout
        self.silence_timeout = silence_timeout
        self._unanswered_since: float | None = None  # see _note_unanswered
        self._probing = False  # see _probe
        self._tasks: trio.Nursery | None = None  # the connection's own, while it runs
        self._handlers = handlers
        self._outbox = Outbox(
            capacity=max(8, max_inflight_requests // 4),
            budget=send_budget,
            group=receive_group,  # the same share of each budget: the peer's host group
        )
        # the peer serves at least the protocol's 128 at once, perhaps no more; one of them
        # is kept for the silence probe (_probe), which must not wait behind our calls
        # (not of a few: a limit set that low is a test's, counted call by call)
        slots = min(max_inflight_requests, MAX_INFLIGHT_REQUESTS)
        self.probe_slot_kept = slots >= _PROBE_SLOT_FROM
        self.call_slots = slots - self.probe_slot_kept
        """Calls of ours in flight at most (``max_inflight_requests``, at most the
        protocol's 128, less the one kept for the silence probe)."""
        self._call_slots = trio.Semaphore(self.call_slots)
        self._pending: dict[int, PendingCall | PendingStream] = {}
        self._incoming: dict[int, _Incoming] = {}
        self._served = trio.lowlevel.ParkingLot()  # a request we served was answered
        self._overflow = trio.Lock()  # quick requests answered off the reader: one at a time
        # (their order; a reply made already, too large for the send budget then)
        self._quick_backlog: deque[tuple[RpcFrame, _Incoming, Reply | None]] = deque()
        self._quick_draining = False  # a task answers the backlog
        self._next_id = 0
        self._scope = trio.CancelScope()
        self._cause: BaseException | None = None
        self._finished = trio.Event()
        self.closed = False
        self.lost = False  # ended by the peer's side (closed, reset, broken), not by us
        self.last_activity = trio.current_time()
        self._frame_received = -math.inf
        self._reader_paused = False  # waiting for a stream's consumer, not reading
        self._bye_cause: BaseException | None = None  # see close_idle_nowait
        self._bye_grace = False

    def __repr__(self) -> str:
        return f"<RpcConnection {self.peer_id.short()} at {self.remote_host}>"

    @property
    def num_inflight(self) -> int:
        """Calls in flight both ways."""
        return len(self._pending) + len(self._incoming)

    # -- lifetime --------------------------------------------------------------------------

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

    @property
    def last_received(self) -> float:
        """trio time bytes from the peer last arrived (-inf: none yet): the last frame, or
        part of one (a ``SecureStream`` tells; a 2 MiB frame can take seconds on a busy
        host, and its bytes show the peer is alive meanwhile)."""
        return max(self._frame_received, getattr(self._byte_stream, "last_received", -math.inf))

    @property
    def write_started(self) -> float | None:
        """When the byte stream's write in progress began (None between writes, or when
        the stream does not tell: only a ``SecureStream`` does)."""
        return getattr(self._byte_stream, "write_started", None)

    def close_nowait(self, cause: BaseException) -> None:
        """End the connection now, on our side's initiative (pending calls fail with
        ``cause``); :meth:`aclose` without waiting for the tasks to finish."""
        self._shutdown(cause)

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

    @property
    def closing(self) -> bool:
        """Closed, or closing after a ``bye`` (see :meth:`close_idle_nowait`)."""
        return self.closed or self._bye_cause is not None

    def abort(self, cause: BaseException) -> None:
        """End the connection now (pending calls fail with ``cause``), e.g. a peer that
        stopped reading: a write stalled on it is cancelled."""
        self.lost = True
        self._shutdown(cause)

    def _shutdown(self, cause: BaseException) -> None:
        if self.closed:
            return
        self.closed = True
        self._cause = cause
        self._scope.cancel()
        self._outbox.close()
        self._served.unpark_all()
        for pending in self._pending.values():
            error = PeerUnavailableError(f"connection to {self.peer_id.short()} lost: {cause}")
            error.__cause__ = cause
            if isinstance(pending, PendingCall):
                if not pending.done.is_set():  # (one already failed keeps its error)
                    pending.error = error
                    pending.done.set()
            elif not pending.finished:
                pending.finish(error)

    async def _guard(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await fn(*args)
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            OSError,
            TruncatedFrameError,  # (a peer killed mid-frame, between transport messages)
        ) as exc:
            logger.debug("%r: connection lost: %r", self, exc)
            if self._bye_cause is not None:
                # the peer closed on reading our bye, perhaps cutting off a frame it was
                # writing (or resetting): no departure, as for a clean end (_read_loop; a
                # review found such a peer pinged back, what the bye is there to spare)
                self._fail_unread()
                self._shutdown(self._bye_cause)
                return
            unread = not isinstance(exc, trio.ClosedResourceError) and self._fail_unread()
            if not self.closed and not unread:
                self.lost = True
            self._shutdown(_without_frames(exc))
        except ProtocolError as exc:
            logger.debug("%r: protocol error, dropping the peer: %s", self, exc)
            self._shutdown(_without_frames(exc))

    # -- calling ---------------------------------------------------------------------------

    async def call(
        self, method: str, body: dict[str, Any] | None = None, payload: bytes | memoryview = b""
    ) -> Reply:
        """Call ``method`` on the peer and wait for its reply.

        Raises:
            RemoteError: the peer's handler failed or refused (typed by ``code``).
            PeerUnavailableError: the connection is closed or died before the reply.
            LimitExceededError: the request is larger than the maximum frame.
        """
        await self._acquire_slot()
        return await self._call_in_slot(method, body, payload)

    async def _call_in_slot(
        self,
        method: str,
        body: dict[str, Any] | None,
        payload: bytes | memoryview,
        *,
        release: bool = True,
    ) -> Reply:
        """:meth:`call`, its call slot acquired (and released here, unless ``release`` is
        False: the probe's slot, kept apart)."""
        try:
            pending = PendingCall()
            sent_at = trio.current_time()
            request_id, request = await self._send_request(method, body, payload, pending)
            try:
                await self._await_answer(pending.done.wait, sent_at)
            except BaseException:
                self._cancel_remote(request_id, pending, request)
                self._note_unanswered(sent_at)
                raise
            finally:
                self._pending.pop(request_id, None)
                # a peer may answer before it read the whole request (a hostile one knows
                # the ids: they count up): the rest goes out from a copy
                self._outbox.detach(request)
        finally:
            if release:
                self._call_slots.release()
        if pending.error is not None:
            raise pending.error from pending.error.__cause__
        assert pending.reply is not None
        return pending.reply

    @property
    def _last_sign_of_use(self) -> float:
        """When the connection was last used: a frame read or written, or, while a frame
        is arriving at 16 KiB/s or more, its last bytes (a 4 MiB frame slower than ~70
        KiB/s was closed for idleness midway; see ``FrameReader.frame_progress``). While a
        frame waits for room in the receive budget, the keepalives we write count as use:
        such a connection is not closed as idle (an honest upload may wait longer than
        ``idle_timeout`` behind a slow frame); the budget's stall rule ends it once its
        frame got room and stalls."""
        reader = self._reader
        progress = -math.inf if reader is None else reader.frame_progress()
        return max(self.last_activity, progress)

    @property
    def not_reading(self) -> bool:
        """Our reader waits, not the peer: for a stream's consumer, or for room in the
        receive budget for the frame it announced."""
        return self._reader_paused or (self._reader is not None and self._reader.waiting)

    async def _await_answer(self, receive: Callable[[], Awaitable[T]], since: float) -> T:
        """``await receive()`` (a reply, or a stream's next item): each time nothing at all
        came from the peer for ``silence_timeout`` since ``since`` (the request, or the
        stream's last item), the silence rule runs as for a call that ended unanswered
        (:meth:`_note_unanswered`: a probe, and the connection closed unless the peer
        answers). Before, the rule ran only when a call ended: one long call to a frozen
        peer waited out its whole deadline, and without one forever (an outside tester).
        A peer that talks meanwhile (the probe's answer included) restarts the count."""
        while True:
            with trio.move_on_at(since + self.silence_timeout):
                return await receive()
            now = trio.current_time()
            writing = self._outbox.writing_since
            if self.last_received > since:
                since = self.last_received
            elif writing is not None and writing < now:
                # our own write is going out (a large frame on a slow uplink: perhaps this
                # very request): the peer may not have the request yet, and a probe would
                # wait behind the write (a 2 MiB call at 100 KiB/s was cut off at 15 s; a
                # review). A write that stalls is the send timeout's (HostConfig).
                since = now
            else:
                self._note_unanswered(since)
                since += self.silence_timeout / 2  # look again once a probe had its time

    def _note_unanswered(self, sent_at: float) -> None:
        """A call sent at ``sent_at`` ended unanswered (its deadline passed, or it was
        cancelled). When calls that waited long enough to expect an answer (a second, or
        a quarter of ``silence_timeout``) got none, and nothing at all came from the peer
        since the first of them was sent, for ``silence_timeout``, the peer is probed
        (:meth:`_probe`) and the connection closed unless it answers: a NAT or middlebox
        that dropped it loses what we write without a reset, and every call would time
        out on it for ~15 minutes (an averaging member was alone round after round). A
        call cancelled sooner (a hedged lookup's) proves nothing: the peer does not answer
        what we cancelled."""
        if self.not_reading or self.closed:
            # not reading: a stream's consumer lags, and the peer may be talking; closed:
            # nothing to probe (a second probe task started on a connection the first had
            # just closed: a review)
            return
        now, received = trio.current_time(), self.last_received
        if self._unanswered_since is not None and received > self._unanswered_since:
            self._unanswered_since = None  # the peer spoke since: slow, not gone
        if self._unanswered_since is None:
            # only a call that waited long enough starts the clock; once it runs, any call
            # ending unanswered checks it (calls queued for a slot on a dead link spent
            # their deadlines waiting, went out for under a second each, and the clock,
            # started once, was never checked again; a review)
            if received > sent_at or now - sent_at < min(1.0, self.silence_timeout / 4):
                return
            self._unanswered_since = sent_at
        silent = now - self._unanswered_since
        if silent >= self.silence_timeout and not self._probing and self._tasks is not None:
            self._probing = True
            self._tasks.start_soon(self._guard, self._probe)

    async def _probe(self) -> None:
        """Ask the peer for a method no peer serves, which a live one answers at once
        (``unknown_method``), and close the connection when nothing at all comes from it
        within half ``silence_timeout`` (more than the pace of a paused reader's
        keepalives): one long call whose handler outlived its deadline on a live peer with
        nothing else to say looked just like a dead link, and the close failed every other
        call on the connection (a review)."""
        wait = self.silence_timeout / 2
        try:
            if not self.probe_slot_kept:  # (few slots in all: wait for one)
                with trio.move_on_after(wait) as slot_wait:
                    await self._acquire_slot()
                if slot_wait.cancelled_caught:
                    # held by a live peer's long handler, maybe: no probe, no verdict
                    self._unanswered_since = None
                    return
            # otherwise in the slot kept for it: waiting for one behind our calls, the
            # probe was never sent while a live peer's long handlers held them all, and
            # the connection closed all the same (a review); giving up then kept a dead
            # connection open for another silence_timeout under steady calls (another)
            asked = trio.current_time()
            with trio.move_on_after(wait):
                with contextlib.suppress(RemoteError):
                    await self._call_in_slot(
                        _PROBE_METHOD, None, b"", release=not self.probe_slot_kept
                    )
        except PeerUnavailableError:
            return  # closed meanwhile
        finally:
            self._probing = False
        if self.closed or self.last_received >= asked or self.not_reading:
            # (>=: an answer in the same instant, as on a network without latency)
            return
        writing = self._outbox.writing_since
        if writing is not None and writing <= asked:
            # a write of ours that began before the probe is still going out: the probe
            # waits behind it, unsent; no verdict (a write that stalls: the send timeout)
            self._unanswered_since = None
            return
        since = asked if self._unanswered_since is None else self._unanswered_since
        silent = trio.current_time() - since
        logger.debug("%r: nothing from the peer for %.1f s while calls waited", self, silent)
        self.abort(
            PeerUnavailableError(f"nothing from the peer for {silent:.1f} s while calls waited")
        )

    def stream(
        self, method: str, body: dict[str, Any] | None = None, payload: bytes | memoryview = b""
    ) -> AbstractAsyncContextManager[ReplyStream]:
        """Call a streaming ``method``; iterate the context's value for the reply items.

        Leaving the context early cancels the call on the peer. Iteration raises what
        :meth:`call` raises.
        """
        return self._stream(method, body, payload)

    @asynccontextmanager
    async def _stream(
        self, method: str, body: dict[str, Any] | None, payload: bytes | memoryview
    ) -> AsyncIterator[ReplyStream]:
        await self._acquire_slot()
        try:
            pending = PendingStream()
            sent_at = trio.current_time()
            request_id, request = await self._send_request(method, body, payload, pending)
            try:
                yield ReplyStream(pending, self._await_answer, sent_at)
            finally:
                if not _finished(pending):  # left unanswered: as a call's (see call)
                    self._note_unanswered(sent_at)
                self._cancel_remote(request_id, pending, request)
                self._pending.pop(request_id, None)
                self._outbox.detach(request)  # (see call)
                pending.receive.close()
                pending.taken.set()  # a reader waiting for room: the send now fails
        finally:
            self._call_slots.release()

    async def _acquire_slot(self) -> None:
        # No scheduler pass when a slot is free: the call checkpoints when it sends.
        try:
            self._call_slots.acquire_nowait()
        except trio.WouldBlock:
            await self._call_slots.acquire()

    async def _send_request(
        self,
        method: str,
        body: dict[str, Any] | None,
        payload: bytes | memoryview,
        pending: PendingCall | PendingStream,
    ) -> tuple[int, list[bytes | memoryview]]:
        """Send a request frame; its id, and its pieces (to withdraw it on cancellation).

        Raises:
            ConnectionClosedError: closed, or closing after our ``bye`` (the peer would
                not read the request): never sent, the host sends it on another connection.
        """
        self._check_open()
        if self._bye_cause is not None:
            raise ConnectionClosedError(
                f"connection to {self.peer_id.short()} is closing"
            ) from self._bye_cause
        request_id = self._allocate_id()
        frame = RpcFrame(
            FrameKind.REQUEST,
            request_id,
            method=method,
            body={} if body is None else body,
            payload=payload,
            timeout=_time_left(),
        )
        pieces, size = self._encode(frame)
        self._pending[request_id] = pending
        now = trio.current_time()
        if now - self.last_activity >= self.idle_timeout / 2:
            pending.sent_quiet = now
        try:
            await self._send(pieces, size, urgent=True, request_id=request_id)
        except trio.ClosedResourceError:
            self._pending.pop(request_id, None)
            self._check_open()
            raise
        except BaseException as exc:
            self._pending.pop(request_id, None)
            if isinstance(pending.error, ConnectionClosedError):  # the write failed on a
                raise pending.error from exc  # connection the peer closed for idleness: retry
            raise
        return request_id, pieces

    async def _send(
        self,
        pieces: list[bytes | memoryview],
        size: int,
        urgent: bool = False,
        request_id: int | None = None,
    ) -> None:
        """Write a frame now when the stream is idle and the frame small, else queue it
        (ahead of the bulk frames when ``urgent`` and small: see ``Outbox``). A request's
        frame gives its ``request_id`` (see :meth:`_write_claimed`).

        Raises:
            trio.ClosedResourceError: if the connection is closed (nothing was sent).
            PeerUnavailableError: if the direct write failed (the connection is gone).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._claim_direct(size):
            await self._outbox.put(pieces, urgent=urgent and size <= _DIRECT_MAX, size=size)
            return
        # No checkpoint since the one above, so nothing interrupts the write before its
        # first byte. A cancellation after it leaves the frame's rest with the secure
        # stream (see ``_write_claimed``); any other interruption ends the connection.
        await self._write_claimed(pieces, request_id)

    def _claim_direct(self, size: int) -> bool:
        """Whether a frame of ``size`` bytes may be written directly, the stream claimed
        for it (then :meth:`_write_claimed` it, with no checkpoint in between)."""
        return size <= _DIRECT_MAX and self._outbox.try_claim(size)

    async def _write_claimed(
        self, pieces: list[bytes | memoryview], request_id: int | None = None
    ) -> None:
        """Write a frame on the stream claimed by :meth:`_claim_direct` (a request's,
        when ``request_id`` is given).

        Raises:
            PeerUnavailableError: if the write failed (the connection is gone).
        """
        try:
            await write_pieces(self._byte_stream, pieces)
        except trio.Cancelled:
            stream = self._byte_stream
            if not (isinstance(stream, SecureStream) and stream.intact):
                logger.debug("%r: write interrupted midway by a cancellation", self)
                self._shutdown(PeerUnavailableError("a write was interrupted midway"))
                raise
            # The frame was sealed whole; the stream sends what it still owes of it first
            # at its next send: the writer makes one now (the connection lives on). A
            # request thus reaches the peer after its caller gave up: a cancel follows it.
            flush: list[bytes | memoryview] = []
            if request_id is not None:
                flush = self._encode(RpcFrame(FrameKind.CANCEL, request_id))[0]
            self._outbox.put_nowait(flush, urgent=bool(flush))  # (see _cancel_remote)
            raise
        except BaseException as exc:
            cause = exc if isinstance(exc, _WRITE_ERRORS) else None
            logger.debug("%r: write interrupted: %r", self, exc)
            if isinstance(exc, trio.BrokenResourceError | OSError):
                self._fail_unread()
            self._shutdown(cause or PeerUnavailableError("a write was interrupted midway"))
            if cause is not None:
                raise PeerUnavailableError(f"connection lost: {exc}") from exc
            raise
        finally:
            self._outbox.release()
        self.last_activity = trio.current_time()

    def _cancel_remote(
        self,
        request_id: int,
        pending: PendingCall | PendingStream,
        request: list[bytes | memoryview],
    ) -> None:
        """Tell the peer a call was given up (nothing when the request was still queued:
        withdrawn). The caller then detaches the request from the writer, given up or not
        (a peer may answer before it read all of it), so that its payload is never read
        after the call returned."""
        finished = _finished(pending)
        if finished or self.closed:
            return
        if self._outbox.withdraw(request):
            return  # never sent: the peer knows nothing of it
        # The writer may be sealing this payload slice by slice from the caller's buffer:
        # it finishes from a copy (the peer then gets the request, and the cancel). The
        # cancel goes with the requests (urgent, in order): our slot is free once we return,
        # and a request sent in it must not reach the peer first (one more than
        # max_inflight_requests in flight there: it ends the connection, a review found).
        self._outbox.put_nowait(
            self._encode(RpcFrame(FrameKind.CANCEL, request_id))[0], urgent=True
        )

    def _check_open(self) -> None:
        if self.closed:
            error = ConnectionClosedError(f"connection to {self.peer_id.short()} is closed")
            raise error from self._cause

    def _allocate_id(self) -> int:
        while True:
            request_id = self._next_id
            self._next_id = (self._next_id + 1) & MAX_REQUEST_ID
            if request_id not in self._pending:
                return request_id

    def _encode(self, frame: RpcFrame) -> tuple[list[bytes | memoryview], int]:
        """The frame's pieces and their total size in bytes.

        Raises:
            LimitExceededError: if the frame exceeds ``max_send_frame_size``.
            LocalProtocolError: if the frame is invalid (see ``encode_rpc_frame``).
        """
        pieces = encode_rpc_frame(frame, _NO_LIMIT)
        total = len(pieces[0]) + memoryview(pieces[1]).nbytes
        if total - HEADER.size > self.max_send_frame_size:
            raise LimitExceededError(
                f"a {frame.kind.value!r} frame of {total - HEADER.size} bytes exceeds the "
                f"maximum {self.max_send_frame_size} (what every peer accepts); send large "
                "data in several calls or stream items"
            )
        return pieces, total

    # -- reading ---------------------------------------------------------------------------

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        reader = self._reader = FrameReader(
            self._byte_stream,
            self.max_frame_size,
            budget=self._receive_budget,
            group=self._receive_group,
            # while a frame waits for the receive budget the peer is not read, its calls
            # unanswered: it took us for gone after its silence timeout (a review)
            keepalive=self._keepalive,
            keepalive_every=min(self.silence_timeout, _PEER_SILENCE) / 4,
        )
        while (data := await reader.next_frame()) is not None:
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
        # A connection quiet for half the idle timeout was most likely closed by the
        # peer's idle timer (it is alive); one in use was closed by a peer that left. The
        # idle timer's work too: a connection whose only news since it went quiet is calls
        # of ours, unanswered. The peer never read them: they fail as never sent, and the
        # host retries them on a fresh connection.
        if self._bye_cause is not None:  # the peer closed on reading our bye
            self._fail_unread()
            self._shutdown(self._bye_cause)
            return
        quiet = trio.current_time() - self.last_activity >= self.idle_timeout / 2
        if not self._fail_unread() and not self.closed and not quiet:
            self.lost = True
        self._shutdown(PeerUnavailableError("the peer closed the connection"))

    def _peer_said_bye(self) -> None:
        """The peer closes this connection, idle on its side: every call of ours still
        waiting crossed its ``bye`` unread; they fail as never sent (the host sends them
        again on a fresh connection). Not a departure: ``lost`` stays False."""
        self._fail_as_unread(p for p in self._pending.values() if not _finished(p))
        self._shutdown(PeerUnavailableError("the peer closed the idle connection"))

    def _fail_unread(self) -> bool:
        """The peer closed or broke the connection: fail as never sent (the host retries
        them) the calls sent after it went quiet for half the idle timeout with nothing
        heard since, which its idle timer most likely closed before reading them. Whether
        there were any."""
        if self.closed:
            return False
        unread = [
            p
            for p in self._pending.values()
            if p.sent_quiet is not None
            and self._frame_received < p.sent_quiet  # nothing came: no reply, no item
            and not _finished(p)
        ]
        self._fail_as_unread(unread)
        return bool(unread)

    def _fail_as_unread(self, calls: Iterable[PendingCall | PendingStream]) -> None:
        """Fail ``calls`` as never read by the peer (``ConnectionClosedError``: the host
        sends them again on a fresh connection)."""
        message = f"{self.peer_id.short()} closed the idle connection before reading the request"
        for pending in list(calls):
            if isinstance(pending, PendingCall):
                pending.error = ConnectionClosedError(message)
                pending.done.set()
            else:
                pending.finish(ConnectionClosedError(message))

    def _start_request(self, frame: RpcFrame, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._serve_request, frame, self._register(frame))

    def _register(self, frame: RpcFrame) -> _Incoming:
        if frame.request_id in self._incoming:
            raise RemoteProtocolError(f"request id {frame.request_id} is already in flight")
        if len(self._incoming) >= self.max_inflight_requests:
            raise RemoteProtocolError(f"more than {self.max_inflight_requests} requests in flight")
        deadline = math.inf if frame.timeout is None else trio.current_time() + frame.timeout
        incoming = _Incoming(trio.CancelScope(deadline=deadline))
        self._incoming[frame.request_id] = incoming
        return incoming

    def _queue_quick(
        self,
        frame: RpcFrame,
        nursery: trio.Nursery,
        incoming: _Incoming | None = None,
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

    async def _deliver(self, frame: RpcFrame) -> None:
        pending = self._pending.get(frame.request_id)
        if pending is None:
            return  # a late answer to a call we gave up on
        kind = frame.kind
        error = None
        if kind is FrameKind.ERROR:
            error = RemoteError(frame.error_code, frame.error_message)
        if isinstance(pending, PendingCall):
            if kind is FrameKind.RESPONSE:
                pending.reply = Reply(frame.body, frame.payload)
            elif error is not None:
                pending.error = error
            else:
                # items or an end: the peer serves this method as a stream and our caller
                # used call() (a mistake on our side, most likely). That call fails, and is
                # cancelled; the connection stays (closing it failed every other call on it
                # with "connection lost", which named no mistake: an outside tester).
                pending.error = RemoteError(WRONG_KIND, _STREAMED)
                self._outbox.put_nowait(
                    self._encode(RpcFrame(FrameKind.CANCEL, frame.request_id))[0], urgent=True
                )
            del self._pending[frame.request_id]
            pending.done.set()
            return
        if kind is FrameKind.ITEM:
            # the consumer may have left (it sent a cancel): drop the item
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._hand_over(pending, Reply(frame.body, frame.payload))
            return
        if kind is FrameKind.RESPONSE:  # a plain method called with stream(): as above
            error = RemoteError(WRONG_KIND, _ANSWERED)
        del self._pending[frame.request_id]
        pending.finish(error)

    async def _hand_over(self, pending: PendingStream, item: Reply) -> None:
        """Hand ``item`` to a stream's consumer. When its buffer is full (in items, or in
        payload bytes: ``PendingStream.has_room``), our reader stops until the consumer
        takes one (the backpressure that bounds what a stream holds): nothing is read from
        the peer meanwhile, which is our pause, not the peer's silence (see
        ``_note_unanswered``)."""
        size = memoryview(item.payload).nbytes
        if pending.has_room(size):
            pending.send.send_nowait(item)  # (room for it: no wait, nothing to cancel)
            pending.held += size
            # the consumer's turn before the next frame is read, as the awaited send gave
            # it (without: a member whose link reset mid result stream lost the part in
            # half of the runs of test_averaging_bad_networks's reset test); shielded, so
            # a cancel cannot come between the count and the item
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self._reader_paused = True
        try:
            # paced for the peer's silence rule, not ours (the protocol's 10 s at most:
            # with ours longer, or off, the peer took us for silent; a review)
            interval = min(self.silence_timeout, _PEER_SILENCE) / 4
            while True:
                with trio.move_on_after(interval):  # (an item not sent when it fires)
                    while not pending.has_room(size):
                        if not pending.send.statistics().open_receive_channels:
                            break  # the consumer left: the send below raises
                        await pending.taken.wait()
                    # no checkpoint from here on: a cancel between counting the bytes and
                    # the send left them counted for an item never buffered, and the
                    # stream stuck once they added up (a review)
                    pending.send.send_nowait(item)
                    pending.held += size
                    return
                self._keepalive()
        finally:
            self._reader_paused = False
            self._frame_received = trio.current_time()

    def _keepalive(self) -> None:
        """Show the peer we are alive while our reader waits for a stream's consumer (or
        for the receive budget: ``FrameReader``): its calls to us go unanswered meanwhile,
        and after ``silence_timeout`` it took us for gone and closed the connection, the
        stream with it (a review). A ``cancel`` for a request id we have no call under:
        the peer ignores it (protocol.md, section 4)."""
        request_id = MAX_REQUEST_ID
        while request_id in self._pending:
            request_id -= 1
        frame = RpcFrame(FrameKind.CANCEL, request_id)
        self._outbox.put_nowait(self._encode(frame)[0], urgent=True)

    # -- serving ---------------------------------------------------------------------------

    async def _serve_request(
        self, frame: RpcFrame, incoming: _Incoming, reply: Reply | None = None
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
        await self._queue(pieces, size, urgent=urgent and size <= _DIRECT_MAX)
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
        self._outbox.put_nowait(pieces, urgent=size <= _DIRECT_MAX, size=size)  # (large: bulk)

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
                    bulk = size > _DIRECT_MAX
                    if (bulk and not self._outbox.has_room()) or not self._outbox.budget_fits(size):
                        del pieces
                        await self._outbox.wait_for_room(bulk=bulk, size=size)
                        pieces, size = self._encode_reply(request_id, reply)
                except trio.ClosedResourceError:
                    raise PeerUnavailableError("connection closed") from None
                self._outbox.put_nowait(pieces, urgent=size <= _DIRECT_MAX, size=size)
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

    # -- writing and idling ----------------------------------------------------------------

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


def _time_left() -> float | None:
    deadline = trio.current_effective_deadline()
    if math.isinf(deadline):
        return None
    return min(max(deadline - trio.current_time(), _MIN_TIMEOUT), MAX_TIMEOUT)


def _error_frame(request_id: int, code: str, message: str) -> RpcFrame:
    return RpcFrame(
        FrameKind.ERROR,
        request_id,
        error_code=code[:MAX_ERROR_CODE_LENGTH],
        error_message=message[:MAX_ERROR_MESSAGE_LENGTH],
    )


def _finished(pending: PendingCall | PendingStream) -> bool:
    return pending.done.is_set() if isinstance(pending, PendingCall) else pending.finished
