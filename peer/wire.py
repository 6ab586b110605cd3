"""The RPC data path on a stream: a frame reader, and (from :mod:`peer.outbox`, re-exported
here) a bounded outbox for the writer.

Frames are ``protocol.framing`` frames (4-byte big-endian length, then the content). The reader
takes each frame's buffer from a process-wide :class:`FramePool` (reused once nothing refers
to it: no page faults in steady state) and, on a :class:`~peer.secure.SecureStream`, decrypts
straight into it, so a large payload is copied exactly once after the kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from protocol.errors import RemoteProtocolError
from protocol.framing import HEADER

from .buffer_pool import FRAME_POOL, POOL_MIN, FramePool
from .outbox import BATCH_BYTES as BATCH_BYTES
from .outbox import FILLING_WRITE as FILLING_WRITE
from .outbox import QUEUE_BYTES as QUEUE_BYTES
from .outbox import Outbox, Piece, coalesce, send_coalesced, write_pieces
from .receive_budget import MIN_RATE, ByteMeter, Meter, ReceiveBudget
from .secure import RECEIVE_SIZE, SecureStream

__all__ = [
    "FramePool",
    "FrameReader",
    "Outbox",
    "Piece",
    "TruncatedFrameError",
    "coalesce",
    "send_coalesced",
    "write_pieces",
]


class _PlainReceiver:
    """``receive_into`` for a stream that only has ``receive_some``."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._pending = memoryview(b"")

    async def receive_into(self, buffer: memoryview) -> int:
        if not self._pending:
            data = await self._stream.receive_some(RECEIVE_SIZE)
            if not data:
                return 0
            self._pending = memoryview(data).cast("B")
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


class TruncatedFrameError(RemoteProtocolError):
    """The stream ended inside a frame: a protocol violation, but most likely a peer that
    died while it wrote a large frame (killed between two of its transport messages), so
    a departure too (``peer.rpc`` reports the connection lost, as for a reset)."""


class FrameReader:
    """Whole frames from a stream, each in its own buffer (large ones from ``pool``, and
    within ``budget`` while they arrive, counted against remote host ``group``)."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        max_frame_size: int,
        pool: FramePool = FRAME_POOL,
        budget: ReceiveBudget | None = None,
        group: str | None = None,
        keepalive: Callable[[], None] | None = None,
        keepalive_every: float = math.inf,
    ) -> None:
        self.max_frame_size = max_frame_size
        # run every ``keepalive_every`` seconds while a frame waits for the budget (the
        # peer is not read then, and its calls go unanswered: see ReceiveBudget.acquire)
        self._keepalive = keepalive
        self._keepalive_every = keepalive_every
        self._receive_into = (
            stream.receive_into
            if isinstance(stream, SecureStream)
            else _PlainReceiver(stream).receive_into
        )
        self._wait_buffered = stream.wait_buffered if isinstance(stream, SecureStream) else None
        self._stream = stream if isinstance(stream, SecureStream) else None  # (its unread)
        self._head = bytearray(HEADER.size)
        self._pool = pool
        self._budget = budget
        self._group = group
        # a SecureStream counts its bytes as they come, whole messages or not
        self._own_meter: ByteMeter | None = None
        self._meter: Meter
        if isinstance(stream, SecureStream):
            self._meter = stream
        else:
            self._meter = self._own_meter = ByteMeter()
        self.waiting = False
        """Parked until the budget has room: the peer is not read meanwhile (our pause,
        not its silence)."""
        self.in_frame = False
        """A frame's header came and its body is not all in yet (or waits for room)."""
        self._frame_started = -math.inf
        self._frame_base = 0

    def frame_progress(self) -> float:
        """While a frame arrives: when its bytes last came, but no later than its start plus
        what they would take at ``MIN_RATE`` (a trickle of a byte a minute does not keep a
        connection busy); -inf between frames."""
        if not self.in_frame:
            return -math.inf
        received = self._meter.bytes_received - self._frame_base
        return min(self._meter.last_received, self._frame_started + received / MIN_RATE)

    async def next_frame(self) -> memoryview | None:
        """The next frame's content, or None at a clean end of stream.

        Raises:
            RemoteProtocolError: for a frame over ``max_frame_size`` or a truncated frame,
                or one cut off by the budget (it stalled while other frames waited).
            trio.BrokenResourceError: if the stream failed.
        """
        if not await self._fill(memoryview(self._head), at_boundary=True):
            return None
        (length,) = HEADER.unpack(self._head)
        if length > self.max_frame_size:
            raise RemoteProtocolError(
                f"peer sent a frame of {length} bytes; the maximum is {self.max_frame_size}"
            )
        self.in_frame = True
        self._frame_started = trio.current_time()
        self._frame_base = self._meter.bytes_received
        try:
            return await self._frame(length)
        finally:
            self.in_frame = False

    async def _frame(self, length: int) -> memoryview:
        budget = self._budget
        if length < POOL_MIN or budget is None:
            return await self._body(length)
        # the size of the buffer it will take (pooled sizes are whole multiples of 64 KiB)
        size = -(-length // POOL_MIN) * POOL_MIN
        self.waiting = True
        try:
            hold = await budget.acquire(
                size,
                self._group,
                self._meter,
                self._keepalive,
                self._keepalive_every,
                arrived=min(length, self._stream.unread) if self._stream is not None else 0,
            )
        finally:
            self.waiting = False
        try:
            with hold.scope:
                # within the budget, the buffer comes at once (the budget bounds what
                # announced frames hold): each message then decrypts straight into it as
                # it comes, and what the frame got is its plaintext (held back as
                # ciphertext until half of it was in, it could be empty messages)
                return await self._body(length, wait_for_half=False)
            raise RemoteProtocolError(
                f"a frame of {length} bytes stalled (nothing for {budget.stall_timeout:g} s, or "
                f"under {MIN_RATE >> 10} KiB/s) while other frames waited for the receive budget"
            )
        finally:
            budget.release(hold)

    async def _body(self, length: int, wait_for_half: bool = True) -> memoryview:
        if wait_for_half and length >= POOL_MIN and self._wait_buffered is not None:
            # Allocate once half of it is here: a peer that announces 4 MiB frames and
            # sends nothing more would otherwise make each connection hold 4 MiB.
            await self._wait_buffered(length // 2)
        frame = self._pool.get(length)
        await self._fill(frame, at_boundary=False)
        return frame

    async def _fill(self, target: memoryview, *, at_boundary: bool) -> bool:
        filled = 0
        while filled < len(target):
            n = await self._receive_into(target[filled:])
            if not n:
                if at_boundary and not filled:
                    return False
                raise TruncatedFrameError("stream ended inside a frame (truncated frame)")
            filled += n
            if self._own_meter is not None:
                self._own_meter.bytes_received += n
                self._own_meter.last_received = trio.current_time()
        return True
