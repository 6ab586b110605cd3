"""Chunks into a reducer (``Admission``, a base class of
:class:`~.reducing.ReducerService`): each chunk RPC is checked, waits for admission while
the bytes kept for exact exclusion would exceed ``retain_budget`` (first come first
served, one sender always fits) and for our own values, and is added; a retried call
takes the place of its first one; a dropped or complete sender gives its slot back. The
rules are reducing.py's module docstring's."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from peer import RemoteError, Reply
from protocol.identity import PeerID

from .messages import ChunkHeader
from .plan import Liveness, Plan
from .reducer import ChunkRejected, DropReason, PartReducer

logger = logging.getLogger("training.averaging.reducing")  # (the log names stay as they were)


class Admission:
    """The chunks in of :class:`~.reducing.ReducerService`, one of its base classes (the
    attributes below are the service's)."""

    plan: Plan
    part: int
    liveness: Liveness
    reducer: PartReducer
    loaded: trio.Event
    part_bytes: int
    budget: int
    progress: dict[PeerID, list[float]]
    _admitted: set[PeerID]
    _admitted_at: dict[PeerID, float]
    _released: set[PeerID]
    _queue: list[PeerID]
    _waiters: dict[PeerID, int]
    _waiting_calls: dict[tuple[PeerID, int], tuple[trio.CancelScope, trio.Event]]
    _retries: set[tuple[PeerID, int]]
    _reserved: int
    _changed: trio.Event
    # and one of its methods
    _notify: Callable[[], None]

    async def on_chunk(
        self, sender: PeerID, header: ChunkHeader, payload: bytes | memoryview
    ) -> Reply:
        """Take one chunk (or a withdrawal) from ``sender``.

        Raises:
            RemoteError: ``dropped`` (with the reason) once the sender no longer counts for
                this part; ``bad_request`` for a chunk that is not for this part.
        """
        reducer = self.reducer
        if header.part != self.part or sender not in reducer.senders:
            raise RemoteError("bad_request", f"part {header.part} is not reduced here for you")
        if header.abort is not None:
            if header.abort is DropReason.TIMEOUT:
                # its step ended (Butterfly._withdraw): it will not fetch our result either,
                # nor serve its own part. (Its group tag says it is this step's word: one of
                # its step before, in a round of the same number, is not_found.)
                self.liveness.mark_left(sender, DropReason.TIMEOUT)
            self._drop(sender, header.abort)
            return Reply({})
        self._check_pending(sender)
        key = (sender, header.chunk)
        retried = not header.retry and key in self._retries
        if retried and (
            key in self._waiting_calls
            or reducer.is_resend(sender, header.chunk, payload, header.raw)
        ):
            # The first call of a chunk whose retry came first: both were parked until our
            # group was confirmed, and the retry woke first (it now waits, or was taken).
            # It is superseded, as in _supersede, not a second copy (that dropped an honest
            # sender as garbage and benched it: a review).
            raise RemoteError("bad_request", f"chunk {header.chunk} was sent again")
        placed = False  # holds the sender's place in the admission queue (see _supersede)
        try:
            if header.retry:
                if reducer.is_resend(sender, header.chunk, payload, header.raw):
                    return Reply({})  # its first answer was lost with a reset connection
                placed = await self._supersede(sender, header.chunk)
                self._check_pending(sender)
            # a lying header or a payload of the wrong size is refused before the call
            # waits (holding its payload) for admission, and so is a second call for the
            # same chunk: what waits for a sender is at most the encoded part that
            # admission counts
            self._refuse_if(reducer.check_chunk, sender, header, payload)
        except BaseException:
            if placed:
                self._stop_waiting(sender)
            raise
        if header.retry:
            self._retries.add(key)
        scope, over = self._waiting_calls[key] = (trio.CancelScope(), trio.Event())
        try:
            with scope:
                await self._admit(sender, placed)
                await self.loaded.wait()
            if scope.cancelled_caught:
                raise RemoteError("bad_request", f"chunk {header.chunk} was sent again")
            if not reducer.loaded:
                raise RemoteError("dropped", DropReason.TIMEOUT.value)
            self._check_pending(sender)
            self._refuse_if(reducer.add_chunk, sender, header, payload)
        finally:
            reducer.forget_chunk(sender, header.chunk)
            if self._waiting_calls.get(key) == (scope, over):  # (not superseded)
                del self._waiting_calls[key]
            over.set()
        self.progress.setdefault(sender, [0.0])[0] = trio.current_time()
        if not reducer.is_pending(sender):  # that chunk completed its part
            self._release(sender)
        return Reply({})

    async def _supersede(self, sender: PeerID, index: int) -> bool:
        """A retried chunk whose first call still waits here (for admission, or for our
        own values): that call's connection broke, silently for us (a NAT dropped it), and
        its answer could not reach the sender anyway. The retry takes its place (one
        payload held, as before), rather than being refused as a second copy, which
        dropped an honest sender as garbage.

        It takes the sender's place in the admission queue too: the sender is counted as
        waiting (for the retry) before the first call leaves, which would otherwise take
        it out of the queue, to the back of the line. Returns whether it was counted so:
        pass that on to :meth:`_admit`, or undo it with :meth:`_stop_waiting`."""
        waiting = self._waiting_calls.get((sender, index))
        if waiting is None:
            return False
        scope, over = waiting
        self._waiters[sender] = self._waiters.get(sender, 0) + 1
        try:
            scope.cancel()
            await over.wait()
        except BaseException:
            self._stop_waiting(sender)
            raise
        return True

    def _refuse_if(
        self,
        check: Callable[[PeerID, int, int, float, bytes | memoryview, bool], object],
        sender: PeerID,
        header: ChunkHeader,
        payload: bytes | memoryview,
    ) -> None:
        """Run ``check`` (a chunk's check, or its addition) for ``sender``'s chunk.

        Raises:
            RemoteError: ``dropped`` with the reason, when it refused the chunk.
        """
        try:
            check(sender, header.chunk, header.epoch, header.weight, payload, header.raw)
        except ChunkRejected as exc:
            logger.debug("round %d: dropping %s: %s", self.plan.round, sender.short(), exc)
            self._after_drop(sender)
            raise RemoteError("dropped", exc.reason.value) from None

    def _check_pending(self, sender: PeerID) -> None:
        if not self.reducer.is_pending(sender):
            reason = self.reducer.reason(sender)
            raise RemoteError("dropped", "complete" if reason is None else reason.value)

    async def _admit(self, sender: PeerID, placed: bool = False) -> None:
        """Wait until ``sender`` is admitted (``placed``: already counted as waiting, see
        :meth:`_supersede`)."""
        if sender in self._admitted:
            if placed:
                self._stop_waiting(sender)
            return
        if sender not in self._queue:
            self._queue.append(sender)
            self._notify()  # the holders of admission now have somebody waiting
        if not placed:
            self._waiters[sender] = self._waiters.get(sender, 0) + 1
        try:
            while sender not in self._admitted:
                # dropped while queued (a withdrawal, a failed probe): out of the queue
                self._check_pending(sender)
                if self._queue[0] == sender and (
                    self._reserved == 0 or self._reserved + self.part_bytes <= self.budget
                ):
                    self._queue.pop(0)
                    self._admitted.add(sender)
                    self._reserved += self.part_bytes
                    self._admitted_at[sender] = trio.current_time()
                    self.progress[sender] = [trio.current_time()]
                    self._notify()
                    break
                await self._changed.wait()
        finally:
            self._stop_waiting(sender)

    def _stop_waiting(self, sender: PeerID) -> None:
        """One call of ``sender`` no longer waits for admission; with none left waiting,
        the sender leaves the queue (its calls gave up while queued)."""
        self._waiters[sender] -= 1
        if not self._waiters[sender] and sender in self._queue:
            self._queue.remove(sender)
            self._notify()

    def _release(self, sender: PeerID) -> None:
        if sender in self._admitted and sender not in self._released:
            self._released.add(sender)
            self._reserved -= self.part_bytes
        if sender in self._queue:
            self._queue.remove(sender)
        self._notify()

    def drop_sender(self, sender: PeerID, reason: DropReason) -> None:
        """Leave a pending sender out of the part (nothing happens for anyone else)."""
        if self.reducer.is_pending(sender):
            self._drop(sender, reason)

    def _drop(self, sender: PeerID, reason: DropReason) -> None:
        self.reducer.drop(sender, reason)
        self._after_drop(sender)

    def _after_drop(self, sender: PeerID) -> None:
        self._release(sender)
