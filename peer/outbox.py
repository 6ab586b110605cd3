"""The writing half of the RPC data path: a bounded outbox of frames for the connection's
writer (:class:`Outbox`), and the writes that send its batches, small pieces joined and
large ones uncopied (:func:`send_coalesced`, :func:`write_pieces`). The frame reader is
:mod:`peer.wire`'s, which re-exports every name here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import trio

from .secure import SEAL_SLICE, SecureStream
from .send_budget import CHARGED_FROM, SendBudget, Wait

__all__ = [
    "BATCH_BYTES",
    "FILLING_WRITE",
    "QUEUE_BYTES",
    "Outbox",
    "Piece",
    "coalesce",
    "send_coalesced",
    "write_pieces",
]

Piece = bytes | bytearray | memoryview
BATCH_BYTES = 1 << 20
"""The writer takes queued frames until it holds about this many bytes."""
QUEUE_BYTES = 4 << 20
"""Bulk frames queued beyond this many bytes make :meth:`Outbox.put` wait (an empty queue
takes one frame of any size): what a peer that stops reading can make us hold."""
FILLING_WRITE = 1 << 15
"""A write of this many bytes or more may leave the stream's buffers full (the kernel's,
or the peer's window): the next frames go through the writer (see :meth:`Outbox.try_claim`)."""
_COALESCE_BELOW = 1 << 16
"""Adjacent pieces smaller than this are joined before sealing (one message, not many)."""


