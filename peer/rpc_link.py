"""The state one RPC connection shares between its calling and serving sides, and its writes.

:class:`RpcLink` is the base of :class:`~peer.rpc.RpcConnection` (see ``peer/rpc.py`` for the
connection's rules): the calls in flight both ways, the outbox, the closing, and how a frame
is written (directly by the task that made it when the stream is idle, else through the
writer's queue). The calling side is in ``rpc_calling.py``, the serving side in
``rpc_serving.py``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from protocol.errors import ProtocolError
from protocol.framing import DEFAULT_MAX_FRAME_SIZE, HEADER, MIN_PEER_FRAME_SIZE
from protocol.identity import PeerID
from protocol.rpc import (
    MAX_INFLIGHT_REQUESTS,
    MAX_REQUEST_ID,
    FrameKind,
    RpcFrame,
    encode_rpc_frame,
)

from .calls import ConnectionClosedError, HandlerRegistry, PendingCall, PendingStream, Reply
from .errors import LimitExceededError, PeerSilentError, PeerUnavailableError
from .receive_budget import ReceiveBudget
from .secure import SecureStream
from .send_budget import SendBudget
from .wire import FrameReader, Outbox, TruncatedFrameError, write_pieces

logger = logging.getLogger("peer.rpc")

_NO_LIMIT = (1 << 32) - 1
DIRECT_MAX = 1 << 16
"""Frames up to this size are written by the task that made them when the stream is idle."""
_WRITE_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
PEER_SILENCE = 10.0
"""The silence a peer may take for a dead connection (HostConfig.silence_timeout's
default): a reader paused for a stream's consumer shows it is alive more often."""
_PROBE_SLOT_FROM = 16
"""Call slots from which one is kept for the silence probe."""


class Incoming:
    """A request of the peer's that we serve: its deadline and cancel scope."""

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


class RpcLink:
    """One connection's shared state, its closing and its writes (the base of
    ``RpcConnection``, which adds the reader, the writer and the idle timer)."""

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
        self.dialed: str | None = None  # the HOST:PORT we dialed (None: the peer dialed us)
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
        self._incoming: dict[int, Incoming] = {}
        self._served = trio.lowlevel.ParkingLot()  # a request we served was answered
        self._overflow = trio.Lock()  # quick requests answered off the reader: one at a time
        # (their order; a reply made already, too large for the send budget then)
        self._quick_backlog: deque[tuple[RpcFrame, Incoming, Reply | None]] = deque()
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
            kind = PeerSilentError if isinstance(cause, PeerSilentError) else PeerUnavailableError
            error = kind(f"connection to {self.peer_id.short()} lost: {cause}")
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
                self._shutdown(self._bye_cause)
                return
            # No bye came: the peer may have read and served our calls still waiting
            # (they fail, never sent again: a handler must not run twice, a review)
            if not self.closed:
                self.lost = True
            self._shutdown(_without_frames(exc))
        except ProtocolError as exc:
            logger.debug("%r: protocol error, dropping the peer: %s", self, exc)
            self._shutdown(_without_frames(exc))

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

    def _check_open(self) -> None:
        if self.closed:
            error = ConnectionClosedError(f"connection to {self.peer_id.short()} is closed")
            raise error from self._cause

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
            await self._outbox.put(pieces, urgent=urgent and size <= DIRECT_MAX, size=size)
            return
        # No checkpoint since the one above, so nothing interrupts the write before its
        # first byte. A cancellation after it leaves the frame's rest with the secure
        # stream (see ``_write_claimed``); any other interruption ends the connection.
        await self._write_claimed(pieces, request_id)

    def _claim_direct(self, size: int) -> bool:
        """Whether a frame of ``size`` bytes may be written directly, the stream claimed
        for it (then :meth:`_write_claimed` it, with no checkpoint in between)."""
        return size <= DIRECT_MAX and self._outbox.try_claim(size)

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
            self._shutdown(cause or PeerUnavailableError("a write was interrupted midway"))
            if cause is not None:
                raise PeerUnavailableError(f"connection lost: {exc}") from exc
            raise
        finally:
            self._outbox.release()
        self.last_activity = trio.current_time()

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


def call_finished(pending: PendingCall | PendingStream) -> bool:
    """Whether a call of ours has its answer (a reply, an error, or a stream's end)."""
    return pending.done.is_set() if isinstance(pending, PendingCall) else pending.finished