class Outbox:
    """Frames waiting for the writer, and who holds the stream for writing.

    ``put`` waits while ``capacity`` frames are queued; ``put_nowait`` (for small control
    frames) never waits. A task may instead write a frame itself when nobody is writing and
    nothing is queued (:meth:`try_claim`, then :meth:`release`): one scheduler hop less
    than handing it to the writer. Closing wakes everyone.

    A direct write blocked on a full stream would be at the mercy of its task's cancel
    scope (a deadline, a lookup that no longer needs the answer). A ``SecureStream`` keeps
    what a cancelled write did not send and sends it first next time (the writer is woken
    for it), but on any other stream a write cut off midway ends the connection for every
    call on it. The stream is full only after large writes, so none is allowed right after
    one (of ``FILLING_WRITE`` bytes or more): the writer, whom no caller cancels, writes
    the next frames until one of its writes is small.

    ``urgent`` frames (small requests and unary replies, whose order relative to other
    requests' frames does not matter) skip the queue: the writer takes them before any bulk
    frame still waiting. Otherwise a reply that paces a sender's uploads would wait behind
    megabytes of our own uploads on the same connection, and the sender's window would stall.
    They have a queue of their own, of the same ``capacity``: a peer that sends requests
    but never reads our answers fills it, its requests then stay in flight until the
    in-flight limit or the stalled write's send timeout cuts it off (see ``HostConfig``),
    and memory stays bounded.

    The bulk queue is bounded in bytes too (``max_bytes``): a peer that asks for large
    replies (a FIND_VALUE page is 1 MiB) and never reads them would otherwise make us hold
    ``capacity`` of them per connection. And frames of ``CHARGED_FROM`` bytes or more, in
    either queue, count against the host's ``budget`` (all connections together, and
    ``group``'s share of it: ``peer.send_budget``) from when they are queued until they are
    written, withdrawn or the outbox closes; ``put`` waits for room there too.
    """

    def __init__(
        self,
        capacity: int,
        max_bytes: int = QUEUE_BYTES,
        budget: SendBudget | None = None,
        group: str | None = None,
    ) -> None:
        self._budget = budget
        self._group = group
        self._charges: dict[int, int] = {}  # id of a queued frame -> what it took from budget
        self._charged = 0  # taken from the budget and not given back: queued and writing
        self._batch_charge = 0  # of which the batch being written holds this much
        self._budget_waits: set[Wait] = set()  # ours, woken on close
        self._items: deque[Sequence[Piece]] = deque()
        self._urgent: deque[Sequence[Piece]] = deque()
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._queued_bytes = 0  # of the bulk frames in ``_items``
        self._space = trio.lowlevel.ParkingLot()
        self._urgent_space = trio.lowlevel.ParkingLot()
        self._ready = trio.lowlevel.ParkingLot()
        self._idle = trio.lowlevel.ParkingLot()  # waiters for "everything written"
        self._closed = False
        self._busy = False  # a task is writing to the stream
        self._batch: list[Sequence[Piece]] = []  # the frames the writer is writing now
        self._sending: list[Piece] = []  # their pieces, coalesced, as the writer reads them
        self._writing_bytes = 0  # the size of the write in progress
        self.writing_since: float | None = None
        """When the write in progress (a batch, or a direct write) began; None when idle."""
        self._after_large_write = False  # the last write may have filled the stream

    async def put(self, pieces: Sequence[Piece], urgent: bool = False, size: int = -1) -> None:
        """Queue one frame's pieces (``size``: their bytes, when the caller knows them);
        either queued or (on cancel/close) not at all.

        Raises:
            trio.ClosedResourceError: if the outbox is closed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        space = self._urgent_space if urgent else self._space
        if size < 0:
            size = _size_of(pieces)
        while not self._closed:
            if not self.has_room(urgent):
                await space.park()
            elif not self.budget_fits(size):
                assert self._budget is not None
                await self._budget.wait(size, self._group, self._budget_waits)
            else:
                break
        if self._closed:
            raise trio.ClosedResourceError("the connection is closed")
        self._append(pieces, urgent, size)
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def wait_for_room(self, bulk: bool = False, size: int = 0) -> None:
        """Until the urgent queue (and the bulk one, if ``bulk``) takes a frame and the
        host's budget one of ``size`` bytes; then :meth:`put_nowait` it with no checkpoint
        in between. (A reply made before the wait, its size known, need not be held
        meanwhile: it is made again after.)

        Raises:
            trio.ClosedResourceError: if the outbox is closed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()  # (a request its caller cancelled)
        while not self._closed:
            if bulk and not self.has_room(False):
                await self._space.park()
            elif not self.has_room(True):
                await self._urgent_space.park()
            elif not self.budget_fits(size):
                assert self._budget is not None
                await self._budget.wait(size, self._group, self._budget_waits)
            else:
                return
        raise trio.ClosedResourceError("the connection is closed")

    def budget_fits(self, size: int) -> bool:
        """Whether a frame of ``size`` bytes fits the host's send budget now (small ones
        always do: they take nothing from it)."""
        return size < CHARGED_FROM or self._budget is None or self._budget.fits(size, self._group)

    def put_nowait(self, pieces: Sequence[Piece], urgent: bool = False, size: int = -1) -> None:
        """Queue a frame regardless of capacity; dropped when the outbox is closed."""
        if not self._closed:
            self._append(pieces, urgent, size)

    def _append(self, pieces: Sequence[Piece], urgent: bool, size: int) -> None:
        if size < 0:
            size = _size_of(pieces)
        if urgent:
            self._urgent.append(pieces)
        else:
            self._items.append(pieces)
            self._queued_bytes += size
        if size >= CHARGED_FROM and self._budget is not None:
            self._budget.take(size, self._group)
            self._charges[id(pieces)] = size
            self._charged += size
        if not self._busy:
            self._ready.unpark()

    def _give_back(self, size: int) -> None:
        if size and self._budget is not None:
            self._charged -= size
            self._budget.give(size, self._group)

    def has_room(self, urgent: bool = False) -> bool:
        """True when fewer than ``capacity`` frames are queued (urgent ones, if ``urgent``)
        and, for bulk frames, fewer than ``max_bytes`` bytes."""
        if urgent:
            return len(self._urgent) < self._capacity
        return len(self._items) < self._capacity and self._queued_bytes < self._max_bytes

    @property
    def capacity(self) -> int:
        """The most frames either queue holds."""
        return self._capacity

    @property
    def empty(self) -> bool:
        """Nothing queued, nothing being written."""
        return not (self._busy or self._items or self._urgent)

    def try_claim(self, size: int = 0) -> bool:
        """Take the stream for a direct write of ``size`` bytes: True when open, idle,
        nothing is queued and the last write was small (then call :meth:`release` after
        writing)."""
        if self._busy or self._items or self._urgent or self._closed or self._after_large_write:
            return False
        self._busy = True
        self._writing_bytes = size
        self.writing_since = trio.current_time()
        return True

    def release(self) -> None:
        """The stream is free again; the writer takes over what was queued meanwhile."""
        self._busy = False
        self.writing_since = None
        self._give_back(self._batch_charge)
        self._batch_charge = 0
        self._batch.clear()
        self._sending = []
        self._after_large_write = self._writing_bytes >= FILLING_WRITE
        if self._items or self._urgent:
            self._ready.unpark()
        else:
            self._idle.unpark_all()

    async def drained(self) -> None:
        """Wait until every queued frame was written (or the outbox closed)."""
        while not self._closed and not self.empty:
            await self._idle.park()

    async def get_batch(self) -> list[Piece]:
        """The pieces of one or more queued frames, in order and coalesced (waits for at
        least one, and for the stream to be free); holds the stream until :meth:`release`.
        Write them with :func:`send_coalesced`, which reads the list again after every
        await (see :meth:`detach`).

        Raises:
            trio.ClosedResourceError: if the outbox is closed.
        """
        while not self._closed and (self._busy or not (self._items or self._urgent)):
            await self._ready.park()
        if self._closed:
            raise trio.ClosedResourceError("the connection is closed")
        self._busy = True
        self.writing_since = trio.current_time()
        pieces: list[Piece] = []
        self._urgent_space.unpark(count=len(self._urgent))
        urgent_size = 0
        charges = self._charges
        while self._urgent:
            frame = self._urgent.popleft()
            self._batch.append(frame)
            pieces.extend(frame)
            urgent_size += _size_of(frame)
            self._batch_charge += charges.pop(id(frame), 0)
        size = taken = 0
        while self._items and size < BATCH_BYTES:
            frame = self._items.popleft()
            self._batch.append(frame)
            pieces.extend(frame)
            size += _size_of(frame)
            taken += 1
            self._batch_charge += charges.pop(id(frame), 0)
        if taken:  # frame slots, bytes or both freed
            self._queued_bytes -= size
            # all of them: bytes, not frames, left; a woken waiter may have been cancelled
            self._space.unpark_all()
        self._writing_bytes = urgent_size + size
        self._sending = coalesce(pieces)
        return self._sending

    def withdraw(self, frame: Sequence[Piece]) -> bool:
        """Take ``frame`` (the very object put) out of the queue: True if it was still
        queued, so none of it will be written."""
        for index, queued in enumerate(self._urgent):
            if queued is frame:
                del self._urgent[index]
                self._give_back(self._charges.pop(id(frame), 0))
                self._urgent_space.unpark()
                return True
        for index, queued in enumerate(self._items):
            if queued is frame:
                del self._items[index]
                self._queued_bytes -= _size_of(frame)
                self._give_back(self._charges.pop(id(frame), 0))
                self._space.unpark_all()
                return True
        return False

    def writing(self, frame: Sequence[Piece]) -> bool:
        """True while the writer's current batch holds ``frame`` (it may still read it)."""
        return any(taken is frame for taken in self._batch)

    def detach(self, frame: Sequence[Piece]) -> None:
        """Let the writer finish ``frame`` (in the batch being written) from a copy of its
        large pieces, so that their owner may reuse its buffers at once: a call cancelled
        midway through its upload, or answered before the peer read all of it. The frame
        still goes out whole (cutting it short would end the connection for every call on
        it); the copy costs one pass over it, and only then (small pieces were joined into
        copies already). Nothing to do once closed: the writer is cancelled, and sends
        nothing more."""
        if self._closed or not self.writing(frame):
            return
        for piece in frame:
            for index, sending in enumerate(self._sending):
                if sending is piece:
                    self._sending[index] = bytes(piece)

    def close(self) -> None:
        self._closed = True
        self._items.clear()
        self._urgent.clear()
        self._queued_bytes = 0
        self._charges.clear()
        self._give_back(self._charged)  # the batch being written too: it is cut off
        self._batch_charge = 0
        for wait in self._budget_waits:  # they see the outbox closed
            wait.event.set()
        self._space.unpark_all()
        self._urgent_space.unpark_all()
        self._ready.unpark_all()
        self._idle.unpark_all()


def _size_of(frame: Sequence[Piece]) -> int:
    return sum(memoryview(p).nbytes for p in frame)


def coalesce(pieces: Sequence[Piece]) -> list[Piece]:
    """``pieces`` with small neighbours joined (sealed as one message, not many); large
    ones kept as they are, uncopied."""
    merged: list[Piece] = []
    small: list[Piece] = []
    for piece in pieces:
        size = memoryview(piece).nbytes
        if size >= _COALESCE_BELOW:
            if small:
                merged.append(b"".join(small))
                small = []
            merged.append(piece)
        elif size:
            small.append(piece)
    if small:
        merged.append(b"".join(small))
    return merged


async def send_coalesced(stream: trio.abc.Stream, pieces: list[Piece]) -> None:
    """Write ``pieces`` (from :func:`coalesce`) in order. The list is read again after
    every await, so that its owner may swap a piece for a copy meanwhile
    (:meth:`Outbox.detach`); no view of a swapped-out piece is read after that.

    Raises:
        trio.BrokenResourceError: if the stream failed.
        trio.ClosedResourceError: if the stream was closed.
    """
    if isinstance(stream, SecureStream):
        await stream.send_pieces(pieces)
        return
    for index in range(len(pieces)):
        size = memoryview(pieces[index]).nbytes
        for start in range(0, size, SEAL_SLICE):
            with memoryview(pieces[index]) as view, view.cast("B") as flat:
                data = bytes(flat[start : start + SEAL_SLICE])  # send_all may read it later
            await stream.send_all(data)


async def write_pieces(stream: trio.abc.Stream, pieces: Sequence[Piece]) -> None:
    """Write ``pieces`` in order: small neighbours joined, large ones passed through uncopied
    (on a :class:`~peer.secure.SecureStream`).

    Raises:
        trio.BrokenResourceError: if the stream failed.
        trio.ClosedResourceError: if the stream was closed.
    """
    await send_coalesced(stream, coalesce(pieces))
